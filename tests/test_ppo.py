"""The pure PPO math of ppo.py against hand-computed and naive references.

Run: python -m pytest -q tests/test_ppo.py -x
"""
import dataclasses
import json
import math
import time

import pytest
import torch

import ppo
from tasks import Trajectory


# ---------------------------------------------------------------- GAE

def naive_gae(rewards, values, mask, gamma, lam):
    """Reference: per row, collect the masked steps in order and run the textbook recursion on them."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        steps = [t for t in range(T) if mask[b][t]]
        a_next, v_next = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            a_next = delta + gamma * lam * a_next
            v_next = values[b][t]
            adv[b][t] = a_next
    return adv


def loop_gae(rewards, values, mask, gamma, lam):
    """Reference: the O(T) python loop over positions, vectorised over rows (what compute_gae was before its
    scan). Off-mask positions carry the next step's value and advantage through."""
    m = mask.to(values.dtype)
    B, T = rewards.shape
    adv = torch.zeros_like(values)
    next_v = torch.zeros(B, dtype=values.dtype)
    next_a = torch.zeros(B, dtype=values.dtype)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        on = m[:, t] > 0
        adv[:, t] = torch.where(on, a, torch.zeros_like(a))
        next_v = torch.where(on, values[:, t], next_v)
        next_a = torch.where(on, a, next_a)
    return adv, (adv + values) * m


def test_gae_hand_unrolled_single_turn():
    # three policy tokens after a two-token prompt; reward 3 on the last policy token; padding after it
    mask = torch.tensor([[0, 0, 1, 1, 1, 0.]])
    values = torch.tensor([[9, 9, 0.5, 1.0, 2.0, 9]])  # values off the mask must not matter
    rewards = torch.tensor([[0, 0, 0, 0, 3.0, 0]])
    g, l = 1.0, 0.95
    d4 = 3.0 + g * 0.0 - 2.0        # V(s_T) = 0
    d3 = 0.0 + g * 2.0 - 1.0
    d2 = 0.0 + g * 1.0 - 0.5
    a4 = d4
    a3 = d3 + g * l * a4
    a2 = d2 + g * l * a3
    adv, ret = ppo.compute_gae(rewards, values, mask, g, l)
    torch.testing.assert_close(adv, torch.tensor([[0, 0, a2, a3, a4, 0.]]))
    torch.testing.assert_close(ret, torch.tensor([[0, 0, a2 + 0.5, a3 + 1.0, a4 + 2.0, 0.]]))


def test_gae_multi_turn_gap_bootstraps_from_next_turn():
    # turn 1 = positions 1,2; observation tokens 3,4 (not steps); turn 2 = positions 5,6; reward on 6
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1.]])
    values = torch.tensor([[0, 0.1, 0.2, 7.0, 7.0, 0.3, 0.4]])
    rewards = torch.tensor([[0, 0, 0, 0, 0, 0, 1.0]])
    g, l = 0.9, 0.8
    a6 = 1.0 - 0.4
    a5 = (g * 0.4 - 0.3) + g * l * a6
    a2 = (g * 0.3 - 0.2) + g * l * a5   # gap skipped: bootstrap is V at position 5, one discount step
    a1 = (g * 0.2 - 0.1) + g * l * a2
    adv, _ = ppo.compute_gae(rewards, values, mask, g, l)
    torch.testing.assert_close(adv, torch.tensor([[0, a1, a2, 0, 0, a5, a6]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 23
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[0] = 0  # an empty row
    values = torch.randn(B, T, generator=g)
    rewards = torch.randn(B, T, generator=g) * mask
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam)
    ref = torch.tensor(naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam))
    torch.testing.assert_close(adv, ref)
    torch.testing.assert_close(ret, (ref + values) * mask)


def test_gae_lambda_one_gamma_one_is_monte_carlo():
    mask = torch.tensor([[1, 1, 0, 1, 1.]])
    values = torch.randn(1, 5)
    rewards = torch.tensor([[0.5, 0, 0, 0, 2.0]])
    _, ret = ppo.compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(ret, torch.tensor([[2.5, 2.0, 0, 2.0, 2.0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 1.0), (0.99, 0.9), (1.0, 0.0)])
def test_gae_scan_matches_loop_on_long_multi_turn_rows(gamma, lam):
    """Rows of different lengths with many turns (gaps), an empty row and padding: the vectorised GAE equals
    the position loop, including across gaps longer than any power-of-two shift."""
    g = torch.Generator().manual_seed(3)
    B, T = 4, 3000
    mask = torch.zeros(B, T)
    for b, (start, end) in enumerate([(10, 3000), (500, 2100), (0, 0), (7, 2999)]):
        pos = start
        while pos < end:  # turns of 1-200 policy tokens, observations of 0-300 tokens
            n = int(torch.randint(1, 200, (1,), generator=g))
            mask[b, pos:min(end, pos + n)] = 1
            pos += n + int(torch.randint(0, 300, (1,), generator=g))
    values = torch.randn(B, T, generator=g)
    rewards = torch.zeros(B, T)
    for b in range(B):
        if mask[b].any():
            rewards[b, int(mask[b].nonzero()[-1])] = float(b) - 1.0
    rewards += 0.1 * torch.randn(B, T, generator=g) * mask   # dense rewards too
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = loop_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-4, atol=1e-4)
    assert adv[2].abs().sum() == 0 and (adv * (1 - mask)).abs().sum() == 0


def test_gae_128k_tokens_under_half_a_second():
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core CI box: OpenMP threads next to other jobs only add noise
    try:
        _gae_128k()
    finally:
        torch.set_num_threads(n_threads)


def _gae_128k():
    g = torch.Generator().manual_seed(0)
    n = 131072
    mask = (torch.rand(1, n, generator=g) > 0.1).float()
    values = torch.randn(1, n, generator=g)
    rewards = torch.zeros(1, n)
    rewards[0, int(mask[0].nonzero()[-1])] = 3.0
    ppo.compute_gae(rewards, values, mask)  # warm-up
    t = time.perf_counter()
    adv, _ = ppo.compute_gae(rewards, values, mask)
    dt = time.perf_counter() - t
    assert dt < 0.5, f"GAE on {n} tokens took {dt:.2f} s"
    ref, _ = loop_gae(rewards[:, -5000:], values[:, -5000:], mask[:, -5000:], 1.0, 0.95)
    # the last 5,000 positions see no step after them, so the loop on that slice is exact there too
    torch.testing.assert_close(adv[:, -5000:], ref, rtol=1e-4, atol=1e-4)


def test_gae_rejects_reward_off_mask():
    with pytest.raises(AssertionError):
        ppo.compute_gae(torch.tensor([[1.0, 0]]), torch.zeros(1, 2), torch.tensor([[0, 1.0]]))


# ---------------------------------------------------------------- losses

def _batch(B=8, T=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T, (B,), generator=g)
    starts = torch.randint(0, 3, (B,), generator=g)
    mask = torch.zeros(B, T)
    for b in range(B):
        mask[b, starts[b]:min(T, starts[b] + lengths[b])] = 1
    old_logp = -torch.rand(B, T, generator=g) * 3
    logp = (old_logp + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g)
    return logp, old_logp, adv, mask


def test_clipfrac_zero_and_kl_zero_at_ratio_one():
    logp, old, adv, mask = _batch()
    loss, st = ppo.ppo_policy_loss(old.clone().requires_grad_(True), old, adv, mask)
    assert st["clipfrac"] == 0.0 and abs(st["approx_kl"]) < 1e-7
    # at ratio 1 the loss is minus the per-trajectory-then-batch mean advantage
    per_traj = (adv * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(loss, -per_traj.mean())


def test_policy_loss_hand_case_clip_higher():
    # one trajectory, two tokens: ratio 1.5 with A>0 (clipped at 1.28), ratio 0.5 with A<0 (clipped at 0.8)
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.tensor([[1.0, -2.0]])
    loss, st = ppo.ppo_policy_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.28)
    expect = (-(1.28 * 1.0) + (0.8 * 2.0)) / 2
    assert math.isclose(loss.item(), expect, rel_tol=1e-6)
    assert st["clipfrac"] == 1.0
    k3 = ((1.5 - 1 - math.log(1.5)) + (0.5 - 1 - math.log(0.5))) / 2
    assert math.isclose(st["approx_kl"], k3, rel_tol=1e-5)


def test_policy_loss_per_trajectory_then_batch():
    # a long and a short trajectory weigh the same (§4.1), unlike a flat token mean
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0.]])
    adv = torch.tensor([[1.0, 1, 1, 1], [-3.0, 0, 0, 0]])
    loss, _ = ppo.ppo_policy_loss(logp, logp, adv, mask)
    assert math.isclose(loss.item(), -((1.0) + (-3.0)) / 2)


@pytest.mark.parametrize("which", ["policy", "value"])
def test_loss_invariant_under_micro_batching(which):
    logp, old, adv, mask = _batch(B=8, T=19, seed=1)
    ret = torch.randn(8, 19)

    def loss_fn(lp, sl, num_traj):
        if which == "policy":
            return ppo.ppo_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], num_traj=num_traj)[0]
        return ppo.value_loss(lp[sl], ret[sl], mask[sl], old_values=old[sl], clip=0.2, num_traj=num_traj)[0]

    full = loss_fn(logp, slice(0, 8), None)
    (g_full,) = torch.autograd.grad(full, logp)
    acc = torch.zeros_like(logp)
    total = 0.0
    for sl in (slice(0, 3), slice(3, 4), slice(4, 8)):  # uneven micro-batches, gradient accumulation
        lp = logp.detach().clone().requires_grad_(True)
        l = loss_fn(lp, sl, 8)
        l.backward()
        acc += lp.grad
        total += l.item()
    torch.testing.assert_close(acc, g_full)
    assert math.isclose(total, full.item(), rel_tol=1e-5)


def test_value_loss_hand_case_and_clip():
    v = torch.tensor([[1.0, 3.0]])
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[2.0, 2.0]])
    loss, _ = ppo.value_loss(v, ret, torch.ones(1, 2))
    assert math.isclose(loss.item(), 0.5 * (1 + 1) / 2)
    # clipped at 0.5: v_clipped = [0.5, 0.5] -> errors [2.25, 2.25]; max with [1, 1]
    loss, st = ppo.value_loss(v, ret, torch.ones(1, 2), old_values=old, clip=0.5)
    assert math.isclose(loss.item(), 0.5 * 2.25) and st["vf_clipfrac"] == 1.0


def test_masked_helpers():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0.]])
    assert ppo.masked_mean(x, m).item() == 2.5
    torch.testing.assert_close(ppo.masked_mean(x, m, dim=1), torch.tensor([1.5, 3.5]))
    assert math.isclose(ppo.masked_var(x, m).item(), 5 / 3, rel_tol=1e-6)   # of 1, 2, 3, 4 (Bessel); masked-out ignored
    ret = torch.tensor([[1.0, 2.0, 3.0]])
    ones = torch.ones(1, 3)
    assert ppo.explained_variance(ret, ret, ones) == 1.0
    assert math.isclose(ppo.explained_variance(torch.full((1, 3), 2.0), ret, ones), 0.0, abs_tol=1e-6)
    assert ppo.explained_variance(-ret, ret, ones) < 0
    flat = torch.full((1, 3), -1.0) + 1e-8 * torch.tensor([[1.0, -1.0, 0.5]])  # equal up to float32 rounding
    assert math.isnan(ppo.explained_variance(torch.zeros(1, 3), flat, ones))


def test_kl_penalty_zero_at_reference():
    logp, old, _, mask = _batch()
    assert ppo.kl_penalty(old, old, mask).item() == 0.0
    assert ppo.kl_penalty(logp, old, mask).item() > 0.0


# ---------------------------------------------------------------- chunked log-probs

def _full_logprobs(model, ids, attn, temperature=1.0):
    """Reference: the full (B, T, V) fp32 logits of the causal LM, log_softmax, gather (and the entropy)."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    full = torch.log_softmax(logits, -1)
    pad = lambda x: torch.nn.functional.pad(x, (1, 0))  # noqa: E731
    return pad(logp), pad(-(full.exp() * full).sum(-1))


@pytest.fixture(scope="module")
def small_lm():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    base = Qwen3MoeForCausalLM(cfg)
    for p in base.parameters():
        p.requires_grad_(False)
    model, _ = ppo.add_actor_critic_adapters(base, rank=4, alpha=8, targets="attention,experts")
    for p in ppo.adapter_params(model, "actor"):  # a trained-looking actor: LoRA B is no longer zero
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_chunked_logprobs_equal_full_values_and_gradients(small_lm, chunk, monkeypatch):
    """Chunked, policy-positions-only log-probs and entropies equal the full-vocabulary computation at the
    policy positions (0 elsewhere), and so do the LoRA gradients of a loss on them."""
    monkeypatch.setattr(ppo, "LOGIT_CHUNK", chunk)
    model = small_lm
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 21), generator=g)
    attn = torch.ones_like(ids)
    attn[2, 15:] = 0
    mask = (torch.rand(3, 21, generator=g) > 0.3).float() * attn
    mask[:, 0] = 0
    ps = ppo.adapter_params(model, "actor")
    model.set_adapter("actor")
    ref_lp, ref_ent = _full_logprobs(model, ids, attn, temperature=0.7)
    ref_loss = ((ref_lp * 1.3 + ref_ent * 0.5) * mask).sum()
    ref_g = torch.autograd.grad(ref_loss, ps)
    lp, ent = ppo.actor_logprobs(model, ids, attn, temperature=0.7, with_entropy=True, mask=mask, entropy_grad=True)
    loss = ((lp * 1.3 + ent * 0.5) * mask).sum()
    grads = torch.autograd.grad(loss, ps)
    torch.testing.assert_close(lp, ref_lp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent * mask, rtol=1e-5, atol=1e-5)
    assert (lp[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()
    for a, b in zip(grads, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(a.abs().sum() > 0 for a in grads)
    # an entropy that is only a statistic carries no graph (so a backward keeps none of its logits alive)
    lp2, ent2 = ppo.actor_logprobs(model, ids, attn, temperature=0.7, with_entropy=True, mask=mask)
    assert lp2.requires_grad and not ent2.requires_grad
    torch.testing.assert_close(ent2, ent.detach())
    # no mask: every position, as the full computation
    with torch.no_grad():
        lp_all, _ = ppo.actor_logprobs(model, ids, attn, temperature=0.7)
    torch.testing.assert_close(lp_all, ref_lp.detach(), rtol=1e-5, atol=1e-5)


def test_token_logprobs_never_builds_more_than_a_chunk_of_logits(small_lm):
    """The vocabulary projection sees at most `chunk` positions at a time, forward and backward."""
    head = small_lm.get_base_model().get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    h = torch.randn(50, 32, requires_grad=True)
    tgt = torch.randint(0, 300, (50,))
    try:
        lp, ent = ppo.token_logprobs(head, h, tgt, with_entropy=True, entropy_grad=True, chunk=8)
        (lp.sum() + ent.sum()).backward()
    finally:
        hook.remove()
    assert max(seen) == 8 and sum(seen) == 2 * 50   # each chunk projected twice: forward, then recomputed
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_collate_keeps_a_trajectory_with_no_policy_token():
    """A trajectory whose turns all sampled 0 tokens has an all-zero mask: it is collated, gets no reward
    and adds nothing to the losses (it used to stop the whole batch)."""
    b_ids, b_attn, b_mask, b_rew = ppo.collate([[1, 2, 3], [4, 5, 6, 7]], [[0, 0, 0], [0, 1, 1, 0]], [2.0, 3.0],
                                               0, "cpu")
    assert b_mask[0].sum() == 0 and b_rew[0].sum() == 0 and b_rew[1, 2] == 3.0
    adv, ret = ppo.compute_gae(b_rew, torch.randn(2, 4), b_mask)
    assert adv[0].abs().sum() == 0 and ret[0].abs().sum() == 0
    loss, _ = ppo.ppo_policy_loss(torch.zeros(2, 4), torch.zeros(2, 4), adv, b_mask, num_traj=2)
    assert torch.isfinite(loss)


def test_drop_turns_zeroes_the_kth_policy_run():
    mask = [0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0]
    assert ppo.drop_turns(mask, [True, False, True]) == [0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0]
    assert ppo.drop_turns(mask, [False, True, False]) == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    with pytest.raises(AssertionError):
        ppo.drop_turns(mask, [True, True])


# ---------------------------------------------------------------- RFT filter

def _call(tool, args, valid=True):
    """One tool call as env.Episode records it (an invalid one carries the env's error)."""
    return {"name": tool, "args_text": json.dumps(args), "error": None if valid else "unknown tool"}


def _traj(name, reward, calls, stop="finish", malformed=()):
    """A trajectory of one turn per call (the malformed calls in a last turn of their own)."""
    turns = [{"finish_reason": "stop", "calls": [c], "errors": []} for c in calls]
    if malformed:
        turns.append({"finish_reason": "stop", "calls": [], "errors": list(malformed)})
    return Trajectory(task=name, task_source="", messages=[], tools=None, turns=turns, final_reward=reward,
                      stop_reason=stop)


def test_rft_filter_exact_keep_set():
    W = lambda s: _call("write", {"path": "kernels/k.cu", "content": s})
    C = _call("bash", {"cmd": "python compile.py"})
    V = _call("bash", {"cmd": "python verify.py"})
    trajs = [
        _traj("good", 3.0, [W("a"), C, V, W("b"), C, V]),              # the same compile after edits: fine
        _traj("neg", -1.0, [W("a"), C]),                              # reward <= 0
        _traj("zero", 0.0, [W("a")]),                                 # reward <= 0
        _traj("invalid", 2.0, [W("a"), _call("???", None, valid=False), C]),
        _traj("redundant", 1.0, [W("a"), C, C, V]),                   # the same call twice in a row
        _traj("loop", 1.0, [W("a"), C, W("a"), C, W("a"), C, V]),     # a block of 2, x3
        _traj("two_repeats_ok", 1.0, [W("a"), C, W("a"), C, V]),      # a block of 2, only x2
        _traj("no_calls", 1.0, []),
        _traj("truncated", 2.0, [W("z"), V], stop="max_turns"),
        _traj("malformed", 2.0, [W("a"), V], malformed=["<tool_call>{oops"]),  # one call the env could not parse
    ]
    kept = [t.task for t in ppo.rft_filter(trajs)]
    assert kept == ["good", "two_repeats_ok", "no_calls", "truncated"]
    kept = [t.task for t in ppo.rft_filter(trajs, drop_truncated=True, loop_repeats=2, max_identical_calls=1)]
    assert kept == ["no_calls"]
    kept = [t.task for t in ppo.rft_filter(trajs, max_invalid_calls=1, max_consecutive_identical=2, min_reward=1.5)]
    assert kept == ["good", "invalid", "truncated", "malformed"]
    cut = dataclasses.replace(trajs[0], turns=[{**trajs[0].turns[0], "finish_reason": "length"}] + trajs[0].turns[1:])
    assert ppo.truncated(cut) and not ppo.truncated(trajs[0]) and ppo.truncated(trajs[8])
    assert ppo.rft_filter([cut], drop_truncated=True) == []


def _grad_reduce_worker(rank: int, port: int, out: str, backend: str):
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    a, b, c = (torch.nn.Parameter(torch.zeros(2, 3, device=dev)) for _ in range(3))
    a.grad = torch.full((2, 3), float(rank + 1), device=dev)   # both ranks: summed
    if rank == 0:
        b.grad = torch.arange(6.0, device=dev).view(2, 3)       # rank 0 only (an expert rank 1 never routed to)
    ppo.all_reduce_grads([b, c, a])                            # c: no rank has a gradient
    torch.save({k: None if g is None else g.cpu() for k, g in (("a", a.grad), ("b", b.grad), ("c", c.grad))},
               f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_all_reduce_grads_with_a_gradient_on_one_rank_only(tmp_path, backend):
    """Two processes (gloo on CPUs; NCCL on 2 GPUs, as under `accelerate launch`): a parameter with a gradient
    on rank 0 and none on rank 1 gets rank 0's gradient on both; one with none anywhere stays None.
    Per-parameter all-reduces skipping None would pair b with a."""
    import os
    import torch.multiprocessing as mp
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (scripts/device_run.sh on the 2-GPU machine)")
    out = str(tmp_path / "g")
    mp.spawn(_grad_reduce_worker, args=(29400 + os.getpid() % 500, out, backend), nprocs=2, join=True)
    for r in (0, 1):
        g = torch.load(f"{out}.{r}")
        assert torch.equal(g["a"], torch.full((2, 3), 3.0))
        assert torch.equal(g["b"], torch.arange(6.0).view(2, 3))
        assert g["c"] is None


# ---------------------------------------------------------------- updates on a real (tiny) actor-critic

def _tiny_actor_critic():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=2, num_experts_per_tok=1, max_position_embeddings=64, tie_word_embeddings=False)
    base = Qwen3MoeForCausalLM(cfg)
    for p in base.parameters():
        p.requires_grad_(False)
    model, _ = ppo.add_actor_critic_adapters(base, rank=2, alpha=4, targets="attention")
    return model, torch.nn.Linear(16, 1)


def test_updates_skip_a_micro_batch_with_no_policy_token():
    """A trajectory whose turns sampled no token (collate keeps it, all-zero mask) alone in a micro-batch (size 1,
    the paper preset's) has nothing to differentiate: ppo_update and sft_update train on the other rows."""
    import train_config
    cfg = dataclasses.replace(train_config.TrainConfig().ppo, epochs=1, num_minibatches=1, micro_batch_size=1,
                              kl_coef=0.0, entropy_coef=0.0)
    b_ids, b_attn, b_mask, b_rewards = ppo.collate([[3, 4, 5, 6, 7], [3, 4, 5]], [[0, 0, 1, 1, 1], [0, 0, 0]],
                                                   [1.0, -1.0], 0, "cpu")
    assert b_mask[1].sum() == 0
    model, head = _tiny_actor_critic()
    before = [p.detach().clone() for p in ppo.adapter_params(model, "actor")]
    b_values, b_logp, _ = ppo.score(model, head, b_ids, b_attn, 1, 1.0, b_mask=b_mask)
    b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask)
    st = ppo.ppo_update(model, head, ppo.make_optimizers(model, head, cfg), cfg, 1.0, b_ids, b_attn, b_mask, b_logp,
                        b_values, b_adv, b_returns)
    assert math.isfinite(st["pg_loss"]) and math.isfinite(st["v_loss"]) and st["grad_norm_actor"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, ppo.adapter_params(model, "actor")))
    st = ppo.sft_update(model, ppo.make_optimizers(model, head, cfg)["actor"], cfg, 1.0, b_ids, b_attn, b_mask)
    assert st["sft_nll"] > 0 and st["grad_norm_actor"] > 0
    # a batch of such trajectories only: no gradient at all, and no error
    st = ppo.sft_update(model, ppo.make_optimizers(model, head, cfg)["actor"], cfg, 1.0, b_ids[1:], b_attn[1:],
                        b_mask[1:])
    assert st["sft_nll"] == 0.0 and st["grad_norm_actor"] == 0.0
