"""The trusted side of a check: reference children (pristine task code), the reference pools a check draws
its seeds from, and the eager / `torch.compile` baselines (timed in interleaved rounds, cached, re-timed,
prewarmed). Nothing here runs candidate code.

Smoke: python -m pytest tests/test_sandbox.py -q -k "baseline or pool or prewarm"
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import threading
from typing import TYPE_CHECKING

import sandbox_measure
from sandbox_child import Child, isolation, new_jobdir, run_child, settle, visible_devices
from sandbox_spares import Spares, warm_spares
from workspace import TaskError, read_task

if TYPE_CHECKING:
    from sandbox import SandboxConfig


def precision_of(cfg: SandboxConfig) -> str:
    assert cfg.precision in ("fp32", "tf32", "auto"), f"precision must be fp32|tf32|auto, got {cfg.precision}"
    if cfg.device != "cuda":
        return "fp32"
    return ("tf32" if cfg.rtol >= 1e-3 else "fp32") if cfg.precision == "auto" else cfg.precision


BASELINE_TIMING = "fresh inputs, scrub, sketch"  # how baselines are timed (sandbox_measure.Timer); a cache entry
# timed any other way is timed again


_NAMES: dict = {}


def device_name(device: str, gpu: int | None) -> str:
    """Baseline-cache key part: "cpu", or the GPU's name from nvidia-smi (no CUDA init in the host)."""
    if device != "cuda":
        return "cpu"
    idx = (visible_devices(gpu) or "0").split(",")[0]
    if idx not in _NAMES:
        _NAMES[idx] = "cuda"
        with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", idx],
                                 capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            _NAMES[idx] = out[0]
    return _NAMES[idx]


_CACHE_LOCK = threading.Lock()


def baseline_cache(cfg: SandboxConfig, key: str, value: dict | None = None) -> dict | None:
    """Read (value=None) or write one entry of cache_dir/baselines.json (atomic replace)."""
    import torch
    path = os.path.join(os.path.expanduser(cfg.cache_dir), "baselines.json")
    key = f"{key}|torch {torch.__version__}"
    with _CACHE_LOCK:
        data = {}
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                data = json.load(f)
        if value is None:
            return data.get(key)
        data[key] = value
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{secrets.token_hex(4)}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    return value


REF_SPARES = Spares()  # warm reference children: torch, CUDA and torch.compile's modules already imported


def _inductor_env(inductor: str) -> dict:
    """torch.compile in a reference child: its own cache dir, and one compile thread. Inductor's default is a
    pool of worker processes, one per core, each importing torch; they count towards the child's RSS limit
    (the whole process tree), and on a 16-core host the pool alone took the 128-sine task over 8 GB."""
    return {"TORCHINDUCTOR_CACHE_DIR": inductor, "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def ref_spare(cfg: SandboxConfig, gpu) -> tuple:
    """(key, count, spawn) of the warm reference children of this config and device slot: two each, since
    a task's first check runs one and, when its candidate beats a baseline timed once, the re-timing runs
    another at once (in a cold child that re-timing cost ~10 s on an H200). Each holds a CUDA context."""
    inductor = os.path.join(os.path.expanduser(cfg.cache_dir), "inductor")

    def spawn() -> Child:
        os.makedirs(inductor, exist_ok=True)  # bound writable into the child: it must exist first
        return Child(new_jobdir(), device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, writable=(inductor,),
                     env=_inductor_env(inductor), warm_for="reference")
    return (cfg.device, gpu, cfg.mem_limit_mb, inductor, isolation()), min(2, warm_spares(cfg)), spawn


def run_reference(task_src: str, cfg: SandboxConfig, seeds: list[int], want_baselines: bool,
               gpu: int | None = None, warm: bool = False, sketch_seeds: dict | None = None) -> dict:
    """Run the reference child; returns its result dict or raises TaskError. `warm`: only compile (prewarm).
    `seeds` get full outputs, `sketch_seeds` ({seed: projection keys}) get sketches only."""
    inductor = os.path.join(os.path.expanduser(cfg.cache_dir), "inductor")
    os.makedirs(inductor, exist_ok=True)
    child = None if warm or warm_spares(cfg) == 0 else REF_SPARES.take(*ref_spare(cfg, gpu))[0]
    jobdir = child.jobdir if child else new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir, exist_ok=True)
        with open(os.path.join(wdir, "task.py"), "w") as f:
            f.write(task_src)
        job = {"kind": "reference", "task_path": os.path.join(wdir, "task.py"), "device": cfg.device,
               "seeds": seeds, "sketch_seeds": {str(s): k for s, k in (sketch_seeds or {}).items()},
               "timing_seed": secrets.randbelow(2**31), "init_seed": cfg.seed,
               "baselines": want_baselines, "precision": precision_of(cfg),
               "warmup": cfg.warmup, "iters": cfg.iters, "warm": warm}
        env = _inductor_env(inductor)
        outputs: dict = {}

        def on_msg(msg, control):  # outputs arrive one seed at a time
            if msg.get("type") == "ref_out":
                outputs[int(msg["seed"])] = msg["outs"]
        timeout = cfg.run_timeout_s + (cfg.compile_timeout_s if want_baselines or warm else 0)
        if want_baselines:  # timed: no earlier job's child may still be leaving the device
            settle(gpu)
        if child:
            r = child.run(job, timeout, on_msg, max_msg_mb=2 * cfg.mem_limit_mb + 256)
        else:
            r = run_child(job, jobdir, device=cfg.device, timeout_s=timeout, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu,
                          writable=(inductor,), env=env, on_msg=on_msg, max_msg_mb=2 * cfg.mem_limit_mb + 256)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if r.result is None:
        raise TaskError(f"reference run failed: {r.error}")
    if r.result.get("task_error"):
        raise TaskError(r.result["task_error"])
    # where a reference child's time went: its start-up stages before the job was handed over (a spare that
    # was ready) and the stages and phases after (one still starting, or a cold child)
    startup = {"before_job": child.startup if child else None, "after_job": r.phases()}
    return {**r.result, "outputs": outputs, "startup": startup}


def baseline_entry(res: dict, precision: str, device: str, old: dict | None = None) -> dict:
    """A cache entry from the child's rounds, merged with an earlier entry of the same task (re-timing).

    The baseline is the MINIMUM over every round median of every run: load on the machine only ever makes
    a measurement slower, so the minimum is the measurement least inflated by it."""
    b, old = res["baselines"], old or {}
    eager = old.get("eager_rounds", []) + b["eager"]
    comp = None if b.get("compile") is None else old.get("compile_rounds", []) + b["compile"]
    return {"eager_ms": min(eager), "eager_rounds": eager, "eager_cv": b["eager_cv"],
            "compile_ms": min(comp) if comp else None, "compile_rounds": comp or [],
            "compile_error": b.get("compile_error"), "runs": old.get("runs", 0) + 1,
            "spread": (max(eager) - min(eager)) / min(eager) if min(eager) > 0 else 0.0,
            # per round, the median host time until eager's forward returned (the rest: waiting for the device)
            "eager_launch": old.get("eager_launch", []) + b.get("eager_launch", []),
            "eager_launch_ms": min(old.get("eager_launch", []) + b.get("eager_launch", []), default=None),
            "precision": precision, "device": device, "timing": BASELINE_TIMING}


def baselines(task: str, cfg: SandboxConfig, gpu: int | None = None) -> dict:
    """{"eager_ms", "compile_ms", "precision", "device", rounds, runs} of the task; cached per (task, device,
    torch, precision)."""
    src = read_task(task)
    prec, dev = precision_of(cfg), device_name(cfg.device, gpu)
    key = f"{hashlib.sha256(src.encode()).hexdigest()}|{dev}|{prec}"
    hit = baseline_cache(cfg, key)
    if hit and hit.get("timing") == BASELINE_TIMING:
        return hit
    res = run_reference(src, cfg, [], True, gpu)  # no seeds: only the timings come back, not the outputs
    return baseline_cache(cfg, key, baseline_entry(res, prec, res["device_name"]))


def prewarm(tasks: list[str], cfg: SandboxConfig, workers: int = 8, gpus: list[int] | None = None,
            on_done=None) -> dict[str, str | None]:
    """Compile the `torch.compile` baseline of every task whose baselines are not cached yet, `workers` tasks
    at a time, so that the timed baseline run later finds inductor's FX-graph and Triton caches warm.

    Why: a cold inductor compile of one KernelBench problem takes 20-60 s of CPU, and it happens inside the
    timed reference run, which holds the GPU slot (timing never shares a GPU). Compiling needs no
    exclusivity, so it is done here for many tasks at once. Nothing is timed here and nothing is cached
    in baselines.json. **Never call it while anything is being timed on the same GPUs**: callers
    (kernelbench_eval, the trainer, the baseline bench) call it before their first check.
    Returns {sha256 of the task source: None | one-line error}; `on_done(sha, err)` is called per task.
    """
    todo, slots = {}, gpus or [None]
    dev, prec = device_name(cfg.device, slots[0]), precision_of(cfg)
    for t in tasks:
        src = read_task(t)
        h = hashlib.sha256(src.encode()).hexdigest()
        if cfg.profile and (baseline_cache(cfg, f"{h}|{dev}|{prec}") or {}).get("timing") != BASELINE_TIMING:
            todo[h] = src
    out: dict[str, str | None] = {}

    def one(i_h):
        i, h = i_h
        try:
            run_reference(todo[h], cfg, [], False, slots[i % len(slots)], warm=True)
            err = None
        except Exception as e:  # noqa: BLE001 - a failed prewarm only means the timed run compiles cold
            err = str(e) if isinstance(e, TaskError) else f"{type(e).__name__}: {e}"
        if on_done:
            on_done(h, err)
        return h, err
    if todo:
        with cf.ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
            out.update(ex.map(one, enumerate(todo)))
    return out


REF_POOL_EXTRA = 4      # a reference pool holds n_trials + this many trial seeds, warmup + iters + this many
REF_POOL_MAX_USES = 50  # timing seeds; checks served by one pool before it is recomputed (0: fresh each check)
REF_POOL_MAX_MB = 2048  # pools whose outputs are larger than this are not kept (KernelBench L1: up to ~60 GB)
REF_POOL_TOTAL_MB = 8192  # host RAM for all kept pools; the oldest are dropped beyond it
_REF_POOLS: dict = {}
_REF_LOCK = threading.Lock()


def reference_pool(src: str, cfg: SandboxConfig, want_baselines: bool, gpu, dev: str) -> tuple[dict, list]:
    """Reference results for one check and the check's request plan.

    The pool holds full outputs for n_trials + EXTRA trial seeds and sketches for warmup + iters + EXTRA
    timing seeds, each timing seed with its own projection keys; each check uses a random subset of the
    trial seeds and the timing seeds in random order, no seed twice. Seeds and keys come from the host's
    private RNG and reach the candidate one at a time, each only when it is used. Reusing a pool across
    checks is safe because a candidate child never sees a reference output and keeps no state between
    checks (its job dir is deleted; the cache is hidden).
    """
    key = (hashlib.sha256(src.encode()).hexdigest(), cfg.device, dev, cfg.seed, cfg.n_trials, cfg.warmup, cfg.iters,
           cfg.profile)  # a verify-only pool has no sketches
    n_time = cfg.warmup + max(cfg.iters, 1)
    with _REF_LOCK:
        entry = _REF_POOLS.get(key)
        if entry and entry["uses"] < REF_POOL_MAX_USES and not want_baselines:
            entry["uses"] += 1
            ref = entry["ref"]
        else:
            ref = None
    rng = secrets.SystemRandom()
    if ref is None:
        seeds = rng.sample(range(2**31), cfg.n_trials + n_time + 2 * REF_POOL_EXTRA)
        trial_seeds, time_seeds = seeds[:cfg.n_trials + REF_POOL_EXTRA], seeds[cfg.n_trials + REF_POOL_EXTRA:]
        keys = {s: [rng.randrange(2**62) for _ in range(sandbox_measure.SKETCH_KEYS)] for s in time_seeds}
        ref = run_reference(src, cfg, trial_seeds, want_baselines, gpu, sketch_seeds=keys if cfg.profile else None)
        ref["keys"] = keys if cfg.profile else {}
        mb = sum(t.numel() * t.element_size() for outs in ref["outputs"].values() for t in outs) / 2**20
        if REF_POOL_MAX_USES > 0 and mb <= REF_POOL_MAX_MB:
            with _REF_LOCK:
                kept = {k: v for k, v in ref.items() if k not in ("baselines", "phase_s")}  # phase_s: this run's
                _REF_POOLS[key] = {"ref": kept, "uses": 1, "mb": mb}
                while len(_REF_POOLS) > 1 and sum(e["mb"] for e in _REF_POOLS.values()) > REF_POOL_TOTAL_MB:
                    _REF_POOLS.pop(next(iter(_REF_POOLS)))
    plan = [{"op": "trial", "seed": s} for s in rng.sample(sorted(ref["outputs"]), cfg.n_trials)] + [{"op": "ops"}]
    if cfg.profile:  # every timed call, warm-ups included, on fresh inputs and checked by its sketch
        plan += [{"op": "time", "seed": s} for s in rng.sample(sorted(ref["sketches"]), n_time)]
    return ref, plan + [{"op": "done"}]


def retime(src: str, cfg: SandboxConfig, gpu, key: str, base: dict) -> dict:
    """Time the baselines again in a new reference child and merge the rounds into the cached entry."""
    res = run_reference(src, cfg, [], True, gpu)
    return baseline_cache(cfg, key, baseline_entry(res, base["precision"], base["device"], old=base))
