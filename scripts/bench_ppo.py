"""GPU bench for ppo.py at the paper's scale: scoring and one PPO update on long trajectories, random weights.

The model is Qwen3-30B-A3B's architecture (48 layers, hidden 2048, 128 experts, top-8, 3.3B active of 30.5B),
built from its config on the GPU in bf16: nothing is downloaded. LoRA actor + critic + value head come from
ppo.add_actor_critic_adapters (attention + fused experts through peft target_parameters), so this measures
the code `train` runs: the phases of train.ppo_iteration (ppo.score: old log-probs at the policy tokens and
values; ppo.compute_gae; ppo.ppo_update: one clipped actor step and one critic step, gradient checkpointing),
for each trajectory length in --seqs, with --batch trajectories of that length, --micro per forward.
Optionally (--gen-batch N) first one HF `generate` call with the actor adapter. Also times compute_gae on
--gae-tokens policy tokens (on the GPU and on the CPU).

Reports one JSON line per phase as it finishes and the whole result at the end (also written to
$OUT/bench_ppo.json when $OUT is set, after every phase, so a run stopped by a time limit keeps what it did):
tokens/s and peak GPU memory of each phase.

    python scripts/bench_ppo.py --seqs 32768 65536 --batch 2 1 --micro 2 1   # the 32k / 64k rows
    python scripts/bench_ppo.py --seqs 4096 --batch 4 --micro 1               # 4 x 4k tokens
    python scripts/bench_ppo.py --cpu-dry-run --seqs 256 512 --batch 2 1 --micro 2 1   # test this script
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
import train_config  # noqa: E402

# Qwen/Qwen3-30B-A3B config.json (public), restated so nothing is downloaded.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     mlp_only_layers=[])


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(dev: torch.device) -> float:
    return round(torch.cuda.max_memory_allocated() / 2 ** 30, 1) if dev.type == "cuda" else 0.0


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def time_gae(n_tokens: int, dev: torch.device) -> float:
    """Seconds of ppo.compute_gae on one trajectory of n_tokens (a prompt, then policy turns with gaps)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(1, n_tokens, generator=g) > 0.1).float()  # ~10% observation tokens
    mask[:, :512] = 0
    values = torch.randn(1, n_tokens, generator=g)
    rewards = torch.zeros(1, n_tokens)
    rewards[0, int(mask[0].nonzero()[-1])] = 3.0
    mask, values, rewards = mask.to(dev), values.to(dev), rewards.to(dev)
    ppo.compute_gae(rewards, values, mask)  # warm-up
    sync(dev)
    t = time.perf_counter()
    ppo.compute_gae(rewards, values, mask)
    sync(dev)
    return time.perf_counter() - t


def live_by_site(top: int = 12) -> list[tuple[str, float]]:
    """GiB of live CUDA allocations grouped by the innermost python frame in this repo, transformers, peft or
    torch.utils (needs torch.cuda.memory._record_memory_history): where the memory of a phase went."""
    sites: dict[str, int] = {}
    try:
        segments = torch.cuda.memory._snapshot()["segments"]
    except Exception as e:  # noqa: BLE001 - a diagnostic must not end the bench
        return [(f"no snapshot: {e}", 0.0)]
    for seg in segments:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = [f for f in blk.get("frames") or [] if "filename" in f]
            f = next((f for f in frames if any(k in f["filename"] for k in ("/main/", "transformers/", "peft/",
                                                                            "torch/utils/", "torch/nn/"))),
                     frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
            key = f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
            sites[key] = sites.get(key, 0) + blk["size"]
    return [(k, round(v / 2 ** 30, 2)) for k, v in sorted(sites.items(), key=lambda kv: -kv[1])[:top]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48, help="decoder layers kept (48 = full size)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096], help="tokens per trajectory, one row each")
    ap.add_argument("--batch", type=int, nargs="+", default=[4], help="trajectories per row (one per --seqs)")
    ap.add_argument("--micro", type=int, nargs="+", default=[1], help="trajectories per forward (one per --seqs)")
    ap.add_argument("--prompt-frac", type=float, default=0.25, help="share of each trajectory that is prompt")
    ap.add_argument("--gen-batch", type=int, default=0, help="prompts for one generate call first (0 = skip)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens for generation")
    ap.add_argument("--new", type=int, default=256, help="new tokens per prompt")
    ap.add_argument("--gae-tokens", type=int, default=131072, help="policy-token count for the GAE timing")
    ap.add_argument("--lora-rank", type=int, default=16, help="the paper preset's rank")
    ap.add_argument("--lora-targets", default="attention,experts")
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--mem-sites", action="store_true", help="record CUDA allocations: on OOM and after a probe "
                    "forward, print the live GiB per code site")
    ap.add_argument("--cpu-dry-run", action="store_true", help="a scaled-down shape on CPU, to test this script")
    ap.add_argument("--out", default=None, help="also write the JSON result here (default: $OUT/bench_ppo.json)")
    a = ap.parse_args()
    assert len(a.seqs) == len(a.batch) == len(a.micro), "--seqs, --batch and --micro take one value per row"
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    shape = {**QWEN3_30B_A3B, "num_hidden_layers": a.layers}
    if a.cpu_dry_run:
        shape.update(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    else:
        assert torch.cuda.is_available(), "needs a GPU (or --cpu-dry-run)"
    dev = torch.device("cpu" if a.cpu_dry_run else "cuda")
    out = a.out or (os.path.join(os.environ["OUT"], "bench_ppo.json") if os.environ.get("OUT") else None)
    res = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)", "rows": []}

    def save(line: dict) -> None:
        print(json.dumps(line), flush=True)
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)

    # GAE first: cheap, and independent of the model
    res["gae"] = {"tokens": a.gae_tokens, "cpu_s": round(time_gae(a.gae_tokens, torch.device("cpu")), 4),
                  f"{dev.type}_s": round(time_gae(a.gae_tokens, dev), 4)}
    save({"gae": res["gae"]})

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
    res.update(params_B=round(n_params / 1e9, 2), layers=a.layers, lora=info, lora_rank=a.lora_rank,
               lora_params_per_adapter=sum(p.numel() for p in ppo.adapter_params(model, "actor")),
               grad_ckpt=not a.no_grad_ckpt, experts_impl=str(getattr(conf, "_experts_implementation", None)),
               build_s=round(time.time() - t0, 1), weights_GiB=peak_gib(dev))
    save({k: v for k, v in res.items() if k != "rows"})
    cfg = dataclasses.replace(train_config.PRESETS["paper"], ppo_epochs=1, num_minibatches=1)
    opt = ppo.make_optimizers(model, head, cfg)

    if a.gen_batch > 0:  # rollout: generation with the actor adapter (KV cache, sampling)
        model.set_adapter("actor")
        model.eval()  # KV cache on (gradient checkpointing only applies in train mode)
        prompt = torch.randint(0, conf.vocab_size, (a.gen_batch, a.prompt), device=dev)
        reset_peak(dev)
        with torch.no_grad():
            model.generate(input_ids=prompt[:, :32], max_new_tokens=4, do_sample=True)  # warm-up
            sync(dev)
            t = time.time()
            gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=a.new,
                                 min_new_tokens=a.new, do_sample=True, temperature=1.0, top_k=0)
            sync(dev)
        res["gen"] = {"batch": a.gen_batch, "prompt": a.prompt, "new": a.new,
                      "tok_s": round((gen.shape[1] - a.prompt) * a.gen_batch / (time.time() - t), 1),
                      "peak_GiB": peak_gib(dev)}
        save({"gen": res["gen"]})

    mem_sites = a.mem_sites and dev.type == "cuda"
    if mem_sites:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    for seq, batch, micro in zip(a.seqs, a.batch, a.micro):
        try:
            run_row(a, res, save, model, head, opt, cfg, conf, dev, seq, batch, micro, mem_sites)
        except torch.OutOfMemoryError as e:
            row = res["rows"][-1] if res["rows"] and res["rows"][-1]["seq"] == seq else {"seq": seq}
            row.update(oom=str(e).split(".")[0], oom_allocated_GiB=round(torch.cuda.memory_allocated() / 2 ** 30, 1))
            if mem_sites:
                row["oom_sites"] = live_by_site()
            if row not in res["rows"]:
                res["rows"].append(row)
            save({"row": row})
        for o in opt.values():
            o.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("\n| seq | batch x micro | score tok/s | score peak GiB | update tok/s | update peak GiB |")
    for r in res["rows"]:
        print(f"| {r['seq']} | {r.get('batch')} x {r.get('micro')} | {r.get('score_tok_s')} | "
              f"{r.get('score_peak_GiB')} | {r.get('update_tok_s', r.get('oom', '-'))} | {r.get('update_peak_GiB')} |")
    print(f"GAE on {a.gae_tokens} tokens: {res['gae']}")
    return 0


def run_row(a, res, save, model, head, opt, cfg, conf, dev, seq: int, batch: int, micro: int, mem_sites: bool):
    """One row: --batch trajectories of `seq` tokens, scored then updated (micro-batches of `micro`)."""
    cfg = dataclasses.replace(cfg, micro_batch_size=micro)
    g = torch.Generator().manual_seed(seq)
    ids = [torch.randint(0, conf.vocab_size, (seq,), generator=g).tolist() for _ in range(batch)]
    n_prompt = int(seq * a.prompt_frac)
    masks = [[0] * n_prompt + [1] * (seq - n_prompt)] * batch  # a prompt, then policy tokens
    b_ids, b_attn, b_mask, b_rewards = ppo.collate(ids, masks, [float(i % 4) - 1.0 for i in range(batch)], 0,
                                                   dev)
    row = {"seq": seq, "batch": batch, "micro": micro, "policy_tokens": batch * (seq - n_prompt)}
    model.train()
    # 2-4) score (old log-probs at the policy tokens, values) + GAE + whitening
    reset_peak(dev)
    sync(dev)
    t = time.time()
    b_values, b_logp, _ = ppo.score(model, head, b_ids, b_attn, micro, cfg.temperature, b_mask=b_mask)
    b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask, cfg.gamma, cfg.lam)
    b_adv = ppo.whiten_advantages(b_adv, b_mask)
    sync(dev)
    row.update(score_s=round(time.time() - t, 1), score_tok_s=round(batch * seq / (time.time() - t), 1),
               score_peak_GiB=peak_gib(dev))
    res["rows"].append(row)
    save({"row": row})
    if mem_sites:  # where a forward with autograd keeps memory (one micro-batch of the actor)
        base_gib = torch.cuda.memory_allocated() / 2 ** 30
        rows_ = torch.arange(min(micro, batch), device=dev)
        lp, _ = ppo.actor_logprobs(model, b_ids[rows_], b_attn[rows_], with_entropy=True, mask=b_mask[rows_])
        row["probe_fwd_kept_GiB"] = round(torch.cuda.memory_allocated() / 2 ** 30 - base_gib, 2)
        row["probe_fwd_sites"] = live_by_site(8)
        del lp, _
        save({"row": row})
    # 5) one PPO update: actor (clipped loss, entropy) + critic (value loss), one optimizer step each
    reset_peak(dev)
    t = time.time()
    st = ppo.ppo_update(model, head, opt, cfg, b_ids, b_attn, b_mask, b_logp, b_values, b_adv, b_returns,
                        n_global=batch)
    sync(dev)
    row.update(update_s=round(time.time() - t, 1), update_tok_s=round(batch * seq / (time.time() - t), 1),
               update_peak_GiB=peak_gib(dev), stats={k: round(v, 4) for k, v in st.items()})
    save({"row": row})


if __name__ == "__main__":
    sys.exit(main())
