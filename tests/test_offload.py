"""--ppo.offload-activations (ppo.offload_activations): the same losses, gradients and updates as without it, with and
without gradient checkpointing, on a tiny fp32 Qwen3-MoE; and scripts/bench_ppo.py on the CPU, every length and
mode in one run, a length that runs out of memory recorded as such while the others go on.

Run: python -m pytest -q tests/test_offload.py -x
"""
import dataclasses
import importlib.util
import json
import os

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import ppo
import train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _actor_critic(grad_ckpt: bool):
    """A tiny fp32 Qwen3-MoE (2 layers, 4 experts) with LoRA on attention and experts, a trained-looking actor."""
    torch.manual_seed(0)
    conf = Qwen3MoeConfig(vocab_size=120, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                          tie_word_embeddings=False)
    base = Qwen3MoeForCausalLM(conf)
    for p in base.parameters():
        p.requires_grad_(False)
    if grad_ckpt:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, _ = ppo.add_actor_critic_adapters(base, rank=4, alpha=8, targets="attention,experts")
    for p in ppo.adapter_params(model, "actor") + ppo.adapter_params(model, "critic"):
        torch.nn.init.normal_(p, std=0.1)
    return model, torch.nn.Linear(32, 1)


def _batch():
    g = torch.Generator().manual_seed(3)
    b_ids = torch.randint(1, 120, (3, 24), generator=g)
    b_attn = torch.ones_like(b_ids)
    b_attn[2, 17:] = 0
    b_mask = (torch.rand(3, 24, generator=g) > 0.3).float() * b_attn
    b_mask[:, :4] = 0
    b_rewards = torch.zeros(3, 24)
    for i, r in enumerate((1.0, -1.0, 3.0)):
        b_rewards[i, int(b_mask[i].nonzero()[-1])] = r
    return b_ids, b_attn, b_mask, b_rewards


@pytest.mark.slow
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_offload_gives_the_same_loss_and_gradients(grad_ckpt, monkeypatch):
    """One actor loss and one critic loss, backward with and without the context: equal, bit for bit; the context
    did copy tensors (every size moves here), fewer with checkpointing (a layer saves only its input)."""
    monkeypatch.setattr(ppo, "OFFLOAD_MIN_BYTES", 0)
    model, head = _actor_critic(grad_ckpt)
    model.train()
    b_ids, b_attn, b_mask, _ = _batch()
    actor, critic = ppo.adapter_params(model, "actor"), ppo.adapter_params(model, "critic") + list(head.parameters())
    out = {}
    for on in (False, True):
        stats = {}
        with ppo.offload_activations(on, stats):
            logp, ent = ppo.actor_logprobs(model, b_ids, b_attn, 0.9, with_entropy=True, mask=b_mask,
                                           entropy_grad=True)                                   # (B, T)
        loss_a = ((logp * 1.3 + ent * 0.1) * b_mask).sum()
        g_a = torch.autograd.grad(loss_a, actor)
        with ppo.offload_activations(on, stats):
            v = ppo.critic_values(model, head, b_ids, b_attn)                                   # (B, T)
        loss_c = ((v - 1.0) ** 2 * b_mask).sum()
        g_c = torch.autograd.grad(loss_c, critic)
        out[on] = (loss_a.detach(), loss_c.detach(), g_a, g_c, stats.get("offload_bytes", 0))
    (la0, lc0, ga0, gc0, n0), (la1, lc1, ga1, gc1, n1) = out[False], out[True]
    assert n0 == 0 and n1 > 0, "the context moved nothing"
    assert torch.equal(la0, la1) and torch.equal(lc0, lc1)
    assert all(torch.equal(a, b) for a, b in zip(ga0 + gc0, ga1 + gc1))
    assert any(a.abs().sum() > 0 for a in ga1) and any(a.abs().sum() > 0 for a in gc1)


def test_checkpointed_layers_move_only_their_inputs(monkeypatch):
    """With non-reentrant checkpointing the context packs each decoder layer's input (B, T, H), not what the layer
    computes inside: far fewer bytes than without checkpointing."""
    monkeypatch.setattr(ppo, "OFFLOAD_MIN_BYTES", 0)
    b_ids, b_attn, b_mask, _ = _batch()
    moved = {}
    for ckpt in (False, True):
        model, head = _actor_critic(ckpt)
        model.train()
        stats = {}
        with ppo.offload_activations(True, stats):
            logp, _ = ppo.actor_logprobs(model, b_ids, b_attn, 1.0, mask=b_mask)
        (logp * b_mask).sum().backward()
        moved[ckpt] = stats["offload_bytes"]
    layer_input = b_ids.numel() * 32 * 4  # (B, T, H) fp32
    assert moved[True] >= 2 * layer_input, "each of the 2 checkpointed layers' inputs goes to the host"
    assert moved[True] < moved[False] / 3, moved


@pytest.mark.slow
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_ppo_and_sft_updates_equal_with_offload(grad_ckpt, monkeypatch):
    """ppo_update (actor + critic, 2 minibatches, micro-batches of 2) and sft_update give the same weights and the
    same statistics with --ppo.offload-activations as without; the update reports what it moved."""
    monkeypatch.setattr(ppo, "OFFLOAD_MIN_BYTES", 0)
    b_ids, b_attn, b_mask, b_rewards = _batch()
    after, stats = {}, {}
    for on in (False, True):
        cfg = dataclasses.replace(train_config.TrainConfig().ppo, epochs=2, num_minibatches=2, micro_batch_size=2,
                                  kl_coef=0.0, entropy_coef=0.01, lr_actor=1e-2, offload_activations=on)
        temperature = train_config.TrainConfig().sampler.temperature
        model, head = _actor_critic(grad_ckpt)
        b_values, b_logp, _ = ppo.score(model, head, b_ids, b_attn, 2, temperature, b_mask=b_mask)
        b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask)
        torch.manual_seed(7)  # the minibatch order
        opt = ppo.make_optimizers(model, head, cfg)
        stats[on] = ppo.ppo_update(model, head, opt, cfg, temperature, b_ids, b_attn, b_mask, b_logp, b_values,
                                   ppo.whiten_advantages(b_adv, b_mask), b_returns)
        stats[on] |= ppo.sft_update(model, opt["actor"], cfg, temperature, b_ids, b_attn, b_mask)
        trained = ppo.adapter_params(model, "actor") + ppo.adapter_params(model, "critic") + list(head.parameters())
        after[on] = [p.detach().clone() for p in trained]
    assert all(torch.equal(a, b) for a, b in zip(after[False], after[True]))
    assert "offload_GiB" not in stats[False] and stats[True].pop("offload_GiB") > 0
    assert stats[False] == stats[True]


def test_offload_is_off_by_default():
    assert train_config.TrainConfig().ppo.offload_activations is False
    assert train_config.PRESETS["paper"].ppo.offload_activations is False


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_ppo", os.path.join(ROOT, "scripts", "bench_ppo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bench_runs_every_length_and_mode_on_cpu_and_records_an_oom(tmp_path, monkeypatch):
    """scripts/bench_ppo.py --device cpu: scoring and one update at three lengths, offload off and on, into one
    JSON; an out-of-memory error in one length's update (injected) is recorded there with the memory breakdown,
    and the other rows still run."""
    monkeypatch.setattr(ppo, "OFFLOAD_MIN_BYTES", ppo.OFFLOAD_MIN_BYTES)  # the dry run sets it to 0: restore it
    bench = _load_bench()
    real = ppo.ppo_update

    def ppo_update(model, head, opt, cfg, temperature, b_ids, *a, **kw):
        if b_ids.shape[1] == 96 and not cfg.offload_activations:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(model, head, opt, cfg, temperature, b_ids, *a, **kw)

    monkeypatch.setattr(ppo, "ppo_update", ppo_update)
    out = tmp_path / "bench_ppo.json"
    rc = bench.main(["--device", "cpu", "--layers", "1", "--seqs", "32", "64", "96", "--batch", "2", "1", "1",
                     "--micro", "1", "1", "1", "--offload", "on", "off", "--warmup-seq", "16", "--gae-tokens", "2048",
                     "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [(r["seq"], r["offload"]) for r in res["rows"]] == [(s, o) for s in (32, 64, 96) for o in (True, False)]
    for r in res["rows"]:
        assert r["score_tok_s"] > 0 and r["score_mem"]["adapters_GiB"] >= 0
        if r["seq"] == 96 and not r["offload"]:
            assert "update_tok_s" not in r and "out of memory" in r["update_oom"]
            assert {"weights_GiB", "adapters_GiB", "grads_GiB", "optimizer_GiB"} <= set(r["update_mem"])
        else:
            assert r["update_tok_s"] > 0 and "update_oom" not in r
            assert (r.get("update_offload_GiB", 0) > 0) == r["offload"]
    assert "warmup" in res and res["gae"]["tokens"] == 2048
