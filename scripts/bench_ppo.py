"""GPU bench for ppo.py at the paper's scale: scoring and one PPO update on long trajectories, random weights.

The model is Qwen3-30B-A3B's architecture (48 layers, hidden 2048, 128 experts, top-8, 3.3B active of 30.5B),
built from its config on the GPU in bf16: nothing is downloaded. LoRA actor + critic + value head come from
ppo.add_actor_critic_adapters (attention + fused experts through peft target_parameters), so this measures
the code `train` runs: the phases of train.ppo_iteration (ppo.score: old log-probs at the policy tokens and
values; ppo.compute_gae; ppo.ppo_update: one clipped actor step and one critic step, gradient checkpointing),
for each trajectory length in --seqs, with --batch trajectories of that length, --micro per forward, once per
--offload mode (off: activations on the GPU; on: --ppo.offload-activations, ppo.offload_activations, what the
update saves for its backward waits in pinned host memory). Scoring runs without autograd and saves nothing,
so the flag does not change it: its rows under "on" repeat the measurement. Before the rows, one unreported
warm-up row (--warmup-seq tokens) compiles the kernels and allocates the AdamW state, so every row holds it,
as every training step after the first does. Optionally (--gen-batch N) first one HF `generate` call with the
actor adapter. Also times compute_gae on --gae-tokens policy tokens (on the GPU and on the CPU).

Each phase of each row is caught on its own: one that runs out of GPU memory is recorded with the exception's
message and the memory at the failure (weights, adapters, gradients, AdamW state, and the rest: activations),
and the next row runs. Reports one JSON line per phase as it finishes and the whole result at the end (also
written to $OUT/bench_ppo.json when $OUT is set, after every phase, so a run stopped by a time limit keeps what
it did): tokens/s, peak GPU memory and its breakdown of each phase, GiB moved to host per forward.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/bench_ppo.py --seqs 32768 65536 131072 \
        --batch 1 1 1 --micro 1 1 1 --offload on off    # one trajectory of 32k, 64k, 128k tokens, offload on
                                                        # and off (estimated 7-9 min on one H200)
    python scripts/bench_ppo.py --seqs 32768 65536 --batch 2 1 --micro 2 1   # the 32k / 64k rows
    python scripts/bench_ppo.py --seqs 4096 --batch 4 --micro 1               # 4 x 4k tokens
    python scripts/bench_ppo.py --device cpu --seqs 256 512 --batch 2 1 --micro 2 1 --offload off on  # test it
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

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


def gib(n: float) -> float:
    return round(n / 2 ** 30, 2)


def tensors_bytes(ts) -> int:
    """Bytes of distinct storages among tensors ts (a tensor reached twice counts once)."""
    seen, n = set(), 0
    for t in ts:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            n += t.untyped_storage().nbytes()
    return n


def memory(model, head, opt: dict, dev: torch.device) -> dict:
    """Where the GPU memory is now (GiB): frozen weights, LoRA adapters + value head, gradients, AdamW state,
    and on CUDA what the allocator holds; `activations_GiB` = allocated - those four (saved activations and
    transients), `peak_activations_GiB` the same at the phase's peak (against the four as they are now)."""
    train = [p for n, p in model.named_parameters() if "lora_" in n] + list(head.parameters())
    ids = {id(p) for p in train}
    static = {"weights_GiB": tensors_bytes(p for p in model.parameters() if id(p) not in ids),
              "adapters_GiB": tensors_bytes(train),
              "grads_GiB": tensors_bytes(p.grad for p in train),
              "optimizer_GiB": tensors_bytes(v for o in opt.values() for st in o.state.values()
                                             for v in st.values() if torch.is_tensor(v) and v.dim() > 0)}
    out = {k: gib(v) for k, v in static.items()}
    if dev.type == "cuda":
        st, total = torch.cuda.memory_stats(), sum(static.values())
        out.update(allocated_GiB=gib(st["allocated_bytes.all.current"]),
                   activations_GiB=gib(st["allocated_bytes.all.current"] - total),
                   peak_GiB=gib(st["allocated_bytes.all.peak"]),
                   peak_activations_GiB=gib(st["allocated_bytes.all.peak"] - total),
                   reserved_GiB=gib(st["reserved_bytes.all.current"]),
                   inactive_split_GiB=gib(st.get("inactive_split_bytes.all.current", 0)),
                   num_alloc_retries=st.get("num_alloc_retries", 0), num_ooms=st.get("num_ooms", 0),
                   device_total_GiB=gib(torch.cuda.get_device_properties(dev).total_memory))
        try:  # the pinned host allocator (where --ppo.offload-activations puts the saved tensors)
            hst = torch.cuda.host_memory_stats()
            out["host_pinned_peak_GiB"] = gib(hst.get("allocated_bytes.peak", 0))
        except Exception:  # noqa: BLE001 - older torch: no host allocator statistics
            pass
    return out


def reset_host_peak(dev: torch.device) -> None:
    if dev.type == "cuda" and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        try:
            torch.cuda.reset_peak_host_memory_stats()
        except Exception:  # noqa: BLE001 - a diagnostic must not end the bench
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: the A3B shape; cpu: a scaled-down shape, to test this script")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same as --device cpu")
    ap.add_argument("--layers", type=int, default=48, help="decoder layers kept (48 = full size)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096], help="tokens per trajectory, one row each")
    ap.add_argument("--batch", type=int, nargs="+", default=[4], help="trajectories per row (one per --seqs)")
    ap.add_argument("--micro", type=int, nargs="+", default=[1], help="trajectories per forward (one per --seqs)")
    ap.add_argument("--offload", nargs="+", choices=["off", "on"], default=["off"],
                    help="--offload-activations modes, each row once per mode, in this order")
    ap.add_argument("--warmup-seq", type=int, default=2048, help="tokens of the unreported warm-up row (0 = none)")
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
    ap.add_argument("--out", default=None, help="also write the JSON result here (default: $OUT/bench_ppo.json)")
    a = ap.parse_args(argv)
    assert len(a.seqs) == len(a.batch) == len(a.micro), "--seqs, --batch and --micro take one value per row"
    dev = torch.device("cpu" if a.cpu_dry_run or a.device == "cpu" else "cuda")
    shape = {**QWEN3_30B_A3B, "num_hidden_layers": a.layers}
    if dev.type == "cpu":
        shape.update(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
        ppo.OFFLOAD_MIN_BYTES = 0  # the tiny shape's saved tensors are all small: move them anyway, to test it
    else:
        assert torch.cuda.is_available(), "needs a GPU (or --device cpu)"
    out = a.out or (os.path.join(os.environ["OUT"], "bench_ppo.json") if os.environ.get("OUT") else None)
    res = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)", "torch": torch.__version__,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "rows": []}
    t_start = time.time()

    def save(line: dict) -> None:
        print(json.dumps(line), flush=True)
        res["elapsed_s"] = round(time.time() - t_start, 1)
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(out + ".tmp", out)

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
    cfg = dataclasses.replace(train_config.PRESETS["paper"].ppo, epochs=1, num_minibatches=1)
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
    if a.warmup_seq > 0:  # kernels compiled and AdamW state allocated before the first reported row
        warm = {"seq": a.warmup_seq, "batch": 1, "micro": 1, "offload": False}
        run_row(a, warm, lambda line: None, model, head, opt, cfg, conf, dev, False)
        res["warmup"] = {k: v for k, v in warm.items() if k in ("seq", "score_s", "update_s") or "_oom" in k
                         or "_error" in k}
        save({"warmup": res["warmup"]})
    for seq, batch, micro in zip(a.seqs, a.batch, a.micro):
        for mode in a.offload:
            row = {"seq": seq, "batch": batch, "micro": micro, "offload": mode == "on"}
            res["rows"].append(row)
            run_row(a, row, save, model, head, opt, cfg, conf, dev, mem_sites)
    print("\n| seq | batch x micro | offload | score tok/s | score peak GiB | update tok/s | update peak GiB | "
          "host GiB per forward |")
    for r in res["rows"]:
        print(f"| {r['seq']} | {r['batch']} x {r['micro']} | {'on' if r['offload'] else 'off'} | "
              f"{r.get('score_tok_s', 'OOM' if 'score_oom' in r else '-')} | {r.get('score_peak_GiB', '-')} | "
              f"{r.get('update_tok_s', 'OOM' if 'update_oom' in r else '-')} | {r.get('update_peak_GiB', '-')} | "
              f"{r.get('update_offload_GiB', '-')} |")
    print(f"GAE on {a.gae_tokens} tokens: {res['gae']}; {res['elapsed_s']} s in all")
    errors = [(r["seq"], k, v) for r in res["rows"] for k, v in r.items() if k.endswith("_error")]
    for e in errors:
        print("error (not out of memory):", *e)
    return 1 if errors else 0


def phase(name: str, row: dict, save, model, head, opt, dev: torch.device, mem_sites: bool, fn) -> bool:
    """Run fn() as phase `name` of `row` (score or update): its seconds, tokens/s, peak and memory breakdown. An
    error is recorded in the row instead of ending the bench: `{name}_oom` for running out of GPU memory, else
    `{name}_error` (main then exits 1), with the message and the memory at the failure. True if it ran."""
    reset_peak(dev)
    reset_host_peak(dev)
    sync(dev)
    t = time.time()
    try:
        fn()
        sync(dev)
        dt = time.time() - t
        row.update({f"{name}_s": round(dt, 1), f"{name}_tok_s": round(row["batch"] * row["seq"] / dt, 1),
                    f"{name}_peak_GiB": peak_gib(dev), f"{name}_mem": memory(model, head, opt, dev)})
        ok = True
    except Exception as e:  # noqa: BLE001 - recorded; the frames of the failed phase are alive: memory at the failure
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e) or "ALLOC_FAILED" in str(e)
        row.update({f"{name}_oom" if oom else f"{name}_error": f"{type(e).__name__}: {str(e)[:400]}",
                    f"{name}_s": round(time.time() - t, 1), f"{name}_mem": memory(model, head, opt, dev)})
        if mem_sites and oom:
            row[f"{name}_oom_sites"] = live_by_site()
        ok = False
    if not ok:  # free what the failed phase left (gradients, the exception's frames) before the next one
        for o in opt.values():
            o.zero_grad(set_to_none=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save({"row": row})
    return ok


def run_row(a, row: dict, save, model, head, opt, cfg, conf, dev, mem_sites: bool) -> None:
    """One row: row["batch"] trajectories of row["seq"] tokens, scored then updated (micro-batches of
    row["micro"]), with --ppo.offload-activations as row["offload"] says."""
    seq, batch, micro = row["seq"], row["batch"], row["micro"]
    cfg = dataclasses.replace(cfg, micro_batch_size=micro, offload_activations=row["offload"])
    temperature = train_config.PRESETS["paper"].sampler.temperature
    g = torch.Generator().manual_seed(seq)
    ids = [torch.randint(0, conf.vocab_size, (seq,), generator=g).tolist() for _ in range(batch)]
    n_prompt = int(seq * a.prompt_frac)
    masks = [[0] * n_prompt + [1] * (seq - n_prompt)] * batch  # a prompt, then policy tokens
    b_ids, b_attn, b_mask, b_rewards = ppo.collate(ids, masks, [float(i % 4) - 1.0 for i in range(batch)], 0,
                                                   dev)                                          # (B, T) each
    row["policy_tokens"] = batch * (seq - n_prompt)
    model.train()
    sc = {}

    def score():  # 2-4) old log-probs at the policy tokens, values (B, T); GAE + whitening
        b_values, b_logp, _ = ppo.score(model, head, b_ids, b_attn, micro, temperature, b_mask=b_mask)
        b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask, cfg.gamma, cfg.lam)
        sc.update(b_values=b_values, b_logp=b_logp, b_adv=ppo.whiten_advantages(b_adv, b_mask), b_returns=b_returns)

    if not phase("score", row, save, model, head, opt, dev, mem_sites, score):
        row["update_error" if "score_error" in row else "update_oom"] = "not run: scoring failed"
        save({"row": row})
        return
    if mem_sites:  # where a forward with autograd keeps memory (one micro-batch of the actor)
        base_gib = torch.cuda.memory_allocated() / 2 ** 30
        rows_ = torch.arange(min(micro, batch), device=dev)
        try:
            with ppo.offload_activations(cfg.offload_activations):
                lp, _ = ppo.actor_logprobs(model, b_ids[rows_], b_attn[rows_], with_entropy=True, mask=b_mask[rows_])
            row["probe_fwd_kept_GiB"] = round(torch.cuda.memory_allocated() / 2 ** 30 - base_gib, 2)
            row["probe_fwd_sites"] = live_by_site(8)
            del lp, _
        except torch.OutOfMemoryError as e:
            row["probe_fwd_oom"] = str(e)[:200]
        gc.collect()
        save({"row": row})

    def update():  # 5) one PPO update: actor (clipped loss, entropy) + critic (value loss), one AdamW step each
        st = ppo.ppo_update(model, head, opt, cfg, temperature, b_ids, b_attn, b_mask, sc["b_logp"], sc["b_values"],
                            sc["b_adv"], sc["b_returns"], n_global=batch)
        row["stats"] = {k: round(v, 4) for k, v in st.items()}
        if "offload_GiB" in st:
            row["update_offload_GiB"] = round(st["offload_GiB"], 6)  # copied to host per forward (mean)

    phase("update", row, save, model, head, opt, dev, mem_sites, update)
    sc.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
