"""Task synthesis (paper §3.1), the `synth` command: compose operators of the catalogue (synth_ops.py) into
KernelBench-format tasks, keep those that pass every filter (synth_filters.py), and write a JSONL training
set with a manifest beside it. The trainer reads it with tasks.load_tasks.

  1. Composer (`compose_program`, seeded, no LLM): the op count follows the paper's mix (3.4/83.8/7.6/2.8/
     1.2 % for 1-5 ops, 1.2 % standalone transformers layers), then a realistic start shape, then a chain of
     ops whose accepted ranks match, shapes tracked on the meta device. It emits `class Model(nn.Module)`,
     `get_inputs()`, `get_init_inputs()`. `compose_llm` (`--composer llm`): a policy picks and writes them.
  2. Pipeline (`main`): static filters in the parent, execution filters in `--workers` isolated children;
     rows {index, hash, data_source, ops, device, seed, eager_ms, compile_ms, spec, code} in candidate order,
     `<out>.manifest.json` (command, versions, counts, rejections per filter), `<out>.catalogue.json`,
     `<out>.progress.jsonl` (resume). Candidate i draws from its own RNG seeded by (seed, i), so a run is
     reproducible and resumable whatever the worker count. `--demos-dir` also writes demos (synth_ops.write_demos).

Departures from the paper
  1. The paper's composer is an LLM; ours is programmatic by default (reproducible, free).
  2. The 1-100 ms window is for CUDA; `--scale cpu` uses smaller tensors and a 0.02-50 ms window, so the
     pipeline (and the shipped tiny set) runs without a GPU.
  3. `--no-timings` drops eager_ms/compile_ms, the only run-dependent fields: the same seed then gives a
     byte-identical file.

Smoke: python cuda_agent.py synth --scale cpu --n-candidates 16 --out runs/synth/smoke.jsonl
Full:  python cuda_agent.py synth --sandbox.device cuda --n-candidates 20000 --n-tasks 6000 --workers 12 \
           --kernelbench-dir ~/KernelBench --out runs/synth/ops6k.jsonl
Bench: python scripts/bench_synth.py --n-candidates 240 --workers 8   (per-filter pass rates, tasks/hour)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import random
import re
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace

import torch
from tqdm import tqdm

from env import EpisodeState, resolve_device
from policy import PolicyConfig, make_policy
from sandbox import RayPool, SandboxConfig
from synth_filters import FILTERS, kernelbench_refs, run_chunk, static_filters
from synth_ops import call_op, catalogue_report, instantiate, mine_catalogue, write_demos
from tasks import source_hash

# --------------------------------------------------------------------------------------------------
# 1) config
# --------------------------------------------------------------------------------------------------


def _synth_sandbox() -> SandboxConfig:
    """The sandbox settings synth starts from: quicker timing than rewards need (medians of 10 runs decide a
    1-100 ms window), room for a chunk of candidates in one child, and device auto (cuda when torch lists a
    GPU, else cpu; `main` resolves it) like every other command."""
    return SandboxConfig(device="auto", mem_limit_mb=16384, warmup=3, iters=10)


@dataclass
class SynthConfig:
    out: str = "runs/synth/tasks.jsonl"
    """output JSONL; the manifest goes to <out>.manifest.json, resume state to <out>.progress.jsonl"""
    n_candidates: int = 200
    """number of composed candidates to try"""
    n_tasks: int | None = None
    """stop once this many tasks are accepted (None: try all candidates)"""
    seed: int = 0
    """master seed; candidate i uses its own RNG seeded by (seed, i), and its inputs the seed itself"""
    sandbox: SandboxConfig = field(default_factory=_synth_sandbox)
    """where and how the execution filters run: device (auto | cpu | cuda), mem_limit_mb (one child),
    warmup/iters (eager and compiled timing), atol/rtol (nondegenerate and runs_compile), ray_address (the
    chunks run on a Ray cluster's lanes, sandbox/ray.py); its other fields do not apply here"""
    scale: str = "auto"
    """tensor sizes and runtime window: cuda (1-100 ms, real sizes) | cpu (0.02-50 ms, small) | auto (= device)"""
    min_ms: float | None = None
    """lower bound of the eager runtime window in ms (None: the preset's)"""
    max_ms: float | None = None
    """upper bound of the eager runtime window in ms (None: the preset's)"""
    mix: str = "3.4,83.8,7.6,2.8,1.2,1.2"
    """percent of candidates with 1,2,3,4,5 torch ops and standalone transformers layers (paper §3.1)"""
    pointwise_frac: float = 0.0
    """fraction of candidates built only from pointwise ops with C equivalents (lets demos be generated)"""
    composer: str = "program"
    """program (seeded, no LLM) | llm (a policy picks operators and writes the module)"""
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(kind="openai", max_new_tokens=2048))
    """the llm composer's policy (--composer llm only): an OpenAI-compatible endpoint or a local hf model"""
    kernelbench_dir: str | None = None
    """KernelBench for the contamination filter: a checkout (KernelBench/level{N}/{id}_{Name}.py), a .jsonl
    in the HF schema or the hub id (anything tasks.load_kernelbench reads); None: no contamination filter"""
    contamination_threshold: float = 0.9
    """drop a task whose AST similarity to any KernelBench problem is above this"""
    use_transformers: bool = True
    """mine transformers activations/norms/MLPs (standalone tasks) when transformers is importable"""
    workers: int = 2
    """parallel isolated filter processes (with --sandbox.ray-address: on each lane)"""
    chunk: int = 8
    """candidates per isolated child (amortizes torch import and compile warm-up)"""
    timeout_s: float = 900.0
    """wall-clock limit for one child (a chunk); a chunk that times out is re-run one candidate at a time"""
    compile_backend: str = "inductor"
    """torch.compile backend for the runs_compile filter (inductor is the paper's; aot_eager is fast)"""
    calibrate: bool = True
    """grow the batch of a candidate that runs under min_ms by a power of two (inputs up to 2^29 elements)
    and filter it again, as a user sizes a task for the target GPU; the timing-dependent size means the
    same seed gives the same file only on the same kind of device (--no-calibrate: everywhere)"""
    timings: bool = True
    """record eager_ms/compile_ms in the JSONL (off: the same seed gives a byte-identical file)"""
    resume: bool = True
    """continue from <out>.progress.jsonl when it exists"""
    demos_dir: str | None = None
    """if set, write generated demo workspaces for accepted pointwise tasks here (+ index.jsonl)"""
    progress: bool = True
    """show a tqdm progress bar"""


PRESETS = {  # (min_ms, max_ms, min_numel, max_numel) of the first input
    "cuda": (1.0, 100.0, 2 ** 22, 2 ** 27),
    "cpu": (0.02, 50.0, 2 ** 12, 2 ** 16),   # wide: CPU timings are noisy on a shared machine
}

# --------------------------------------------------------------------------------------------------
# 2) composer: seeded program (default) and LLM (optional)
# --------------------------------------------------------------------------------------------------

KIND_WEIGHTS = {"module": 0.5, "functional": 0.25, "tensor": 0.25}   # nn classes are the paper's seeds
RANK_WEIGHTS = {2: 0.3, 3: 0.2, 4: 0.4, 5: 0.1}
_DIM_NAMES = {2: ("batch_size", "features"), 3: ("batch_size", "channels", "length"),
              4: ("batch_size", "channels", "height", "width"),
              5: ("batch_size", "channels", "depth", "height", "width")}


def parse_mix(mix: str) -> list[float]:
    w = [float(v) for v in mix.split(",")]
    assert len(w) == 6 and all(v >= 0 for v in w) and sum(w) > 0, f"--mix needs 6 non-negative numbers, got {mix!r}"
    return w


def candidate_rng(seed: int, index: int) -> random.Random:
    """Candidate i's own RNG: results do not depend on worker count or order (resumable, reproducible)."""
    return random.Random(int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little"))


def _fit(shape: list[int], lo: int, hi: int) -> tuple:
    """Halve the largest even dim until numel <= hi; double the batch until numel >= lo."""
    while math.prod(shape) > hi:
        evens = [i for i, s in enumerate(shape) if s % 2 == 0 and s >= 4]
        if not evens:
            break
        i = max(evens, key=lambda j: (shape[j], -j))
        shape[i] //= 2
    while math.prod(shape) < lo:
        shape[0] *= 2
    return tuple(shape)


def start_shape(rank: int, rng: random.Random, preset: str) -> tuple:
    """A realistic input shape (KernelBench-like sizes) scaled into the preset's numel range."""
    lo, hi = PRESETS[preset][2:]
    c = rng.choice
    if rank == 2:
        s = [c([128, 256, 512, 1024, 2048, 4096]), c([256, 512, 1024, 2048, 4096, 8192])]
    elif rank == 3:
        s = [c([8, 16, 32, 64]), c([16, 32, 64, 128, 256]), c([128, 256, 512, 1024, 2048])]
    elif rank == 4:
        h = c([32, 64, 128, 224, 256])
        s = [c([8, 16, 32, 64]), c([3, 16, 32, 64, 128]), h, h]
    else:
        h = c([32, 64, 128])
        s = [c([2, 4, 8, 16]), c([3, 8, 16, 32]), c([8, 16, 32]), h, h]
    return _fit(s, lo, hi)


def _meta_shape(entry: dict, kw: dict, shape: tuple) -> tuple | None:
    try:
        with torch.no_grad():
            y = call_op(entry, kw, device="meta")(torch.empty(shape, device="meta"))
        return tuple(y.shape) if isinstance(y, torch.Tensor) and y.is_floating_point() else None
    except Exception:   # noqa: BLE001
        return None


def _pick(rng: random.Random, pool: list[dict], rank: int) -> dict | None:
    ok = [e for e in pool if rank in e["ranks"]]
    kinds = sorted({e["kind"] for e in ok})
    if not kinds:
        return None
    kind = rng.choices(kinds, weights=[KIND_WEIGHTS.get(k, 0.25) for k in kinds])[0]
    return rng.choice([e for e in ok if e["kind"] == kind])


def compose_program(entries, rng: random.Random, preset: str, mix: list[float],
                    pointwise_only: bool = False) -> dict | None:
    """One candidate: {code, ops, spec, data_source}; None if no consistent chain was found."""
    lo, hi = PRESETS[preset][2:]
    k = rng.choices([1, 2, 3, 4, 5, 0], weights=mix)[0]          # 0 = standalone transformers layer
    tf = [e for e in entries if e["kind"] == "transformers"]
    if k == 0 and tf and not pointwise_only:
        pool, k = tf, 1
    else:
        k = max(k, 1)
        pool = [e for e in entries if e["kind"] != "transformers" and (e["pointwise"] or not pointwise_only)]
    ranks = [r for r in RANK_WEIGHTS if any(r in e["ranks"] for e in pool)]
    rank = 3 if pool is tf and 3 in ranks else rng.choices(ranks, weights=[RANK_WEIGHTS[r] for r in ranks])[0]
    shape0 = shape = start_shape(rank, rng, preset)
    chain = []
    for _ in range(k):
        for _attempt in range(30):
            e = _pick(rng, pool, len(shape))
            kw = instantiate(e, shape, rng) if e else None
            out = _meta_shape(e, kw, shape) if kw is not None else None
            if out and 2 <= len(out) <= 5 and lo // 16 <= math.prod(out) <= hi * 4:
                break
        else:
            return None
        chain.append((e, kw))
        shape = out
    src = "transformers" if pool is tf else f"torch#{k}"
    return {"code": emit_source(chain, shape0, src), "data_source": src,
            "ops": [_op_label(e) for e, _ in chain],
            "spec": [{"name": e["name"], "kind": e["kind"], "args": e.get("args", []), "kwargs": kw,
                      "index0": e.get("index0", False)} for e, kw in chain]}


def _op_label(e: dict) -> str:
    return "transformers." + e["name"].split(":")[1] if e["kind"] == "transformers" else e["name"]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def emit_source(chain: list, shape: tuple, data_source: str) -> str:
    """KernelBench-format source for a chain of (entry, kwargs) applied to one input of `shape`."""
    imports, init, fwd, params, consts, attrs = [], [], [], [], {}, set()
    for i, (e, kw) in enumerate(chain):
        if e["kind"] in ("module", "transformers"):
            cls = e["name"].split(":")[-1].split(".")[-1]
            if e["kind"] == "transformers":
                imports.append(f"from {e['name'].split(':')[0]} import {cls}")
            attr = _snake(cls) if _snake(cls) not in attrs else f"{_snake(cls)}_{i}"
            attrs.add(attr)
            flat = {**{k: v for k, v in kw.items() if k != "config"}, **kw.get("config", {})}
            names = {}
            for k, v in flat.items():
                if isinstance(v, str):
                    continue
                n = k if k not in consts else f"{k}_{i}"
                consts[n], names[k] = v, n
                params.append(n)
            if "config" in kw:
                ccls = e["config_cls"].split(":")[1]
                imports.append(f"from {e['config_cls'].split(':')[0]} import {ccls}")
                cargs = ", ".join(f"{k}={names[k]}" if k in names else f"{k}={v!r}" for k, v in kw["config"].items())
                ctor = f"{cls}({ccls}({cargs}))"
            else:
                ctor = f"{cls if e['kind'] == 'transformers' else 'nn.' + cls}(" + ", ".join(
                    f"{k}={names[k]}" for k in kw) + ")"
            init.append(f"        self.{attr} = {ctor}")
            fwd.append(f"        x = self.{attr}(x)")
        else:
            call_args = [repr(a) for a in e.get("args", [])] + [f"{k}={v!r}" for k, v in kw.items()]
            call = f"{e['name']}(" + ", ".join(["x"] + call_args) + ")" + ("[0]" if e.get("index0") else "")
            fwd.append(f"        x = {call}")
    dims = _DIM_NAMES[len(shape)]
    lines = ["import torch", "import torch.nn as nn", "import torch.nn.functional as F"] + sorted(set(imports))
    lines += ["", "", "class Model(nn.Module):",
              f'    """Synthesized task ({data_source}): ' + " -> ".join(_op_label(e) for e, _ in chain) + '."""',
              "", f"    def __init__(self{''.join(', ' + p for p in params)}):", "        super().__init__()"]
    lines += init + ["", "    def forward(self, x):"] + fwd + ["        return x", "", ""]
    lines += [f"{d} = {s}" for d, s in zip(dims, shape)] + [f"{k} = {v!r}" for k, v in consts.items()]
    lines += ["", "", "def get_inputs():", f"    return [torch.randn({', '.join(dims)})]", "", "",
              "def get_init_inputs():", f"    return [{', '.join(params)}]", ""]
    return "\n".join(lines)


LLM_PROMPT = """You write PyTorch reference modules for a GPU-kernel benchmark (KernelBench format).
Write ONE module that applies these operators in sequence, with consistent shapes: {ops}.
Reply with a single ```python code block containing: the imports, `class Model(nn.Module)` whose
__init__ takes the hyperparameters as arguments, `forward`, module-level size constants, `get_inputs()`
returning a list of CPU tensors of realistic size made with torch.randn, and `get_init_inputs()` returning
the __init__ arguments. No randomness in forward (no dropout), no in-place input mutation."""


def compose_llm(policy, entries, rngs: list[random.Random], mix: list[float]) -> list[dict | None]:
    """Paper §3.1's composer: the policy picks/stacks the sampled operators and writes the module."""
    torch_entries = [e for e in entries if e["kind"] != "transformers"]
    picks = []
    for rng in rngs:
        k = max(1, rng.choices([1, 2, 3, 4, 5, 0], weights=mix)[0])
        picks.append([_op_label(e) for e in rng.sample(torch_entries, k)])
    states = [EpisodeState(episode_id=i, messages=[{"role": "user", "content": LLM_PROMPT.format(ops=", ".join(p))}])
              for i, p in enumerate(picks)]
    out = []
    for p, act in zip(picks, policy.act(states)):
        m = re.search(r"```(?:python)?\n(.*?)```", act.text or act.content or "", re.S)
        out.append({"code": m.group(1), "ops": p, "spec": [], "data_source": f"torch#{len(p)}"} if m else None)
    return out




# --------------------------------------------------------------------------------------------------
# 3) the pipeline: compose all, filter (static here, execution in isolated children), write in order
# --------------------------------------------------------------------------------------------------


def _flags(cfg, default, prefix: str = "") -> list[str]:
    """`--flag value` for each field that differs from `default`; nested configs as `--sandbox.flag`."""
    parts = []
    for f in fields(cfg):
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        name = prefix + f.name.replace("_", "-")
        if is_dataclass(v):
            parts += _flags(v, d, name + ".")
        elif v != d:
            no = prefix + "no-" + f.name.replace("_", "-")
            parts.append(f"--{name}" if v is True else f"--{no}" if v is False else f"--{name} {v}")
    return parts


def _command(cfg: SynthConfig) -> str:
    """The CLI command that reproduces this run (non-default flags only)."""
    return " ".join(["python cuda_agent.py synth"] + _flags(cfg, SynthConfig()))


def _run_key(cfg: SynthConfig) -> str:
    """Hash of the settings that decide the output (resume refuses to mix runs with different ones)."""
    keep = ("seed", "scale", "min_ms", "max_ms", "mix", "pointwise_frac", "composer",
            "kernelbench_dir", "contamination_threshold", "use_transformers", "compile_backend", "timings", "calibrate")
    key = {k: getattr(cfg, k) for k in keep}
    key.update(model=cfg.policy.model, device=cfg.sandbox.device, atol=cfg.sandbox.atol, rtol=cfg.sandbox.rtol)
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers   # optional: only its version is recorded
        v["transformers"] = transformers.__version__
    except ImportError:
        v["transformers"] = None
    return v


def compose_all(cfg: SynthConfig, entries, preset: str) -> list[dict | None]:
    """Candidate i is composed from candidate_rng(seed, i) alone."""
    mix = parse_mix(cfg.mix)
    if cfg.composer == "llm":
        pol, out = make_policy(cfg.policy, device=cfg.sandbox.device, seed=cfg.seed), []
        for s in range(0, cfg.n_candidates, 32):
            out += compose_llm(pol, entries, [candidate_rng(cfg.seed, i)
                                              for i in range(s, min(s + 32, cfg.n_candidates))], mix)
        return out
    assert cfg.composer == "program", f"--composer must be program or llm, got {cfg.composer!r}"
    out = []
    for i in range(cfg.n_candidates):
        rng = candidate_rng(cfg.seed, i)
        out.append(compose_program(entries, rng, preset, mix, pointwise_only=rng.random() < cfg.pointwise_frac))
    return out


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _manifest(cfg: SynthConfig, progress: list[dict], rows: list[dict], window, preset, wall_s, cat) -> dict:
    rej = {f: 0 for f in ("compose",) + FILTERS}
    entered = {f: 0 for f in FILTERS}
    for p in progress:
        stop = p["filter"]
        if stop:
            rej[stop] = rej.get(stop, 0) + 1
        for f in FILTERS:
            if stop == "compose":
                break
            entered[f] += 1
            if f == stop:
                break
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["data_source"]] = counts.get(r["data_source"], 0) + 1
    return {"command": _command(cfg), "seed": cfg.seed, "config": asdict(cfg), "versions": _versions(),
            "device": cfg.sandbox.device, "scale": preset, "window_ms": list(window),
            "n_candidates": len(progress), "n_accepted": len(rows), "counts": dict(sorted(counts.items())),
            "rejections": rej, "filter_pass_rate": {f: round(1 - rej[f] / entered[f], 4) if entered[f] else None
                                                    for f in FILTERS},
            "wall_s_this_run": round(wall_s, 1),
            "catalogue": {k: v for k, v in cat.items() if k not in ("mined_names", "skipped_list")}}


def _record(cfg: SynthConfig, i: int, cand: dict | None, v: dict) -> tuple[dict, dict | None]:
    """(progress line, JSONL row or None) for candidate i with filter result v (which may carry a resized code)."""
    c = cand and {**cand, "code": v.get("code", cand["code"])}   # calibrated size
    rec = {"index": i, "ok": v["ok"], "filter": v.get("filter"), "reason": v.get("reason", ""),
           "data_source": c["data_source"] if c else None, "hash": source_hash(c["code"]) if c else None}
    if not v["ok"]:
        return rec, None
    row = {"index": i, "hash": rec["hash"], "data_source": c["data_source"], "ops": c["ops"],
           "device": cfg.sandbox.device, "seed": cfg.seed}
    if cfg.timings:
        row.update(eager_ms=round(v["eager_ms"], 4), compile_ms=round(v["compile_ms"], 4))
    if v.get("batch_factor"):
        row["batch_factor"] = v["batch_factor"]
    row.update(spec=c["spec"], code=c["code"])
    return rec, row


def main(cfg: SynthConfig) -> int:
    t0 = time.time()
    cfg = replace(cfg, sandbox=replace(cfg.sandbox, device=resolve_device(cfg.sandbox.device)))  # auto -> cpu|cuda
    sb = cfg.sandbox
    preset = sb.device.split(":")[0] if cfg.scale == "auto" else cfg.scale
    assert preset in PRESETS, f"--scale must be one of {sorted(PRESETS)} or auto, got {cfg.scale!r}"
    window = (cfg.min_ms if cfg.min_ms is not None else PRESETS[preset][0],
              cfg.max_ms if cfg.max_ms is not None else PRESETS[preset][1])
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    prog_path, man_path = cfg.out + ".progress.jsonl", cfg.out + ".manifest.json"
    entries, _ = mine_catalogue(cfg.use_transformers)
    cat = catalogue_report(cfg.use_transformers)
    with open(cfg.out + ".catalogue.json", "w") as f:
        json.dump(cat, f, indent=1)
    refs = kernelbench_refs(cfg.kernelbench_dir) if cfg.kernelbench_dir else None
    cands = compose_all(cfg, entries, preset)
    static = static_filters(cands, refs, cfg.contamination_threshold)

    key = _run_key(cfg)
    progress = _read_jsonl(prog_path) if cfg.resume else []
    if progress:
        assert progress[0].get("run_key") == key, \
            f"{prog_path} was made with other settings (seed/device/mix/...); pass --no-resume or another --out"
    progress = progress[1:]
    assert all(p["index"] == i for i, p in enumerate(progress)), f"{prog_path} is not a prefix; delete it"
    rows = _read_jsonl(cfg.out) if progress else []
    fout, fprog = open(cfg.out, "a" if progress else "w"), open(prog_path, "a" if progress else "w")
    if not progress:
        fprog.write(json.dumps({"run_key": key}) + "\n")
    print(f"[synth] {len(entries)} ops mined; {cfg.n_candidates} candidates ({len(progress)} done), "
          f"device {sb.device}, window {window} ms, {cfg.workers} workers")

    todo = [i for i in range(len(progress), cfg.n_candidates) if static[i] is None]
    chunks = [todo[s:s + cfg.chunk] for s in range(0, len(todo), cfg.chunk)]
    job = {"device": sb.device, "seed": cfg.seed, "min_ms": window[0], "max_ms": window[1],
           "backend": cfg.compile_backend, "warmup": sb.warmup, "iters": sb.iters, "calibrate": cfg.calibrate,
           "atol": sb.atol, "rtol": sb.rtol}
    results: dict[int, dict] = {}
    nxt = len(progress)

    def flush():   # write the finished prefix in candidate order (byte-identical output for a seed)
        nonlocal nxt
        while nxt < cfg.n_candidates and (static[nxt] is not None or nxt in results):
            if cfg.n_tasks is not None and len(rows) >= cfg.n_tasks:
                return
            rec, row = _record(cfg, nxt, cands[nxt], static[nxt] or results.pop(nxt))
            if row is not None:
                rows.append(row)
                fout.write(json.dumps(row) + "\n")
            fprog.write(json.dumps(rec) + "\n")
            progress.append(rec)
            nxt += 1
        fout.flush()
        fprog.flush()

    bar = tqdm(total=cfg.n_candidates, initial=len(progress), desc="synth", unit="cand") if cfg.progress else None
    flush()
    # --sandbox.ray-address: each chunk's run_chunk runs on a lane of the Ray cluster (no warm spares: synth's
    # children are its own), `workers` of them on each lane
    ray_pool = RayPool(replace(sb, warm_spares=0)) if sb.ray_address and chunks else None
    run = ray_pool.call if ray_pool else (lambda fn, *args: fn(*args))
    with ray_pool or contextlib.nullcontext(), \
            ThreadPoolExecutor(max(1, cfg.workers) * (len(ray_pool.lanes) if ray_pool else 1)) as ex:
        pending = {ex.submit(run, run_chunk, [cands[i]["code"] for i in ch], job, sb, cfg.timeout_s, cfg.workers): ch
                   for ch in chunks}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                ch = pending.pop(fut)
                results.update(zip(ch, fut.result()))
            before = nxt
            flush()
            if bar is not None:
                bar.update(nxt - before)
                bar.set_postfix(accepted=len(rows))
            if cfg.n_tasks is not None and len(rows) >= cfg.n_tasks:
                for f in pending:
                    f.cancel()
                break
    if bar is not None:
        bar.close()
    fout.close()
    fprog.close()
    man = _manifest(cfg, progress, rows, window, preset, time.time() - t0, cat)
    if cfg.demos_dir:
        man["demos"] = len(write_demos(rows, cfg.demos_dir))
    with open(man_path, "w") as f:
        json.dump(man, f, indent=1)
    print(f"[synth] accepted {len(rows)}/{len(progress)}; rejections {man['rejections']}; "
          f"counts {man['counts']} -> {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(SynthConfig()))
