"""Are two source trees' PPO and SFT updates bit-identical? For refactors that must not change the math.

Each tree runs in its own process (its own ppo.py and train_config.py first on sys.path): a tiny random
Qwen3-MoE (2 layers, 4 experts, top-2) with actor and critic LoRA on attention and experts, four trajectories
of 9-24 tokens with prompts, an observation gap and mixed rewards; `ppo.score`, `compute_gae`, one
`ppo_update` (2 epochs x 2 minibatches, micro-batch 1, KL against a shifted reference, entropy bonus) and one
`sft_update`. Then every trainable parameter, the scores and every statistic of both updates are compared
with torch.equal / ==. Trees from before the nested config (flat TrainConfig) run too.

  git archive REV | (mkdir -p /tmp/old && tar -x -C /tmp/old)
  python scripts/compare_updates.py /tmp/old .          # exit 0: identical
"""
import dataclasses
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tree(root: str, out: str) -> None:
    """The child: fixed inputs through the tree's own updates; saves params, scores and stats to `out`."""
    sys.path.insert(0, os.path.abspath(root))
    import ppo
    import train_config
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    mc = Qwen3MoeConfig(vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    base = Qwen3MoeForCausalLM(mc)
    for p in base.parameters():
        p.requires_grad_(False)
    model, _ = ppo.add_actor_critic_adapters(base, rank=2, alpha=4, targets="attention,experts")
    head = torch.nn.Linear(16, 1)

    over = dict(num_minibatches=2, micro_batch_size=1, kl_coef=0.1, entropy_coef=0.01)
    if hasattr(train_config.TrainConfig(), "ppo"):   # nested config: the update takes the sampling temperature
        cfg, extra = dataclasses.replace(train_config.TrainConfig().ppo, epochs=2, **over), (1.0,)
    else:                                            # flat TrainConfig
        cfg, extra = dataclasses.replace(train_config.TrainConfig(), ppo_epochs=2, **over), ()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (20, 14, 24, 9)]
    masks = [[0] * 5 + [1] * (len(s) - 5) for s in seqs]
    masks[1][8:10] = [0, 0]   # an observation between two turns
    b_ids, b_attn, b_mask, b_rewards = ppo.collate(seqs, masks, [1.0, -1.0, 2.0, 0.0], 0, "cpu")
    torch.manual_seed(3)
    b_values, b_logp, _ = ppo.score(model, head, b_ids, b_attn, 1, 1.0, b_mask=b_mask)
    b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask)
    opts = ppo.make_optimizers(model, head, cfg)
    st_ppo = ppo.ppo_update(model, head, opts, cfg, *extra, b_ids, b_attn, b_mask, b_logp, b_values, b_adv,
                            b_returns, b_ref_logp=b_logp - 0.05 * b_mask)
    st_sft = ppo.sft_update(model, opts["actor"], cfg, *extra, b_ids, b_attn, b_mask)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    params.update({"head." + n: p.detach().clone() for n, p in head.named_parameters()})
    torch.save({"params": params, "scores": (b_values, b_logp), "ppo": st_ppo, "sft": st_sft}, out)


def compare(a: dict, b: dict) -> list[str]:
    """The differences between two children's results (empty: bit-identical)."""
    diffs = [f"parameter set differs: {sorted(a['params'].keys() ^ b['params'].keys())}"] \
        if a["params"].keys() != b["params"].keys() else []
    diffs += [f"parameter {k}: max |diff| {(a['params'][k] - b['params'][k]).abs().max().item():.3g}"
              for k in sorted(a["params"].keys() & b["params"].keys()) if not torch.equal(a["params"][k], b["params"][k])]
    diffs += [f"scores[{i}] differ" for i in range(2) if not torch.equal(a["scores"][i], b["scores"][i])]
    for name in ("ppo", "sft"):
        diffs += [f"{name} stat {k}: {a[name].get(k)} vs {b[name].get(k)}"
                  for k in sorted(a[name].keys() | b[name].keys()) if a[name].get(k) != b[name].get(k)]
    return diffs


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        run_tree(sys.argv[2], sys.argv[3])
        return 0
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1")   # one thread: reductions in one order in both children
    with tempfile.TemporaryDirectory() as d:
        res = []
        for i, tree in enumerate(sys.argv[1:]):
            out = os.path.join(d, f"{i}.pt")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, out], check=True, env=env,
                           cwd=tree)
            res.append(torch.load(out, weights_only=False))
    diffs = compare(*res)
    n = len(res[0]["params"])
    print("\n".join(diffs) if diffs else f"bit-identical: {n} trainable tensors, scores, ppo and sft statistics")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
