"""GPU bench for ppo.py: one rollout (generation) and one PPO update on a full-size MoE shape, random weights.

The model is Qwen3-30B-A3B's architecture (48 layers, hidden 2048, 128 experts, top-8, 3.3B active of 30.5B),
built from its config on the GPU in bf16 — nothing is downloaded. LoRA actor + critic + value head come from
ppo.add_actor_critic_adapters (attention + fused experts through peft target_parameters), so this measures
the code `train` runs: HF `generate` with the actor adapter, then the phases of train.ppo_iteration
(ppo.score: old log-probs and values; ppo.compute_gae; ppo.ppo_update: one clipped actor step and one
critic step) with gradient checkpointing.

Reports (one JSON line at the end, also written to $OUT/bench_ppo.json when $OUT is set): parameter count,
layers kept, peak GPU memory, generation tokens/s, update tokens/s.

    python scripts/bench_ppo.py                          # full 48 layers on one H200
    python scripts/bench_ppo.py --layers 12 --seq 2048   # if memory is tight: fewer layers (say so when quoting)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo  # noqa: E402
import train  # noqa: E402

# Qwen/Qwen3-30B-A3B config.json (public), restated so nothing is downloaded.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     mlp_only_layers=[])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48, help="decoder layers kept (48 = full size)")
    ap.add_argument("--batch", type=int, default=4, help="trajectories in the PPO update")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per trajectory in the update")
    ap.add_argument("--gen-batch", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens for generation")
    ap.add_argument("--new", type=int, default=256, help="new tokens per prompt")
    ap.add_argument("--lora-rank", type=int, default=16, help="the paper preset's rank")
    ap.add_argument("--lora-targets", default="attention,experts")
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--cpu-dry-run", action="store_true", help="a scaled-down shape on CPU, to test this script")
    ap.add_argument("--device", default="cuda", choices=["cuda"], help="the full shape needs a GPU")
    ap.add_argument("--out", default=None, help="also write the JSON result here (default: $OUT/bench_ppo.json)")
    a = ap.parse_args()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    shape = {**QWEN3_30B_A3B, "num_hidden_layers": a.layers}
    if a.cpu_dry_run:
        shape.update(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
        torch.cuda.synchronize = lambda: None  # noqa: E731
        torch.cuda.reset_peak_memory_stats = lambda: None  # noqa: E731
        torch.cuda.max_memory_allocated = lambda: 0  # noqa: E731
        torch.cuda.get_device_name = lambda: "cpu (dry run)"  # noqa: E731
    else:
        assert torch.cuda.is_available(), "needs a GPU (or --cpu-dry-run)"
    dev = torch.device("cpu" if a.cpu_dry_run else "cuda")
    conf = Qwen3MoeConfig(**shape)
    t0 = time.time()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # build straight in bf16 (an fp32 build of 30B needs 122 GB)
    with torch.device(dev):
        base = Qwen3MoeForCausalLM(conf)
    torch.set_default_dtype(torch.float32)  # LoRA weights and the value head stay fp32
    for p in base.parameters():
        p.requires_grad_(False)
    n_params = sum(p.numel() for p in base.parameters())
    if not a.no_grad_ckpt:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, info = ppo.add_actor_critic_adapters(base, a.lora_rank, 2.0 * a.lora_rank, a.lora_targets)
    head = torch.nn.Linear(conf.hidden_size, 1, device=dev)
    build_s = time.time() - t0
    print(f"built {n_params / 1e9:.2f}B params ({a.layers} layers) + LoRA {info} in {build_s:.0f}s; "
          f"experts impl {getattr(conf, '_experts_implementation', None)}", flush=True)
    cfg = dataclasses.replace(train.PRESETS["paper"], micro_batch_size=1, ppo_epochs=1, num_minibatches=1)
    opt = ppo.make_optimizers(model, head, cfg)

    # 1) rollout: generation with the actor adapter (KV cache, sampling)
    model.set_adapter("actor")
    model.eval()  # KV cache on (gradient checkpointing only applies in train mode)
    prompt = torch.randint(0, conf.vocab_size, (a.gen_batch, a.prompt), device=dev)
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model.generate(input_ids=prompt[:, :32], max_new_tokens=4, do_sample=True)  # warm-up
        torch.cuda.synchronize()
        t = time.time()
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=a.new,
                             min_new_tokens=a.new, do_sample=True, temperature=1.0, top_k=0)
        torch.cuda.synchronize()
    gen_s = time.time() - t
    gen_tok = (out.shape[1] - a.prompt) * a.gen_batch
    peak_gen = torch.cuda.max_memory_allocated() / 2 ** 30

    # 2-4) score (old log-probs, values, GAE) + one PPO update (actor + critic), bf16 weights, fp32 LoRA
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, conf.vocab_size, (a.seq,), generator=g).tolist() for _ in range(a.batch)]
    masks = [[0] * (a.seq // 4) + [1] * (a.seq - a.seq // 4)] * a.batch  # a prompt, then policy tokens
    b_ids, b_attn, b_mask, b_rewards = ppo.collate(ids, masks, [float(i % 4) - 1.0 for i in range(a.batch)], 0, dev)
    model.train()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t = time.time()
    b_values, b_logp, _ = ppo.score(model, head, b_ids, b_attn, cfg.micro_batch_size, cfg.temperature)
    b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask, cfg.gamma, cfg.lam)
    b_adv = ppo.whiten_advantages(b_adv, b_mask)
    torch.cuda.synchronize()
    score_s = time.time() - t
    t = time.time()
    st = ppo.ppo_update(model, head, opt, cfg, b_ids, b_attn, b_mask, b_logp, b_values, b_adv, b_returns,
                        n_global=a.batch)
    torch.cuda.synchronize()
    upd_s = time.time() - t
    peak_upd = torch.cuda.max_memory_allocated() / 2 ** 30
    n_tok = a.batch * a.seq
    res = {"gpu": torch.cuda.get_device_name(), "params_B": round(n_params / 1e9, 2), "layers": a.layers,
           "lora": info, "lora_rank": a.lora_rank, "grad_ckpt": not a.no_grad_ckpt,
           "gen": {"batch": a.gen_batch, "prompt": a.prompt, "new": a.new, "tok_s": round(gen_tok / gen_s, 1),
                   "peak_GiB": round(peak_gen, 1)},
           "update": {"batch": a.batch, "seq": a.seq, "score_tok_s": round(n_tok / score_s, 1),
                      "update_tok_s": round(n_tok / upd_s, 1), "step_s": round(score_s + upd_s, 1),
                      "peak_GiB": round(peak_upd, 1), "stats": {k: round(v, 4) for k, v in st.items()}},
           "build_s": round(build_s, 1)}
    print(json.dumps(res), flush=True)
    out = a.out or (os.path.join(os.environ["OUT"], "bench_ppo.json") if os.environ.get("OUT") else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
