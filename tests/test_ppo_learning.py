"""Does ppo.py actually learn? A toy task with an instant verifiable reward, no sandbox.

A tiny random Qwen3-MoE (the real architecture, LoRA actor + critic through ppo.add_actor_critic_adapters)
reads a random 3-token prompt and samples 4 tokens; the reward, on the last token, is the share of those 4
tokens equal to TARGET (chance = 1/VOCAB). PPO with the critic (ppo.score + ppo.compute_gae + ppo.ppo_update, the phases
of train.ppo_iteration) must lift the mean reward from chance to near 1 within a fixed budget. The same loop with
the policy gradient's sign flipped, or with the policy mask pointing at the prompt instead of the sampled
tokens, must NOT learn: this proves the test can fail.

Also: value pretraining (critic only, actor frozen) raises explained variance above 0.3 on held-out
trajectories.

Run: python -m pytest -q tests/test_ppo_learning.py -x
"""

import pytest
import torch

import ppo
import train_config

VOCAB, PROMPT, RESP, TARGET = 16, 3, 4, 7


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on the shared 2-core CI box, 2 OpenMP threads next to other jobs run ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_actor_critic(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                         tie_word_embeddings=False, initializer_range=0.3)
    # initializer_range 0.3, not 0.02: the final RMSNorm fixes |h| ~ sqrt(hidden), so with 0.02-scale lm_head
    # rows no hidden state can give any token a logit margin above ~0.6 and no method could learn the task.
    base = Qwen3MoeForCausalLM(cfg)
    for p in base.parameters():
        p.requires_grad_(False)
    model, info = ppo.add_actor_critic_adapters(base, rank=8, alpha=16, targets="attention,experts")
    assert info["modules"] > 0 and info["params"] == 2
    head = torch.nn.Linear(32, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return model, head


TEMPERATURE = 1.0


def toy_cfg(**kw):
    base = dict(gamma=1.0, lam=0.95, eps_low=0.2, eps_high=0.28, kl_coef=0.0, entropy_coef=0.0,
                vf_clip=None, whiten_advantages=True, max_grad_norm=1.0, epochs=2, num_minibatches=2,
                micro_batch_size=16, lr_actor=1e-2, lr_critic=1e-2, lr_head=3e-2)
    base.update(kw)
    return ppo.PPOConfig(**base)


def score(model, head, samples, cfg, device="cpu", need_logp=True):
    """Phases 2-4 of train.ppo_iteration on toy samples: named (B, T) tensors and the critic's stats."""
    b_ids, b_attn, b_mask, b_rewards = ppo.collate([s["input_ids"] for s in samples], [s["mask"] for s in samples],
                                                   [s["reward"] for s in samples], 0, device)
    b_values, b_logp, b_ref = ppo.score(model, head, b_ids, b_attn, cfg.micro_batch_size, TEMPERATURE,
                                        need_logp=need_logp, need_ref=need_logp and cfg.kl_coef > 0)
    b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask, cfg.gamma, cfg.lam)
    stats = ppo.score_stats(b_values, b_returns, b_adv, b_mask)
    if cfg.whiten_advantages:
        b_adv = ppo.whiten_advantages(b_adv, b_mask)
    return (b_ids, b_attn, b_mask, b_logp, b_values, b_adv, b_returns, b_ref), stats


def update(model, head, opt, batch, cfg, n_global, **kw):
    """Phase 5 of train.ppo_iteration."""
    return ppo.ppo_update(model, head, opt, cfg, TEMPERATURE, *batch, n_global=n_global, **kw)


@torch.no_grad()
def rollout(model, n, gen, device="cpu"):
    model.set_adapter("actor")
    ids = torch.randint(1, VOCAB, (n, PROMPT), generator=gen)
    for _ in range(RESP):
        logits = model(input_ids=ids.to(device)).logits[:, -1].float().cpu()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt], 1)
    return ids  # (n, PROMPT + RESP), on the CPU


def run_toy_ppo(iters=40, batch=32, broken=None, seed=0, device="cpu"):
    model, head = tiny_actor_critic(seed)
    model.to(device)
    head.to(device)
    cfg = toy_cfg()
    opt = ppo.make_optimizers(model, head, cfg)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(iters):
        ids = rollout(model, batch, gen, device)
        resp = ids[:, PROMPT:]
        reward = (resp == TARGET).float().mean(1)  # instant verifiable reward in [0, 1]
        curve.append(reward.mean().item())
        mask = [0] * PROMPT + [1] * RESP
        if broken == "mask":  # the classic bug: train on tokens the policy did not choose
            mask = [1] * PROMPT + [0] * RESP
        samples = [{"input_ids": ids[i].tolist(), "mask": mask, "reward": reward[i].item()} for i in range(batch)]
        b, _ = score(model, head, samples, cfg, device)
        update(model, head, opt, b, cfg, n_global=batch)
    return curve


@pytest.mark.slow
def test_ppo_learns_toy_task():
    curve = run_toy_ppo()
    start, end = sum(curve[:3]) / 3, sum(curve[-5:]) / 5
    print(f"toy PPO reward: start {start:.3f} -> end {end:.3f}")
    assert start < 0.3, f"the toy task should start far from the max, got {start:.3f}"
    assert end > 0.8, f"PPO did not learn the toy task: reward {start:.3f} -> {end:.3f}"


@pytest.mark.gpu
def test_ppo_learns_toy_task_on_gpu():
    """The same learning test on CUDA (the GPU code path: devices of stored tensors, optimizer on GPU)."""
    curve = run_toy_ppo(device="cuda")
    end = sum(curve[-5:]) / 5
    print(f"toy PPO on GPU: end reward {end:.3f}")
    assert end > 0.8, f"PPO on GPU did not learn the toy task: {end:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["sign", "mask"])
def test_broken_ppo_does_not_learn(broken, monkeypatch):
    if broken == "sign":  # gradient ascent on the loss instead of descent
        real = ppo.ppo_policy_loss

        def flipped(*a, **k):
            loss, st = real(*a, **k)
            return -loss, st
        monkeypatch.setattr(ppo, "ppo_policy_loss", flipped)
    curve = run_toy_ppo(broken=broken)
    end = sum(curve[-5:]) / 5
    print(f"broken={broken}: end reward {end:.3f}")
    assert end < 0.4, f"a deliberately broken PPO ({broken}) still 'learned' ({end:.3f}): the test cannot fail"


def test_value_pretraining_raises_explained_variance():
    """Critic-only steps on fixed trajectories whose return is predictable from the prompt (reward +1 if
    TARGET appears in the prompt, else -1); explained variance measured on held-out trajectories."""
    model, head = tiny_actor_critic(1)
    cfg = toy_cfg(epochs=1, num_minibatches=1)
    opt = ppo.make_optimizers(model, head, cfg)
    gen = torch.Generator().manual_seed(1)

    def make(n):
        ids = torch.randint(1, VOCAB, (n, PROMPT + RESP), generator=gen)
        ids[: n // 2, torch.randint(0, PROMPT, (1,), generator=gen)] = TARGET
        ids[n // 2:, :PROMPT][ids[n // 2:, :PROMPT] == TARGET] = TARGET + 1
        r = [(1.0 if TARGET in row[:PROMPT].tolist() else -1.0) for row in ids]
        return [{"input_ids": ids[i].tolist(), "mask": [0] * PROMPT + [1] * RESP, "reward": r[i]} for i in range(n)]

    train_set, held = make(64), make(32)
    before = score(model, head, held, cfg, need_logp=False)[1]["explained_variance"]
    actor_before = [p.clone() for p in ppo.adapter_params(model, "actor")]
    for _ in range(30):
        b, _ = score(model, head, train_set, cfg, need_logp=False)
        update(model, head, opt, b, cfg, n_global=len(train_set), train_actor=False)
    after = score(model, head, held, cfg, need_logp=False)[1]["explained_variance"]
    print(f"value pretraining: held-out explained variance {before:.3f} -> {after:.3f}")
    assert after > 0.3, f"explained variance after value pretraining {after:.3f} <= 0.3 (before {before:.3f})"
    assert all(torch.equal(a, b) for a, b in zip(actor_before, ppo.adapter_params(model, "actor"))), \
        "value pretraining must leave the actor frozen"


def test_one_base_two_adapters_and_reference():
    """Actor and critic are disjoint LoRA sets on one base; the reference policy (adapters disabled) is the
    untouched base; an actor step moves neither the critic nor the reference; the KL term is computed."""
    model, head = tiny_actor_critic(2)
    torch.nn.init.normal_(head.weight)  # non-zero values, so "the critic did not move" means something
    base_ids = {id(p) for n, p in model.named_parameters() if "lora_" not in n}
    assert len(base_ids) == len([n for n, _ in model.named_parameters() if "lora_" not in n])  # one copy
    actor, critic = ppo.adapter_params(model, "actor"), ppo.adapter_params(model, "critic")
    assert not {id(p) for p in actor} & {id(p) for p in critic}
    cfg = toy_cfg(kl_coef=0.1, epochs=1, num_minibatches=1)
    opt = ppo.make_optimizers(model, head, cfg)
    gen = torch.Generator().manual_seed(2)
    ids = rollout(model, 8, gen)
    attn = torch.ones_like(ids)
    samples = [{"input_ids": ids[i].tolist(), "mask": [0] * PROMPT + [1] * RESP, "reward": float(i % 2)}
               for i in range(8)]
    with torch.no_grad():
        ref0 = ppo.actor_logprobs(model, ids, attn, adapter=None)[0]
        v0 = ppo.critic_values(model, head, ids, attn)
    b, _ = score(model, head, samples, cfg)
    st = update(model, head, opt, b, cfg, n_global=8, train_critic=False)
    assert st["kl_ref"] >= 0.0 and "v_loss" not in st
    with torch.no_grad():
        ref1 = ppo.actor_logprobs(model, ids, attn, adapter=None)[0]
        v1 = ppo.critic_values(model, head, ids, attn)
        act1 = ppo.actor_logprobs(model, ids, attn)[0]
    torch.testing.assert_close(ref0, ref1)   # the reference is the frozen base
    torch.testing.assert_close(v0, v1)       # an actor step leaves the critic alone
    assert not torch.allclose(act1, ref1)    # ... and did move the actor


def test_kl_reference_is_the_actor_at_the_snapshot():
    """snapshot_reference freezes a copy of the actor as "ref": score's reference log-probs then equal the
    actor's at that moment, stay put while the actor moves, and differ from the adapter-free base (what
    stage 4 needs: a KL toward the RFT actor, not the model stage 1 started from). The snapshot survives a
    checkpoint round trip."""
    import runlog
    model, head = tiny_actor_critic(3)
    for p in ppo.adapter_params(model, "actor"):  # an actor that has moved away from the base (like after RFT)
        torch.nn.init.normal_(p, std=0.3)
    gen = torch.Generator().manual_seed(3)
    ids = rollout(model, 8, gen)
    attn = torch.ones_like(ids)
    samples = [{"input_ids": ids[i].tolist(), "mask": [0] * PROMPT + [1] * RESP, "reward": float(i % 2)}
               for i in range(8)]
    ppo.snapshot_reference(model)
    cfg = toy_cfg(kl_coef=0.1, epochs=1, num_minibatches=1)
    opt = ppo.make_optimizers(model, head, cfg)
    b, _ = score(model, head, samples, cfg)
    b_ref, b_logp = b[7], b[3]
    torch.testing.assert_close(b_ref, b_logp)              # the reference is the actor as it was
    with torch.no_grad():
        base = ppo.actor_logprobs(model, ids, attn, adapter=None)[0]
    assert not torch.allclose(b_ref, base, atol=1e-3)      # ... not the base
    st = update(model, head, opt, b, cfg, n_global=8)
    assert st["kl_ref"] == pytest.approx(0.0, abs=1e-6)    # first step: pi = pi_ref
    b2, _ = score(model, head, samples, cfg)
    torch.testing.assert_close(b2[7], b_ref)              # the actor moved, the reference did not
    assert not torch.allclose(b2[3], b_ref)
    assert all(not p.requires_grad for p in ppo.adapter_params(model, ppo.REF))
    # the snapshot is part of the checkpoint: a fresh model resumed from it has the same reference
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        runlog.save_checkpoint(d, model, head, opt, 4, 1, train_config.TrainConfig())
        model2, head2 = tiny_actor_critic(3)
        runlog.load_checkpoint(d, model2, head2)
        with torch.no_grad():
            ref2 = ppo.actor_logprobs(model2, ids, attn, adapter=ppo.REF)[0]
    torch.testing.assert_close(ref2, b_ref)


def _unequal_shard_worker(rank: int, port: int, out: str):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    rows = [0, 1, 2] if rank == 0 else [3, 4]   # 5 trajectories on 2 ranks: 3 + 2
    torch.save(_one_update(rows, n_global=5), f"{out}.{rank}")
    dist.destroy_process_group()


def _one_update(rows, n_global):
    """One PPO update (actor + critic) on the given rows of a fixed 5-trajectory batch; the new parameters."""
    model, head = tiny_actor_critic(4)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (5, PROMPT + RESP), generator=gen)
    samples = [{"input_ids": ids[i].tolist(), "mask": [0] * PROMPT + [1] * RESP, "reward": float(i) - 2.0}
               for i in rows]
    cfg = toy_cfg(epochs=1, num_minibatches=1)
    opt = ppo.make_optimizers(model, head, cfg)
    b, _ = score(model, head, samples, cfg)
    update(model, head, opt, b, cfg, n_global=n_global)
    return [p.detach().clone() for p in ppo.adapter_params(model, "actor") + ppo.adapter_params(model, "critic")]


@pytest.mark.slow
def test_update_with_unequal_shards_equals_one_process(tmp_path):
    """Ranks may hold different numbers of trajectories (1024 on 6 GPUs: 171 x 4 + 170 x 2): the update counts
    trajectories over all ranks, so 3 + 2 on two processes gives the parameters of 5 on one."""
    import os
    import torch.multiprocessing as mp
    out = str(tmp_path / "p")
    mp.spawn(_unequal_shard_worker, args=(29900 + os.getpid() % 97, out), nprocs=2, join=True)
    ref = _one_update([0, 1, 2, 3, 4], n_global=5)
    for r in (0, 1):
        got = torch.load(f"{out}.{r}")
        for a, b in zip(got, ref):  # Adam's first step moves an element by ~lr (1e-2) when its gradient is well
            # above eps, by less and less exactly when it is not: the reduction order of 2 ranks shifts those
            # few elements by a fraction of lr; a wrong trajectory count would shift every element by O(lr)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(ref, _params_before()))


def _params_before():
    model, _ = tiny_actor_critic(4)
    return [p.detach().clone() for p in ppo.adapter_params(model, "actor") + ppo.adapter_params(model, "critic")]
