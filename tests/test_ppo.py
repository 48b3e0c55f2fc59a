"""The pure PPO math of ppo.py against hand-computed and naive references.

Run: python -m pytest -q tests/test_ppo.py -x
"""
import math

import pytest
import torch

import ppo


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
    w = ppo.masked_whiten(x, m)
    assert abs(ppo.masked_mean(w, m).item()) < 1e-6 and w[0, 2] == 0 and w[1, 2] == 0
    assert math.isclose(ppo.masked_var(w, m).item(), 1.0, rel_tol=1e-4)
    ret = torch.tensor([[1.0, 2.0, 3.0]])
    ones = torch.ones(1, 3)
    assert ppo.explained_variance(ret, ret, ones) == 1.0
    assert math.isclose(ppo.explained_variance(torch.full((1, 3), 2.0), ret, ones), 0.0, abs_tol=1e-6)
    assert ppo.explained_variance(-ret, ret, ones) < 0


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ppo.entropy_from_logits(logits), torch.tensor([math.log(4), 0.0]))


def test_kl_penalty_zero_at_reference():
    logp, old, _, mask = _batch()
    assert ppo.kl_penalty(old, old, mask).item() == 0.0
    assert ppo.kl_penalty(logp, old, mask).item() > 0.0


# ---------------------------------------------------------------- RFT filter

def _call(tool, args, valid=True):
    return {"tool": tool, "args": args, "valid": valid}


def test_rft_filter_exact_keep_set():
    W = lambda s: _call("write", {"path": "kernels/k.cu", "content": s})
    C = _call("bash", {"cmd": "python compile.py"})
    V = _call("bash", {"cmd": "python verify.py"})
    trajs = [
        {"id": "good", "reward": 3.0, "tool_calls": [W("a"), C, V, W("b"), C, V]},  # same compile after edits: fine
        {"id": "neg", "reward": -1.0, "tool_calls": [W("a"), C]},                          # reward <= 0
        {"id": "zero", "reward": 0.0, "tool_calls": [W("a")]},                             # reward <= 0
        {"id": "invalid", "reward": 2.0, "tool_calls": [W("a"), _call("???", None, valid=False), C]},
        {"id": "redundant", "reward": 1.0, "tool_calls": [W("a"), C, C, V]},               # same call twice in a row
        {"id": "loop", "reward": 1.0, "tool_calls": [W("a"), C, W("a"), C, W("a"), C, V]},  # block of 2, x3
        {"id": "two_repeats_ok", "reward": 1.0, "tool_calls": [W("a"), C, W("a"), C, V]},  # block of 2, only x2
        {"id": "no_calls", "reward": 1.0, "tool_calls": []},
        {"id": "truncated", "reward": 2.0, "tool_calls": [W("z"), V], "truncated": True},
    ]
    kept = [t["id"] for t in ppo.rft_filter(trajs)]
    assert kept == ["good", "two_repeats_ok", "no_calls", "truncated"]
    kept = [t["id"] for t in ppo.rft_filter(trajs, drop_truncated=True, loop_repeats=2, max_identical_calls=1)]
    assert kept == ["no_calls"]
    kept = [t["id"] for t in ppo.rft_filter(trajs, max_invalid_calls=1, max_consecutive_identical=2, min_reward=1.5)]
    assert kept == ["good", "invalid", "truncated"]


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
