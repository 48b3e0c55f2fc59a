"""Multi-turn rollout throughput: engine.Engine vs the plain `model.generate` loop, same model, one run.

The workload mimics agent rollouts: `episodes` conversations start from a `prompt_tokens`
prompt; every turn each one receives an observation of `obs_tokens/2..obs_tokens` random tokens and samples
up to a per-episode budget of `new_tokens/2..new_tokens` tokens. The conversations are driven by the
engine's outputs; on turns < `plain_turns` the plain loop runs on the SAME conversations before the
engine's turn is appended: it left-pads every active conversation, re-encodes it with `model.generate`
(DynamicCache, one batch that waits for its longest row) and cuts each row at its stop id / budget.
Models have random weights built from a config (no download): `toy` (CPU), `small` (~0.7B Qwen3-MoE) and
`a3b` (the Qwen3-30B-A3B shape, ~61 GB in bf16).

KV budget (`--kv-budget-gib`, `--kv-evict offload|drop`): the engine keeps its arena plus the idle caches on the
device within the budget (engine/generate.py, above `Engine`). Preset `a3b_kv`: 64 episodes of the A3B shape grow to
~15-16k tokens each (2,048-token prompt, 4 observations of 3,000-3,500 tokens, turns of <= 32 sampled tokens):
~90 GiB of KV at 96 KiB per token, run within 40 GiB; `toy_kv` is the same mechanism on the CPU toy model.
Reported: arena rows, peak resident KV, tokens offloaded/reloaded/dropped and seconds of copies.

Overlapped turns (`--overlap`): the engine runs all turns in one `Engine.step(follow=)` call, each episode's next
observation joining as soon as its turn ends; the plain loop then replays the first turns on the conversations
the engine produced, and the engine's rate over those turns is taken until every episode had finished them.

Tool latency (`--tool-s S`): each observation arrives U(0, S) seconds after its turn (the sandbox's checks); a step per
turn waits for the turn's slowest, overlapped turns wait on a thread pool while the other rows decode (as
env.run_episodes drives HFPolicy.stream); reported as the rollout's tokens/s with the waits included.

Reported: tokens/s of both over the turns both ran (the plain loop's later turns are only slower, so the
speedup on its first turns is a lower bound), engine tokens/s over all turns, seconds per turn vs turn index,
and under greedy decoding (`--temperature 0`) the fraction of turns where engine and plain produced the
same tokens plus max |delta logprob| over the shared prefix (bf16 batching/padding change rounding).

Departures: none from the paper (this is infrastructure). The plain loop uses `generate`'s own defaults
(on GPU transformers may switch MoE experts to `batched_mm` for decode); the engine uses `--experts`.

Host overhead (`--stub-forward`, preset `host`: the a3b workload on the toy model, the model call replaced by a
logits-table gather): ms per decode step, the host's critical path (its last read of device values to the next
model call: what a GPU idles between steps) and host<->device crossings per step, counted on one more turn.

Smoke (CPU, ~1 min): python scripts/bench_generate.py --preset toy --device cpu
                    python scripts/bench_generate.py --preset toy_kv --device cpu
Host overhead (CPU or GPU, ~30 s): OMP_NUM_THREADS=1 python scripts/bench_generate.py --preset host [--device cuda]
Full (H200, ~4 min each): python scripts/bench_generate.py --preset small --out bench_small.json
                          python scripts/bench_generate.py --preset a3b --out bench_a3b.json
                          python scripts/bench_generate.py --preset a3b_kv --out bench_a3b_kv.json
Flags: --field-name VALUE for any BenchConfig field (tyro when installed, else a plain argparse fallback).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import fused_ops  # noqa: E402
from engine.generate import Engine  # noqa: E402


@dataclasses.dataclass
class BenchConfig:
    preset: str = "toy"
    """model size and workload: toy | small | a3b | toy_kv | a3b_kv"""
    model: str = ""
    """model shape: toy | small | a3b ("": the preset's name)"""
    device: str = "auto"
    """cpu | cuda | auto (cuda when available)"""
    dtype: str = "auto"
    """float32 | bfloat16 | auto (bfloat16 on cuda, float32 on cpu)"""
    episodes: int = 8
    """conversations in the rollout batch"""
    max_batch: int = 0
    """engine decode rows (0 = episodes); fewer rows than episodes exercises continuous batching"""
    turns: int = 4
    """turns per episode for the engine"""
    plain_turns: int = 4
    """turns the plain generate loop also runs (it re-encodes everything, so it gets slow)"""
    prompt_tokens: int = 64
    """tokens in the first prompt"""
    obs_tokens: int = 32
    """max tokens per observation (each is uniform in [obs_min_tokens, obs_tokens])"""
    obs_min_tokens: int = 0
    """min tokens per observation (0: obs_tokens/2)"""
    new_tokens: int = 16
    """max new tokens per turn (each episode's budget is uniform in [new_tokens/2, new_tokens])"""
    temperature: float = 0.0
    """0 = greedy (enables the token-identity check); > 0 samples"""
    stop_frac: float = 0.0
    """fraction of the vocabulary that acts as stop ids (random models rarely hit EOS; > 0 makes rows stop early)"""
    experts: str | None = None
    """MoE experts implementation for the engine: fused (moe_kernel.py, Triton) | grouped_mm | batched_mm | eager |
    None (model default)"""
    fused: bool = True
    """engine RMSNorms as F.rms_norm, rotary embeddings and MoE routers as fused_ops' kernels, one launch each, on
    CUDA (Engine's default); --no-fused: the model's own forwards"""
    attention: str = "auto"
    """engine decode attention: auto (Engine's default: triton on CUDA) | sdpa (a mask over the arena's columns) |
    triton (fused_ops: each row's keys up to its length)"""
    cuda_graphs: bool = True
    """engine decode through CUDA graphs (falls back to eager, and says why, if capture fails)"""
    overlap: bool = False
    """engine: one `step` per turn (as policy.HFPolicy drives it; the turn waits for its longest row); --overlap:
    one `step(follow=)` call for all turns, each episode's next turn joining as soon as its row finishes"""
    tool_s: float = 0.0
    """seconds each observation takes after its turn (the sandbox's compile, verify, profile): uniform in
    [0, tool_s] per episode and turn. Overlapped turns wait for it on a thread pool (follow answers a Future, as
    env.run_episodes does) while the other rows decode; a step per turn waits for the turn's slowest. Reported
    as the rollout's tokens/s with the waits included"""
    feed_tokens: int = 128
    """engine, with --overlap: feed slots a decode step carries for follow-up turns (Engine(feed_tokens=)); 0: each
    group of follow-ups is admitted by its own prefill forward"""
    static_batch: bool = False
    """engine decodes all arena rows every step, as with CUDA graphs (which imply it); for CPU runs"""
    kv_budget_gib: float | None = None
    """engine KV memory on the device (arena + idle caches); None: no limit"""
    kv_evict: str = "offload"
    """what happens to idle caches beyond the budget: offload (to host memory) | drop (re-prefilled later)"""
    stub_forward: bool = False
    """host-overhead mode: the engine's model call becomes one gather from a fixed logits table, so a decode step
    costs only the engine's own work (bookkeeping, sampling, host syncs); the plain loop is skipped"""
    profile_steps: int = 0
    """> 0: one extra turn of this many decode steps under torch.profiler (device time per kernel vs wall)"""
    profile_prefill: bool = False
    """one extra turn under torch.profiler whose observations are obs_tokens long and whose budget is 1 token:
    the device time of an admission (cache loads, prefill, first sample) by kernel group"""
    profile_mixed: int = 0
    """> 0: one extra overlapped call under torch.profiler: each episode samples budgets of up to this many tokens,
    then one follow-up turn (an obs_tokens/2..obs_tokens observation, the same budget) fed through mixed steps;
    device time per kernel and the counts of decode and mixed steps"""
    seed: int = 0
    """seed for weights and workload"""
    out: str | None = None
    """write the results JSON here"""


PRESETS = {
    "toy": BenchConfig(),
    "small": BenchConfig(preset="small", episodes=64, turns=20, plain_turns=6, prompt_tokens=512, obs_tokens=384,
                         new_tokens=192),
    "a3b": BenchConfig(preset="a3b", episodes=32, turns=8, plain_turns=3, prompt_tokens=512, obs_tokens=384,
                       new_tokens=160),
    # 64 x ~15.2k tokens (max ~16.2k) x 96 KiB = ~89 GiB of KV through a 40 GiB budget (26 arena rows at 16k)
    "a3b_kv": BenchConfig(preset="a3b_kv", model="a3b", episodes=64, max_batch=64, turns=5, plain_turns=0,
                          prompt_tokens=2048, obs_tokens=3500, obs_min_tokens=3000, new_tokens=32,
                          kv_budget_gib=40.0),
    # the toy model (512 bytes per token in fp32) within 0.4 MiB: 3-6 arena rows, most idle caches evicted
    "toy_kv": BenchConfig(preset="toy_kv", model="toy", kv_budget_gib=0.0004),
    # the a3b workload (32 episodes, 80-160 sampled tokens a turn) on the toy model with a stubbed forward
    "host": BenchConfig(preset="host", model="toy", episodes=32, turns=8, plain_turns=0, prompt_tokens=512,
                        obs_tokens=384, new_tokens=160, stub_forward=True, static_batch=True),
}

MODELS = {   # Qwen3MoeConfig kwargs
    "toy": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                num_experts_per_tok=2),
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
                  num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                  num_experts_per_tok=4),
    "a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, rope_theta=1e6),
}


def build_model(cfg: BenchConfig, device: str, dtype: torch.dtype):
    """Random-weight Qwen3-MoE of the preset's shape, built directly on the device (no download)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    mcfg = Qwen3MoeConfig(**MODELS[cfg.model or cfg.preset], max_position_embeddings=40960,
                          tie_word_embeddings=False, norm_topk_prob=True, pad_token_id=0, eos_token_id=1,
                          bos_token_id=None)
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(mcfg, dtype=dtype)
    n = sum(p.numel() for p in model.parameters())
    return model.eval(), n


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class _GreedyLogprobs:
    """LogitsProcessor that records log_softmax(logits).max per row: the greedy token's temperature-1 log-prob."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        self.steps.append(torch.log_softmax(scores.float(), dim=-1).max(dim=-1).values.cpu())   # (B,)
        return scores


@torch.no_grad()
def plain_turn_batch(model, convs, budgets, stop_ids, cfg, device):
    """The plain path: left-pad the full conversations, re-encode them with `generate`, cut rows at stop/budget."""
    from transformers import LogitsProcessorList
    L = max(map(len, convs))
    inp = torch.tensor([[0] * (L - len(c)) + c for c in convs], device=device)                # (B, L)
    att = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in convs], device=device)     # (B, L)
    rec = _GreedyLogprobs()
    kw = dict(do_sample=False) if cfg.temperature <= 0 else dict(do_sample=True, temperature=cfg.temperature)
    seq = model.generate(input_ids=inp, attention_mask=att, max_new_tokens=max(budgets), pad_token_id=0,
                         eos_token_id=sorted(stop_ids), top_k=None, top_p=None,
                         logits_processor=LogitsProcessorList([rec]) if cfg.temperature <= 0 else None, **kw)
    gen = seq[:, L:].tolist()
    lps = torch.stack(rec.steps, dim=1).tolist() if rec.steps else [[] for _ in convs]         # (B, T)
    outs = []
    for row, lp, b in zip(gen, lps, budgets):
        row = row[:b]
        n = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        outs.append((row[:n], lp[:n]))
    return outs


KERNEL_GROUPS = [   # (group, regex over kernel names), first match wins
    ("fused MoE experts (moe_kernel, Triton)", r"_gate_up_kernel|_down_kernel|_align_kernel"),
    ("rotary, router, decode attention (fused_ops, Triton)", r"_rope_kernel|_router_kernel|_decode_"),
    ("attention (torch/cuDNN/flash)", r"fmha|attention|flash|sdpa|efficient|softmax"),
    ("GEMM (cuBLAS/CUTLASS, incl. grouped)", r"gemm|nvjet|cutlass|sm90|xmma|grouped|splitK|gemv"),
    ("sort/scatter/gather/index", r"sort|scatter|index|gather|radix|cub|histogram|histc|nonzero"),
    ("other (elementwise, norms, copies)", r""),
]


def profile_decode(eng, episodes: list, steps: int, toks, device: str, obs: int = 1) -> dict:
    """One more turn (an `obs`-token observation each, `steps` new tokens) under torch.profiler: device time per
    decode step by kernel group and top kernels, against the host's wall time per step. With CUDA graphs on and
    steps > 1, a second turn runs eagerly (graphs off) for comparison: the wall-time difference is launch
    overhead. steps = 1: the turn is one admission (its prefill), reported per admission."""
    import re

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    out = {}
    modes = [("graphs", True), ("eager", False)] if eng.cuda_graphs and steps > 1 else [("eager", False)]
    for name, graphs in modes:
        saved = eng.cuda_graphs
        eng.cuda_graphs, eng._graphs = graphs, {}
        reqs = [(e, toks(obs), steps) for e in episodes]
        sync(device)
        with profile(activities=acts, record_shapes=steps == 1) as prof:
            t0 = time.perf_counter()
            outs = eng.step(reqs)
            sync(device)
            wall = time.perf_counter() - t0
        eng.cuda_graphs, eng._graphs = saved, {}
        n = max(len(o[1]) for o in outs)
        kern = [e for e in prof.key_averages() if dev_t(e) > 0 and str(getattr(e, "device_type", "")).endswith("CUDA")]
        kern.sort(key=dev_t, reverse=True)
        total = sum(dev_t(e) for e in kern) / 1e3 / n                   # ms of device time per step
        groups = {g: 0.0 for g, _ in KERNEL_GROUPS}
        for e in kern:
            groups[next(g for g, rx in KERNEL_GROUPS if re.search(rx, e.key, re.I))] += dev_t(e) / 1e3 / n
        top = [(e.key[:80], dev_t(e) / 1e3 / n, e.count / n) for e in kern[:30]]
        what = "decode" if steps > 1 else f"admission ({obs}-token observations)"
        print(f"\n#### {what} profile ({name}): {len(episodes)} rows, {n} steps (incl. the {obs}-token prefill step); "
              f"wall {1e3 * wall / n:.2f} ms/step, kernels {total:.2f} ms/step")
        print("| kernel group | ms/step |\n|---|---:|")
        for g, ms in groups.items():
            print(f"| {g} | {ms:.3f} |")
        print("| top kernels | ms/step (launches/step) |\n|---|---:|")
        for k, ms, c in top:
            print(f"| `{k}` | {ms:.3f} ({c:.1f}) |")
        ops = []
        if steps == 1:   # an admission: which torch ops (with their input shapes) launched the device time
            tot_t = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)  # noqa: E731
            ops = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                          if e.key.startswith("aten::") and tot_t(e) > 0), key=tot_t, reverse=True)[:15]
            ops = [(e.key, str(e.input_shapes)[:90], tot_t(e) / 1e3, e.count) for e in ops]
            print("| torch op (nested ops count in their callers too) | input shapes | device ms (calls) |\n"
                  "|---|---|---:|")
            for k, shp, ms, c in ops:
                print(f"| {k} | {shp} | {ms:.3f} ({c}) |")
        out[name] = dict(rows=len(episodes), steps=n, wall_ms_per_step=1e3 * wall / n, device_ms_per_step=total,
                         groups=groups, top=top, ops=ops)
    return out


def profile_mixed(eng, episodes: list, steps: int, toks, device: str, obs: int) -> dict:
    """One overlapped `step(follow=)` call under torch.profiler (see BenchConfig.profile_mixed): device ms per
    kernel over the whole call, with the number of decode steps and of those that fed follow-ups."""
    from torch.profiler import ProfilerActivity, profile
    rng = random.Random(1)
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    turns = {e: 0 for e in episodes}

    def follow(res):
        turns[res[0]] += 1
        return (toks(rng.randint(obs // 2, obs)), rng.randint(steps // 2, steps)) if turns[res[0]] == 1 else None

    s0 = dict(eng.stats)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.step([(e, toks(1), rng.randint(steps // 2, steps)) for e in episodes], follow=follow)
        sync(device)
        wall = time.perf_counter() - t0
    n, mixed = eng.stats["decode_steps"] - s0["decode_steps"], eng.stats["feed_steps"] - s0["feed_steps"]
    kern = [e for e in prof.key_averages() if dev_t(e) > 0 and str(getattr(e, "device_type", "")).endswith("CUDA")]
    kern.sort(key=dev_t, reverse=True)
    total = sum(dev_t(e) for e in kern) / 1e3
    print(f"\n#### overlapped call profile: {len(episodes)} rows, {n} decode steps of which {mixed} fed follow-ups; "
          f"wall {1e3 * wall:.1f} ms, kernels {total:.1f} ms\n| kernel | ms in the call (launches) |\n|---|---:|")
    top = [(e.key[:80], dev_t(e) / 1e3, e.count) for e in kern[:30]]
    for k, ms, c in top:
        print(f"| `{k}` | {ms:.2f} ({c}) |")
    return dict(steps=n, mixed_steps=mixed, wall_ms=1e3 * wall, device_ms=total, top=top)


class CriticalPath:
    """Host seconds from the engine's last read of device values (`Tensor.tolist`, which waits for the stream)
    to its next model call: the time a GPU would idle between steps. Patches Tensor.tolist while active."""

    def __init__(self):
        self.read_t, self.gaps, self.on = None, [], False

    def model_call(self):
        if self.on and self.read_t is not None:
            self.gaps.append(time.perf_counter() - self.read_t)
        self.read_t = None

    def __enter__(self):
        tolist, cp = torch.Tensor.tolist, self

        def timed_tolist(t):
            out = tolist(t)
            cp.read_t = time.perf_counter()
            return out

        self._saved, torch.Tensor.tolist, self.on, self.read_t = tolist, timed_tolist, True, None
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, self.on = self._saved, False


def stub_forward(eng: Engine, device: str, seed: int, cp: CriticalPath) -> None:
    """Host-overhead mode: the engine's model call returns row `last id % 64` of a fixed (64, V) logits table.
    One gather kernel, capturable in a CUDA graph; the arena is still allocated but never written."""
    V = eng.head.weight.shape[0]
    table = (4 * torch.randn(64, V, generator=torch.Generator().manual_seed(seed))).to(device)   # (64, V)

    def forward(a, b, ids, start, last, live=None):  # ids (B, q), last (B,) -> logits (B, V)
        cp.model_call()
        eng.stats["forwards"] += 1
        return table[ids.gather(1, last[:, None]).squeeze(1) % 64]

    eng._forward = forward


class HostCalls(torch.overrides.TorchFunctionMode):
    """Counts the engine's host<->device crossings by the torch call that makes them: reads of tensor values on
    the host (each a stream sync on CUDA unless the data is already on the host) and tensors built from host
    data or indexed with host lists (each an H2D copy; a blocking one when made with device=)."""
    READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.reads, self.h2d, self.calls = 0, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        self.calls += 1
        if name in self.READS:
            self.reads += 1
        elif name in ("tensor", "as_tensor") and "device" in kwargs:
            self.h2d += 1
        elif name in ("__getitem__", "__setitem__") and any(isinstance(a, list) for a in
                                                            (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.h2d += 1
        return func(*args, **kwargs)


def count_syncs(eng: Engine, reqs: list, device: str) -> dict:
    """One more turn under HostCalls (and on CUDA under torch's sync debug mode): crossings per decode step."""
    import warnings
    steps0 = eng.stats["decode_steps"]
    with warnings.catch_warnings(record=True) as caught, HostCalls() as calls:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step(reqs)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    steps = max(1, eng.stats["decode_steps"] - steps0)
    out = dict(decode_steps=steps, host_reads_per_step=calls.reads / steps, h2d_per_step=calls.h2d / steps,
               torch_calls_per_step=calls.calls / steps)
    if device == "cuda":
        out["cuda_syncs_per_step"] = sum("synchroniz" in str(w.message) for w in caught) / steps
    return out


def timed_plain_turn(model, convs, budgets, stop_ids, cfg, device, row: dict) -> list:
    """plain_turn_batch, its seconds and tokens recorded in row (plain_s, plain_tokens)."""
    sync(device)
    a = time.perf_counter()
    plain = plain_turn_batch(model, convs, budgets, stop_ids, cfg, device)
    sync(device)
    row.update(plain_s=time.perf_counter() - a, plain_tokens=sum(len(p[0]) for p in plain))
    return plain


def lockstep_turns(cfg, eng, model, obs, budgets, stop_ids, device, cp, tools):
    """One engine `step` per turn over all episodes (the turn waits for its longest row); on turns < plain_turns
    the plain loop runs first on the same conversations; then the turn's slowest tool (`tools`[e][t] seconds).
    Returns (rows, [identical, compared, max |dlp|])."""
    convs = [[] for _ in range(cfg.episodes)]
    rows, cmp = [], [0, 0, 0.0]
    for t in range(cfg.turns):
        for e in range(cfg.episodes):
            convs[e] += obs[e][t]
        ctx = sum(map(len, convs)) / cfg.episodes
        row = dict(turn=t, mean_context=round(ctx, 1))
        if t < cfg.plain_turns:
            plain = timed_plain_turn(model, convs, [b[t] for b in budgets], stop_ids, cfg, device, row)
        sync(device)
        a, copy_s, steps = time.perf_counter(), eng.stats["kv_offload_s"], eng.stats["decode_steps"]
        cpu = time.process_time()
        # (.get: the same script also times engines from before these two timers)
        admit_s, capture_s = eng.stats.get("admit_s", 0.0), eng.stats.get("graph_capture_s", 0.0)
        with cp if cfg.stub_forward else contextlib.nullcontext():
            outs = eng.step([(e, obs[e][t], budgets[e][t]) for e in range(cfg.episodes)])
        sync(device)
        row.update(engine_s=time.perf_counter() - a, engine_cpu_s=time.process_time() - cpu,
                   engine_tokens=sum(len(o[1]) for o in outs),
                   decode_steps=eng.stats["decode_steps"] - steps)
        row["ms_per_step"] = 1e3 * row["engine_s"] / max(1, row["decode_steps"])   # prefill included
        row.update(admit_s=eng.stats.get("admit_s", 0.0) - admit_s,
                   capture_s=eng.stats.get("graph_capture_s", 0.0) - capture_s)
        if cfg.kv_budget_gib is not None:
            row["kv_copy_s"] = eng.stats["kv_offload_s"] - copy_s
        if t < cfg.plain_turns and cfg.temperature <= 0:      # token identity under greedy decoding
            row["identical_rows"] = compare([(o[1], o[2]) for o in outs], plain, cmp)
        for e, (_, ids, _, _) in enumerate(outs):
            convs[e] += ids
        row["outs"] = [o[1] for o in outs]
        row["tool_s"] = max(tools[e][t] for e in range(cfg.episodes)) if t + 1 < cfg.turns else 0.0
        time.sleep(row["tool_s"])                                   # every episode's tools, run side by side
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "outs"}),
              flush=True)
    return rows, cmp


def compare(outs: list, plain: list, cmp: list) -> int:
    """Greedy token identity of one turn, engine (ids, lps) rows against plain ones; accumulates cmp = [identical
    turns, compared turns, max |delta log-prob| over the shared prefix]; returns the turn's identical rows."""
    for (ids, lps), (pids, plps) in zip(outs, plain):
        cmp[0] += ids == pids
        cmp[1] += 1
        k = next((i for i, (x, y) in enumerate(zip(ids, pids)) if x != y), min(len(ids), len(pids)))
        k = min(k + 1, len(ids), len(pids))                   # the first differing token's lp is still comparable
        cmp[2] = max([cmp[2]] + [abs(x - y) for x, y in zip(lps[:k], plps[:k])])
    return sum(o[0] == p[0] for o, p in zip(outs, plain))


def overlapped_turns(cfg, eng, model, obs, budgets, stop_ids, device, tools):
    """All turns in one engine `step(follow=)`: an episode's next observation joins the batch as soon as its turn
    ends. Then the plain loop replays turns < plain_turns on the conversations the engine produced. Returns
    (rows, cmp as lockstep_turns, window): window = seconds until every episode had finished turn plain_turns - 1
    and the tokens sampled by then (later turns' included): the engine's rate over the turns the plain loop ran."""
    E, k = cfg.episodes, min(cfg.plain_turns, cfg.turns)
    outs = [[] for _ in range(E)]
    done_at, sampled, left = [0.0] * cfg.turns, [0], [E] * cfg.turns
    window = dict(s=0.0, tokens=0)

    def follow(res):
        e, ids, lps, _ = res
        outs[e].append((ids, lps))
        t, sampled[0] = len(outs[e]) - 1, sampled[0] + len(ids)
        left[t] -= 1
        if left[t] == 0:                               # every episode has finished turn t
            done_at[t] = time.perf_counter() - a
            if t == k - 1:
                window.update(s=done_at[t], tokens=sampled[0])
        if t + 1 == cfg.turns:
            return None
        nxt = (obs[e][t + 1], budgets[e][t + 1])
        return pool.submit(lambda: time.sleep(tools[e][t]) or nxt) if cfg.tool_s > 0 else nxt

    stats0 = dict(eng.stats)
    sync(device)
    a, cpu = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(E) as pool:     # the tools: one thread per episode
        eng.step([(e, obs[e][0], budgets[e][0]) for e in range(E)], follow=follow)
    sync(device)
    wall, cpu = time.perf_counter() - a, time.process_time() - cpu
    d = {key: eng.stats.get(key, 0) - stats0.get(key, 0) for key in ("decode_steps", "admit_s", "graph_capture_s")}
    rows, cmp, convs = [], [0, 0, 0.0], [[] for _ in range(E)]
    for t in range(cfg.turns):
        for e in range(E):
            convs[e] += obs[e][t]
        row = dict(turn=t, mean_context=round(sum(map(len, convs)) / E, 1), engine_done_s=done_at[t],
                   engine_tokens=sum(len(outs[e][t][0]) for e in range(E)))
        if t < cfg.plain_turns:
            plain = timed_plain_turn(model, convs, [b[t] for b in budgets], stop_ids, cfg, device, row)
            if cfg.temperature <= 0:
                row["identical_rows"] = compare([outs[e][t] for e in range(E)], plain, cmp)
        for e in range(E):
            convs[e] += outs[e][t][0]
        row["outs"] = [outs[e][t][0] for e in range(E)]
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "outs"}),
              flush=True)
    # the call's totals go on the first row (turns overlap: there are no per-turn engine seconds)
    rows[0].update(engine_s=wall, engine_cpu_s=cpu, decode_steps=d["decode_steps"], admit_s=d["admit_s"],
                   capture_s=d["graph_capture_s"])
    for r in rows[1:]:
        r.update(engine_s=0.0, engine_cpu_s=0.0, decode_steps=0, admit_s=0.0, capture_s=0.0)
    for r in rows:
        r["tool_s"] = 0.0                              # waited for inside the call
    return rows, cmp, window


def warm_up(cfg: BenchConfig, eng, toks) -> float:
    """Untimed: the run's batch shape for two turns of 4 tokens (all episodes, overlapped like the run): a short
    context, then one long enough for the split decode and feed attentions, so that Triton's compiles, cuBLAS's
    setup and the first graph captures (their eager warm-up) stay out of the timed turns, as in a training
    process after its first rollout. Returns its seconds (a fresh process pays them once)."""
    ids = [f"warmup{e}" for e in range(cfg.episodes)]
    first = [(e, toks(16), 4) for e in ids]
    n = max(cfg.obs_tokens, 2 * fused_ops.DECODE_SPLIT_MIN)
    t0 = time.perf_counter()
    if cfg.overlap and not cfg.stub_forward:
        seen = set()
        eng.step(first, follow=lambda r: None if r[0] in seen or seen.add(r[0]) else (toks(n), 4))
    else:
        eng.step(first)
        eng.step([(e, toks(n), 4) for e in ids])
    for e in ids:
        eng.release(e)
    return time.perf_counter() - t0


@contextlib.contextmanager
def triton_compiles():
    """The kernels Triton compiles (or loads from its disk cache) in this process inside the block, by name: a
    variant that the warm-up did not make shows up here with its compile time inside the timed turns."""
    names: list[str] = []
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    if knobs is None:
        yield names
        return
    old = knobs.runtime.jit_cache_hook

    def hook(**kw):
        names.append(kw["repr"].split("[")[0])
        return False                                   # False: compile as usual

    knobs.runtime.jit_cache_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_cache_hook = old


def main(cfg: BenchConfig) -> int:
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    dtype = (getattr(torch, cfg.dtype) if cfg.dtype != "auto"
             else torch.bfloat16 if device == "cuda" else torch.float32)
    t0 = time.time()
    model, n_params = build_model(cfg, device, dtype)
    V = model.config.vocab_size
    rng = random.Random(cfg.seed)
    stop_ids = {1} | {t for t in range(2, V) if rng.random() < cfg.stop_frac}
    print(f"model {cfg.preset}: {n_params / 1e9:.2f}B params, {dtype}, {device}, built in {time.time() - t0:.0f}s "
          f"(experts={model.get_experts_implementation()}, attn={model.config._attn_implementation})", flush=True)
    toks = lambda n: [rng.randrange(2, V) for _ in range(n)]
    obs = [[toks(cfg.prompt_tokens)] + [toks(rng.randint(cfg.obs_min_tokens or cfg.obs_tokens // 2, cfg.obs_tokens))
                                        for _ in range(cfg.turns - 1)] for _ in range(cfg.episodes)]
    budgets = [[rng.randint(max(1, cfg.new_tokens // 2), cfg.new_tokens) for _ in range(cfg.turns)]
               for _ in range(cfg.episodes)]
    trng = random.Random(cfg.seed + 1)                 # its own stream: the workload stays the same without tools
    tools = [[trng.uniform(0, cfg.tool_s) for _ in range(cfg.turns)] for _ in range(cfg.episodes)]
    eng = Engine(model, None, max_batch=cfg.max_batch or cfg.episodes, max_new_tokens=cfg.new_tokens,
                 temperature=cfg.temperature, seed=cfg.seed, stop_ids=stop_ids, experts=cfg.experts,
                 fused=None if cfg.fused else False, attention=None if cfg.attention == "auto" else cfg.attention,
                 cuda_graphs=cfg.cuda_graphs, static_batch=cfg.static_batch, kv_budget_gib=cfg.kv_budget_gib,
                 kv_evict=cfg.kv_evict, feed_tokens=cfg.feed_tokens)

    cp = CriticalPath()
    if cfg.stub_forward:
        stub_forward(eng, device, cfg.seed, cp)
        cfg = dataclasses.replace(cfg, plain_turns=0)
    # warm-up for both paths (CUDA context, kernels, allocator), then forget the warm-up episodes
    warm_s = warm_up(cfg, eng, toks)
    if cfg.plain_turns:
        plain_turn_batch(model, [toks(16)], [4], stop_ids, cfg, device)
    eng.stats = {k: 0 for k in eng.stats}

    k = min(cfg.plain_turns, cfg.turns)
    with triton_compiles() as compiled:
        if cfg.overlap and not cfg.stub_forward:
            rows, cmp, window = overlapped_turns(cfg, eng, model, obs, budgets, stop_ids, device, tools)
        else:
            rows, cmp = lockstep_turns(cfg, eng, model, obs, budgets, stop_ids, device, cp, tools)
            window = dict(s=sum(r["engine_s"] for r in rows[:k]), tokens=sum(r["engine_tokens"] for r in rows[:k]))
    same, total_cmp, max_dlp = cmp
    convs = [[] for _ in range(cfg.episodes)]
    for r in rows:
        outs = r.pop("outs")
        for e in range(cfg.episodes):
            convs[e] += obs[e][r["turn"]] + outs[e]
    steps = sum(r["decode_steps"] for r in rows)
    syncs = None
    if cfg.stub_forward:   # after the timed turns: counting slows every torch call
        syncs = count_syncs(eng, [(e, toks(cfg.obs_tokens // 2), budgets[e][-1]) for e in range(cfg.episodes)], device)
    tps = lambda rs, key: sum(r[f"{key}_tokens"] for r in rs) / max(1e-9, sum(r[f"{key}_s"] for r in rs))
    res = dict(config=dataclasses.asdict(cfg), device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               params_b=n_params / 1e9, dtype=str(dtype), torch=torch.__version__,
               transformers=__import__("transformers").__version__,
               engine_tok_s=tps(rows, "engine"),
               engine_tok_s_first_k=window["tokens"] / max(1e-9, window["s"]) if k else None,
               plain_tok_s_first_k=tps(rows[:k], "plain") if k else None, plain_turns_run=k,
               identical_turns=f"{same}/{total_cmp}" if total_cmp else None,
               max_abs_dlogprob=max_dlp if total_cmp else None,
               engine_ms_per_step=1e3 * sum(r["engine_s"] for r in rows) / max(1, steps),
               engine_cpu_ms_per_step=1e3 * sum(r["engine_cpu_s"] for r in rows) / max(1, steps),
               admit_s=sum(r["admit_s"] for r in rows), capture_s=sum(r["capture_s"] for r in rows),
               decode_ms_per_step=1e3 * sum(r["engine_s"] - r["admit_s"] - r["capture_s"] for r in rows)
               / max(1, steps),
               engine_tok_per_step=sum(r["engine_tokens"] for r in rows) / max(1, steps), syncs=syncs,
               critical_ms_per_step=1e3 * sum(cp.gaps) / max(1, steps) if cfg.stub_forward else None,
               critical_ms_median=1e3 * sorted(cp.gaps)[len(cp.gaps) // 2] if cp.gaps else None,
               rollout_tok_s=sum(r["engine_tokens"] for r in rows) / sum(r["engine_s"] + r["tool_s"] for r in rows),
               warm_up_s=warm_s, triton_compiles_timed=compiled, engine_stats=eng.stats,
               engine_cuda_graphs=eng.cuda_graphs, graph_error=eng.graph_error, turns=rows,
               kv_all_episodes_gib=sum(map(len, convs)) * eng.kv_token_bytes / 2 ** 30)
    if k:
        res["speedup_first_k"] = res["engine_tok_s_first_k"] / max(1e-9, res["plain_tok_s_first_k"])
    if device == "cuda":
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(res, f, indent=1)

    print(f"\n### engine.Engine vs plain generate loop: {cfg.preset} "
          f"({n_params / 1e9:.2f}B, {res['device']}, {dtype})")
    print(f"{cfg.episodes} episodes x {cfg.turns} turns (plain: first {k}), obs <= {cfg.obs_tokens}, "
          f"new <= {cfg.new_tokens}, max_batch {cfg.max_batch or cfg.episodes}, T={cfg.temperature}, "
          f"KV budget {cfg.kv_budget_gib} GiB ({cfg.kv_evict})\n")
    if "engine_done_s" in rows[0]:   # overlapped turns: when the last episode finished each turn
        print("| turn | mean context | plain s | engine: all episodes done by (s) | plain tok | engine tok "
              "| identical rows |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            plain_s = f"{r['plain_s']:.2f}" if "plain_s" in r else "-"
            print(f"| {r['turn']} | {r['mean_context']:.0f} | {plain_s} | {r['engine_done_s']:.2f} | "
                  f"{r.get('plain_tokens', '-')} | {r['engine_tokens']} | {r.get('identical_rows', '-')} |")
    else:
        print("| turn | mean context | plain s | engine s | plain tok | engine tok | decode steps | engine ms/step "
              "| identical rows |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            plain_s = f"{r['plain_s']:.2f}" if "plain_s" in r else "-"
            print(f"| {r['turn']} | {r['mean_context']:.0f} | {plain_s} | {r['engine_s']:.2f} | "
                  f"{r.get('plain_tokens', '-')} | {r['engine_tokens']} | {r['decode_steps']} | "
                  f"{r['ms_per_step']:.2f} | {r.get('identical_rows', '-')} |")
    print("\n| metric | value |\n|---|---:|")
    if k:
        print(f"| plain tok/s (turns 0..{k - 1}) | {res['plain_tok_s_first_k']:.1f} |")
        until = (f"; overlapped: until every episode had finished turn {k - 1}, incl. later turns' tokens by then"
                 if "engine_done_s" in rows[0] else "")
        print(f"| engine tok/s (turns 0..{k - 1}{until}) | {res['engine_tok_s_first_k']:.1f} |")
        print(f"| speedup (same turns; a lower bound for more turns) | {res['speedup_first_k']:.1f}x |")
    print(f"| engine tok/s (all {cfg.turns} turns) | {res['engine_tok_s']:.1f} |")
    if cfg.tool_s > 0:
        print(f"| rollout tok/s with tools of U(0, {cfg.tool_s:g}) s a turn (wall, the waits included) | "
              f"{res['rollout_tok_s']:.1f} |")
    print(f"| engine ms per decode step (turn seconds incl. prefill / decode steps); sampled tokens per step | "
          f"{res['engine_ms_per_step']:.2f}; {res['engine_tok_per_step']:.1f} |")
    print(f"| engine seconds in admissions (cache loads, prefill, first sample); in graph captures | "
          f"{res['admit_s']:.2f}; {res['capture_s']:.2f} |")
    print(f"| ms per decode step without them | {res['decode_ms_per_step']:.2f} |")
    print(f"| untimed warm-up before the turns (two 4-token turns of all episodes: compiles, first captures) | "
          f"{warm_s:.2f} s |")
    print(f"| Triton kernel variants compiled during the timed turns | {len(compiled)} {sorted(set(compiled))} |")
    print(f"| admissions; decode steps that fed follow-up turns (mixed steps) | {eng.stats['admissions']}; "
          f"{eng.stats.get('feed_steps', 0)} |")
    print(f"| host CPU ms per decode step (process time, all threads, incl. admissions) | "
          f"{res['engine_cpu_ms_per_step']:.2f} |")
    if syncs:
        print(f"| host critical path (last device read to next model call): per decode step incl. finishes and "
              f"admissions; median gap | {res['critical_ms_per_step']:.3f} ms; {res['critical_ms_median']:.3f} ms |")
        print(f"| host reads / host-built device tensors / torch calls per decode step (one more turn, counted) | "
              f"{syncs['host_reads_per_step']:.2f} / {syncs['h2d_per_step']:.2f} / "
              f"{syncs['torch_calls_per_step']:.1f} |")
        if "cuda_syncs_per_step" in syncs:
            print(f"| CUDA syncs per decode step (torch sync debug mode) | {syncs['cuda_syncs_per_step']:.2f} |")
    print(f"| engine CUDA graphs | {eng.cuda_graphs} ({eng.stats.get('graph_replays', 0)} replays"
          f"{'; off: ' + eng.graph_error if eng.graph_error else ''}) |")
    if total_cmp:
        print(f"| greedy identical turns | {same}/{total_cmp} |")
        print(f"| max abs delta logprob (shared prefix) | {max_dlp:.3g} |")
    s = eng.stats
    print(f"| KV of all episodes at the end | {res['kv_all_episodes_gib']:.3g} GiB |")
    print(f"| KV budget; peak resident (arena + idle caches) | {cfg.kv_budget_gib} GiB; "
          f"{s['kv_peak_resident_gib']:.3g} GiB |")
    print(f"| arena rows (max); times the arena grew (overlapped turns) | {s['arena_rows_max']} of "
          f"{cfg.max_batch or cfg.episodes}; {s.get('arena_grows', 0)} |")
    print(f"| KV tokens offloaded / reloaded / dropped | {s['kv_offloaded_tokens']} / {s['kv_reloaded_tokens']} / "
          f"{s['kv_dropped_tokens']} |")
    print(f"| KV copy seconds (offload + reload) | {s['kv_offload_s']:.2f} |")
    moved = (s['kv_offloaded_tokens'] + s['kv_reloaded_tokens']) * eng.kv_token_bytes / 1e9
    print(f"| KV copied; rate | {moved:.3g} GB; {moved / max(1e-9, s['kv_offload_s']):.3g} GB/s |")
    print(f"| host block pool for offloaded KV; seconds allocating it | {s['kv_host_gib']:.3g} GiB; "
          f"{s['kv_host_alloc_s']:.2f} |")
    if device == "cuda":
        print(f"| peak GPU memory allocated | {res['peak_mem_gb']:.1f} GiB |")
    if cfg.profile_steps:
        res["profile"] = profile_decode(eng, list(range(cfg.episodes)), cfg.profile_steps, toks, device)
    if cfg.profile_mixed:
        res["profile_mixed"] = profile_mixed(eng, list(range(cfg.episodes)), cfg.profile_mixed, toks, device,
                                             cfg.obs_tokens)
    if cfg.profile_prefill:
        res["profile_prefill"] = profile_decode(eng, list(range(cfg.episodes)), 1, toks, device, obs=cfg.obs_tokens)
    if cfg.profile_steps or cfg.profile_prefill or cfg.profile_mixed:
        if cfg.out:
            with open(cfg.out, "w") as f:
                json.dump(res, f, indent=1)
    return 0


def cli(argv: list[str]) -> BenchConfig:
    """--preset NAME picks the defaults; --field-name VALUE overrides any BenchConfig field. tyro parses when it
    is installed; the GPU image has none, so a plain argparse over the same fields otherwise."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default="toy", choices=PRESETS)
    name, rest = pre.parse_known_args(argv)
    base = dataclasses.replace(PRESETS[name.preset], preset=name.preset)
    try:
        import tyro  # the command line only
    except ImportError:
        p = argparse.ArgumentParser(prog="bench_generate.py", allow_abbrev=False)
        for f in dataclasses.fields(BenchConfig):
            flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
            default = getattr(base, f.name)
            kind = f.type.split(" ")[0]   # "float | None" -> "float"
            if kind == "bool":
                p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default)
            elif f.name != "preset":
                conv = {"int": int, "float": float, "str": str}[kind]
                p.add_argument(*flags, default=default, type=lambda v, k=conv: None if v == "None" else k(v))
        return dataclasses.replace(base, **vars(p.parse_args(rest)))
    return tyro.cli(BenchConfig, args=rest, default=base, prog="bench_generate.py")


if __name__ == "__main__":
    sys.exit(main(cli(sys.argv[1:])))
