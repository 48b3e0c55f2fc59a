"""The sampler-trainer gap (ppo.sampler_gap) and its optional correction, truncated importance sampling
(ppo.tis_weights, --ppo.tis-cap), against hand-computed cases; and that ppo_update applies the weights.

Run: python -m pytest -q tests/test_rollout_correction.py
"""
import dataclasses
import math

import torch

import ppo
import train_config

L = math.log


def test_tis_weights_and_policy_loss_hand_case():
    # row 0: three policy tokens drawn by the sampler, one pad; row 1: a demonstration (no sampler log-probs)
    old = torch.tensor([[L(0.5), L(0.3), L(0.2), 0.0], [L(0.4), L(0.4), 0.0, 0.0]])
    sampler = torch.tensor([[L(0.25), L(0.6), L(0.2), 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0.]])
    s_mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0.]])
    w = ppo.tis_weights(old, sampler, s_mask, cap=1.5)
    # 0.5/0.25 = 2 -> capped at 1.5; 0.3/0.6 = 0.5; 0.2/0.2 = 1; 1 wherever the sampler has no log-prob
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))

    # ratios pi/pi_old: row 0 [1.5 (A=+1, clipped at 1.28), 0.5 (A=-2, clipped at 0.8), 1.1 (A=0.5)], row 1: 1
    ratio = torch.tensor([[1.5, 0.5, 1.1, 1.0], [1.0, 1.0, 1.0, 1.0]])
    logp = (old + ratio.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.0], [1.0, 3.0, 0.0, 0.0]])
    loss, _ = ppo.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, is_weight=w)
    row0 = (-1.28 * 1.0 * 1.5 + 0.8 * 2.0 * 0.5 - 1.1 * 0.5 * 1.0) / 3   # max(-A r, -A clip(r)) * w, token mean
    row1 = (-1.0 - 3.0) / 2
    assert math.isclose(loss.item(), (row0 + row1) / 2, rel_tol=1e-6)
    # the weight is a constant: d loss / d logp = -A * r * w / (tokens * rows) on unclipped tokens, 0 on clipped
    (g,) = torch.autograd.grad(loss, logp)
    want = torch.tensor([[0.0, 0.0, -0.5 * 1.1 * 1.0 / 3 / 2, 0.0], [-1.0 / 2 / 2, -3.0 / 2 / 2, 0.0, 0.0]])
    torch.testing.assert_close(g, want)
    # weights of 1 are the paper's loss
    plain, _ = ppo.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28)
    ones, _ = ppo.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28, is_weight=torch.ones_like(w))
    assert plain.item() == ones.item()


def test_sampler_gap_hand_case():
    # deltas log pi_old - log pi_sampler on the sampler's tokens: log 2, log 0.5, 0, 0.1 (ratios 2, 0.5, 1, 1.105)
    d = torch.tensor([[L(2.0), L(0.5), 0.0, 0.0], [0.1, 0.0, 0.0, 0.0]])
    sampler = -torch.rand(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0.]])
    g = ppo.sampler_gap(sampler + d, sampler, mask, 0.2, 0.28, cap=1.5)
    assert math.isclose(g["logp_gap"], (L(2.0) + L(2.0) + 0.0 + 0.1) / 4, rel_tol=1e-5)
    assert g["gap_clip_share"] == 0.5              # 2 and 0.5 lie outside [0.8, 1.28]
    assert g["tis_capped_share"] == 0.25           # only 2 exceeds the cap 1.5
    assert "tis_capped_share" not in ppo.sampler_gap(sampler + d, sampler, mask)
    assert ppo.sampler_gap(sampler, sampler, mask) == {"logp_gap": 0.0, "gap_clip_share": 0.0}
    assert ppo.sampler_gap(sampler + d, sampler, torch.zeros_like(mask)) == {}   # no sampler token at all


def test_collate_sampler_keeps_only_rows_the_sampler_drew():
    b_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0.], [1, 1, 1, 1.]])
    lp, m = ppo.collate_sampler([[0.0, -0.5, -0.25], None, [-1.0, -2.0, -3.0, -4.0]], b_mask)
    torch.testing.assert_close(lp, torch.tensor([[0.0, -0.5, -0.25, 0.0], [0.0] * 4, [-1.0, -2.0, -3.0, -4.0]]))
    torch.testing.assert_close(m, torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0.], [1, 1, 1, 1.]]))


def _actor_critic():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=2, num_experts_per_tok=1, max_position_embeddings=64, tie_word_embeddings=False)
    base = Qwen3MoeForCausalLM(cfg)
    for p in base.parameters():
        p.requires_grad_(False)
    model, _ = ppo.add_actor_critic_adapters(base, rank=2, alpha=4, targets="attention")
    for p in ppo.adapter_params(model, "actor"):
        torch.nn.init.normal_(p, std=0.2)
    return model, torch.nn.Linear(16, 1)


def test_ppo_update_applies_the_weights():
    """b_tis reaches the policy loss: weights of 1 give the unweighted update, weights of 0 no actor update."""
    cfg = dataclasses.replace(train_config.TrainConfig().ppo, epochs=1, num_minibatches=1, micro_batch_size=2,
                              kl_coef=0.0, entropy_coef=0.0, lr_actor=1e-2)
    g = torch.Generator().manual_seed(1)
    b_ids = torch.randint(1, 50, (2, 9), generator=g)
    b_attn = torch.ones_like(b_ids)
    b_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 0, 0.]])
    b_adv = torch.randn(2, 9, generator=g) * b_mask
    after = {}
    for name, tis in (("none", None), ("ones", torch.ones(2, 9)), ("zeros", torch.zeros(2, 9))):
        model, head = _actor_critic()
        before = [p.detach().clone() for p in ppo.adapter_params(model, "actor")]
        b_values, b_logp, _ = ppo.score(model, head, b_ids, b_attn, 2, 1.0, b_mask=b_mask)
        ppo.ppo_update(model, head, ppo.make_optimizers(model, head, cfg), cfg, 1.0, b_ids, b_attn, b_mask, b_logp,
                       b_values, b_adv, b_values + b_adv, train_critic=False, b_tis=tis)
        after[name] = [p.detach().clone() for p in ppo.adapter_params(model, "actor")]
        if name == "zeros":
            assert all(torch.equal(a, b) for a, b in zip(after[name], before)), "weight 0: no policy gradient"
        else:
            assert any(not torch.equal(a, b) for a, b in zip(after[name], before))
    assert all(torch.allclose(a, b) for a, b in zip(after["none"], after["ones"]))
