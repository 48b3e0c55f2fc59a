"""The sandbox: isolated compile -> verify -> profile of a candidate kernel, and its verdict.

Every reward in training and every number in evaluation comes from `check()`. The host (this file) never
imports candidate code: each compile, reference run and candidate run is its own child process
(`python sandbox_worker.py JOBFILE`) inside bubblewrap, and the host compares the candidate's outputs
with reference outputs that only the host holds. Candidate children are started ahead of time (warm
spares: torch imported, CUDA up) and each serves exactly one candidate; so do two reference children per
GPU (torch.compile's modules imported too) and two load_inline build children (torch's extension builder
imported). Files: this one (what runs, the verdict), sandbox_child.py (isolation, the child and its
channel), sandbox_spares.py (the warm children), sandbox_build.py (kernel compiles, load_inline builds, the
dispatch guard's build), sandbox_reference.py (reference children, seed pools, baselines), sandbox_rules.py
(static scan, comparison, timing); inside the child: sandbox_worker.py (the jobs, the dispatch guard, the runtime
helpers), sandbox_measure.py (inputs, sketches, the baseline timer), sandbox_wire.py (the result channel),
sandbox_inline.py and sandbox_guard.cpp; workspace.py (reading untrusted files, validating task and solution
files).

Threat model. COVERED:
  * Isolation per job: bwrap (`--unshare-all`: no network, own pid/ipc/uts namespaces; `/` read-only,
    private /tmp and /dev/shm, only the job's own dir writable). Compile and candidate children do not see
    the cache dir, the repository or the workspace's parent (other episodes); the worker script is bound in
    at a private path. Fallbacks: `unshare --net` (no filesystem isolation), then rlimits only; the level
    used is in `Verdict.timings["isolation"]`.
  * Limits: wall clock (process tree SIGKILLed), memory (RSS of the tree polled; cpu children also get
    RLIMIT_AS; cuda children an allocator fraction), RLIMIT_CORE/FSIZE/NPROC; per workspace at most
    `max_kernels` kernels and `compile_budget_s` of compiling. Every candidate failure is a verdict.
  * Workspace files: the host lstat()s before it reads, hashes or copies (workspace.py); symlinks, FIFOs,
    devices and sockets are refused with a verdict error; reads are capped; nothing is followed. The
    compile cache key covers every file the compiler sees: kernels/, recursively, minus the other
    kernels' own sources (which are not copied into the compile).
  * Every call is checked. The job file and environment hold no seed, count or plan: the host sends each
    request (a trial or a timed call, with its one seed) only after the previous one is answered (after a
    timed call, together with that call's sketch keys; after a trial, before that trial is compared). Every
    timed call, warm-ups included, runs on fresh inputs under the dispatch guard, and its output is checked
    against the reference by random projections whose keys are sent only after the call returned
    (`sketch_close`): computing only on some calls, recognising inputs or caching by pointer or content
    gains nothing. Trials are compared in full: allclose AND relative L2 <= rtol, exact type, shape,
    dtype and device, finite where the reference is, inputs unmodified.
  * No torch compute: (1) the dispatch guard (sandbox_guard.cpp: a C++ dispatcher fallback that sees every
    dispatched op, from Python or C++) on every forward, and on import and `__init__` with an init
    allow-list (creation, init, scaling: nothing computed before the first input can be an answer);
    (2) the profiler's aten list, re-checked on the host; (3) a static scan (sandbox_rules.py) that also
    refuses frame, traceback and gc introspection, raw-memory ctypes, and patches of torch, numpy, clocks
    or the harness.
  * Host memory: messages are JSON with tensors as raw frames (nothing is unpickled), or, for a trial's
    outputs, at offsets in a memfd the host created and sealed against shrinking (so the child cannot make
    the host's reads fault) and bounds-checks every offset in; the host compares each reply as it arrives,
    a chunk at a time (on the check's GPU when it can: `compare_on`), and keeps none of its tensors; a
    message over 2 x the reference output (+16 MB) is refused from its header.
    Reference children send one seed's outputs per message, so a child holds about one output on the host.
  * Timing: clocks and the torch functions of the checks bound before candidate import; a device-wide
    sync around every timed call; NaN-filled free memory and an L2 flush before each; the child's clock
    must agree with the host's over the same spans. Baselines: eager and compiled in interleaved rounds,
    the minimum round median kept (the candidate's timed calls likewise, in as many rounds), re-timed in a
    new child before a speedup tier is awarded on a baseline from a single run (`Verdict.timings["baseline"]`,
    `["baseline_retimed"]`). Eager is timed again in each candidate's child before any candidate code is
    imported, and the candidate compared with that (`eager_beside`): the host's speed drifts over seconds.
  * No state survives a check: one candidate per process (a warm spare is killed once its result is in,
    and nothing is timed on its GPU until it has exited: `settle`), job dirs are deleted, the cache is
    hidden, and a load_inline source is built once by a child that sees no input; checked runs get a
    private copy of that build dir.
NOT COVERED (known gaps):
  * Native code in the candidate's process can do anything that process can: read its memory (the current
    request's seed and inputs), unregister the guard, disable the profiler, forge result messages or
    report made-up times (bounded by the host's wall clock of the same spans). The Python-level versions
    of these are refused statically or undone (module patches reverted after import and every call).
  * No seccomp, no cgroup (a fast allocation burst can overshoot the RSS poll), no disk quota beyond
    RLIMIT_FSIZE, GPU memory capped only by the allocator fraction (cudaMalloc from C++ bypasses it), no
    per-job GPU isolation besides CUDA_VISIBLE_DEVICES.
  * Reads: `/` is read-only but visible; anything this user can read outside the hidden dirs, a candidate
    can read. The child's environment is a whitelist (PASS_ENV). Fallback levels hide nothing.
  * The static scan cannot see arithmetic operators on tensors (x * 2); the dynamic layers do.
  * A timed call whose output is wrong by less than about 16 x rtol of its norm in a random direction
    can pass one projection; three keys make a wholly wrong output pass with probability ~2e-4.

Departures from the paper:
  1. The paper's sandbox is not public; this follows KernelBench's and other public harnesses' known hacks.
  2. Kernels (form b) compile per file to plain shared objects via ctypes (no torch headers), so an edit
     rebuilds one kernel in ~1 s instead of `load_inline`'s ~47 s. Form (a) `load_inline` sources build
     against a slim stand-in for <torch/extension.h> first (sandbox_inline.SLIM_TORCH_H; ~17 s on an H200
     host), against torch's own headers when that fails; the verdict is the same either way.
  3. Reference outputs are always strict fp32; `precision` only affects the timed baselines/candidate.
  4. One reference child serves up to REF_POOL_MAX_USES checks of a task: it computes outputs (trials) and
     sketches (timed calls) for a pool of host-random seeds, and each check draws its own subset. Safe
     because a candidate never sees reference outputs and keeps no state between checks; it halves the
     processes per check. Set REF_POOL_MAX_USES = 0 for a fresh reference every check.

Smoke: python -m pytest tests/test_sandbox.py -q -x
Full (H200): python -m pytest tests/test_sandbox.py tests/test_sandbox_gpu.py -q
             python scripts/bench_sandbox.py --device cuda --out $OUT/bench_sandbox.json
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field

import sandbox_worker
import workspace
from sandbox_build import (build_inline, bytecode_cache, compile_workspace, copy_build, guard_library,  # noqa: F401
                           trim_log)
from sandbox_child import (HARNESS_DIR, Child, ChildResult, SandboxError, bwrap_argv, hidden,  # noqa: F401
                           hidden_candidate, interruptible, isolation, last_line, new_jobdir, require_device,
                           run_child, settle)
from sandbox_reference import (BASELINE_TIMING, REF_SPARES, ref_spare, baseline_cache, baseline_entry,  # noqa: F401
                               baselines, device_name, precision_of, prewarm, reference_pool, retime, run_reference)
from sandbox_rules import compare, sketch_close, static_scan, timing
from sandbox_spares import Spares, warm_spares  # noqa: F401
from workspace import TaskError, WorkspaceError, looks_like_path, python_error, read_file, read_task  # noqa: F401



_ALLOWED_OPS = sandbox_worker.ALLOWED_OPS  # the host's own copy: a candidate cannot widen it


@dataclass
class SandboxConfig:
    device: str = "cpu"
    """where candidates run: "cpu" | "cuda" """
    atol: float = 1e-2
    """absolute tolerance of torch.allclose (paper: 1e-2)"""
    rtol: float = 1e-2
    """relative tolerance of allclose, and bound on the relative L2 error ||y - y_ref|| / ||y_ref||"""
    n_trials: int = 5
    """correctness trials, fresh seeded inputs each"""
    precision: str = "auto"
    """"fp32" | "tf32" | "auto" (tf32 for baselines AND candidate iff rtol >= 1e-3; cpu: always fp32)"""
    warmup: int = 5
    """untimed warm-up iterations before timing"""
    iters: int = 50
    """timed iterations (median reported)"""
    compile_timeout_s: float = 120
    """wall-clock limit per kernel compile (and for load_inline builds in form (a))"""
    run_timeout_s: float = 300
    """wall-clock limit per reference/candidate child"""
    mem_limit_mb: int = 8192
    """host-memory limit per child: RSS of its process tree, polled (cpu children also get RLIMIT_AS of this
    + 4 GB). It does not cover GPU memory: a cuda child may use 90% of its GPU (allocator fraction). Reference
    outputs stream to the host one seed at a time, so a child holds about one output on the host"""
    cache_dir: str = field(default_factory=lambda: os.environ.get("CUDA_AGENT_CACHE", "~/.cache/cuda_agent"))
    """compile cache + baseline cache (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda_agent)"""
    profile: bool = True
    """False -> stop after verify (no timing; reward uses correctness only)"""
    seed: int = 0
    """base seed (trial seeds are salted per job so a candidate cannot precompute)"""
    static_scan: bool = True
    """the static layer of the no-torch rule (imports, calls, harness introspection); the tests switch it
    off to prove that each dynamic layer catches its hack on its own"""
    allow_imports: str = ""
    """extra modules a candidate may import, comma-separated (default none: kernels must be its own; the
    adversarial tests widen it to use numpy as a stand-in kernel and reach the dynamic layers)"""
    max_kernels: int = 16
    """kernel sources one workspace may hold (more is an error verdict, not a queue of compiles)"""
    compile_budget_s: float = 300
    """wall-clock budget shared by all compiles of one workspace (each is also capped by compile_timeout_s)"""
    compare_on: str = "auto"
    """where the host compares trial outputs with the reference: "auto" (the check's GPU when this process
    can use CUDA: a CUDA context there, ~0.5 GB; a 64 MB output compares in ms, not ~0.1-0.5 s) | "cpu" """
    eager_beside: bool = True
    """time eager in each candidate's own child, just before the candidate is imported, and compare the
    candidate with that (same process, same minute); False: with the eager baseline cached per task. The
    compile baseline is always the cached one (compiling in every child would cost its compile)"""
    warm_spares: int = -1
    """pre-started candidate children kept per device (torch imported, CUDA up, checks warmed); each serves
    one candidate and is replaced in the background. 0 = start a child per check; -1 = 12 on cuda, 0 on cpu
    (a spare's start-up would share the cores with a check being timed). Form (a) runs in a new child"""


@dataclass
class Verdict:
    compiled: bool = False
    correct: bool = False
    violation: str | None = None
    error: str | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    candidate_ms: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    stage: str = "load"
    precision: str = "fp32"
    device: str = "cpu"
    compile_log: str = ""
    trials: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TASK_OK: set[str] = set()


def load_task(src_or_path: str, device: str = "cpu", timeout_s: float = 300) -> str:
    """Validate a task in an isolated child (import, names, tensor inputs, one forward on `device`);
    returns its source; raises TaskError("one line")."""
    require_device(device)
    src = read_task(src_or_path)
    h = hashlib.sha256(f"{device}|{src}".encode()).hexdigest()
    if h not in _TASK_OK:
        run_reference(src, SandboxConfig(device=device, run_timeout_s=timeout_s), [0], False)
        _TASK_OK.add(h)
    return src


# ----------------------------------------------------------------------------- check
def check(task: str, solution: str, cfg: SandboxConfig, gpu: int | None = None) -> Verdict:
    """Compile, verify and profile `solution` against `task`. Never raises for candidate problems;
    raises TaskError for a malformed task. `gpu` pins the child to one GPU (the pool sets it)."""
    return _check(task, solution, cfg, contextlib.nullcontext, lambda: contextlib.nullcontext(gpu))


def _solution(solution: str) -> tuple[str, str]:
    """("b", workspace) | ("a", source) | ("refused", one line: a missing path, a directory that is not a
    workspace, a file that is not a regular file of UTF-8 text or is larger than workspace.FILE_CAP)."""
    if not looks_like_path(solution):
        return "a", solution
    if os.path.isdir(solution):
        return "b", solution
    if not os.path.lexists(solution):
        return "refused", f"solution not found: {solution}"
    try:
        return "a", read_file(solution, "solution", ValueError)
    except ValueError as e:
        return "refused", str(e)


def _check(task, solution, cfg, compile_gate, device_gate) -> Verdict:
    require_device(cfg.device)
    guard_library(cfg)  # built once per torch; every candidate child loads it
    bytecode_cache(cfg)  # filled once per Python and torch; every child imports from it
    src = read_task(task)
    v = Verdict(precision=precision_of(cfg), device=cfg.device, timings={"isolation": isolation()})
    try:
        _run_check(src, solution, cfg, v, compile_gate, device_gate)
    except (TaskError, SandboxError):
        raise
    except Exception as e:  # noqa: BLE001 - a host bug must still become a verdict, never a crash
        v.error = f"sandbox internal error: {type(e).__name__}: {e}"[:400]
        v.correct = False
    if v.error or v.violation:
        v.correct = False
    return v


def _prepare(form: str, sol, cfg: SandboxConfig, v: Verdict, compile_gate, wdir: str) -> str | None:
    """Compile (form b) and copy the candidate into wdir; returns the candidate path, or None on failure.
    The workspace is read only through `workspace` (no link followed, no special file opened, capped)."""
    if form == "refused":
        v.error = sol
        return None
    if form == "b":
        try:
            files = workspace.walk(sol)
            bad = next(filter(None, (python_error(workspace.read_text(os.path.join(sol, f)), f,
                                                  ("ModelNew",) if f == "model_new.py" else ())
                                     for f in files if f.endswith(".py") and "/" not in f and f != "model.py")), None)
        except WorkspaceError as e:  # a link, FIFO, device or socket: the candidate's doing, one line
            v.error = str(e)
            return None
        if "model_new.py" not in files:
            v.error = "workspace has no model_new.py"
            return None
        if bad:  # a syntax error answers in milliseconds, before any compile or child
            v.error = bad
            return None
        v.stage = "compile"
        with compile_gate():
            ok, v.compile_log, sos = compile_workspace(sol, cfg)
        if not ok:
            v.error = "compile failed: " + (last_line(v.compile_log.split("\n")[0]) or "see compile_log")
            return None
        try:
            copied = workspace.copy_tree(sol, wdir, ignore_suffixes=(".so",))
        except WorkspaceError as e:
            v.error = str(e)
            return None
        os.makedirs(os.path.join(wdir, "kernels"), exist_ok=True)
        for name, so in sos.items():
            shutil.copy(so, os.path.join(wdir, "kernels", f"{name}.so"))
        sources = [os.path.join(wdir, f) for f in copied if f.endswith(".py") and "/" not in f and f != "model.py"]
        path = os.path.join(wdir, "model_new.py")
    else:
        v.error = python_error(sol, "solution", ("ModelNew",))
        if v.error:
            return None
        path = os.path.join(wdir, "solution.py")
        with open(path, "w") as f:
            f.write(sol)
        sources = [path]
    v.compiled = True
    extra = tuple(m.strip() for m in cfg.allow_imports.split(",") if m.strip())
    for p in sources:
        text = workspace.read_text(p)  # the host's own copy, still read capped
        v.violation = v.violation or (static_scan(text, extra) if cfg.static_scan else None)
    if v.violation:
        v.stage = "verify"
        return None
    if form == "a":  # load_inline: built once per source by a child that sees no input; a private copy runs
        v.stage = "compile"
        t_build = time.perf_counter()
        with compile_gate():
            ext, err = build_inline(path, wdir, cfg)
        v.timings["build_s"] = round(time.perf_counter() - t_build, 3)  # ~0 when this source was built before
        if err:
            v.compiled, v.compile_log = False, trim_log(err, False)
            v.error = "compile failed: " + (last_line(v.compile_log.split("\n")[0]) or "see compile_log")
            return None
        try:
            copy_build(ext, os.path.join(wdir, "ext"))
        except WorkspaceError as e:  # the cold path's build dir (candidate code wrote it at import)
            v.compiled, v.error = False, f"compile failed: load_inline build dir refused: {e}"[:400]
            return None
    return path


def _run_check(src: str, solution: str, cfg: SandboxConfig, v: Verdict, compile_gate, device_gate):
    form, sol = _solution(solution)
    jobdir = new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir)
        with open(os.path.join(wdir, "task.py"), "w") as f:
            f.write(src)
        t_prep = time.perf_counter()
        cand = _prepare(form, sol, cfg, v, compile_gate, wdir)
        v.timings["prepare_s"] = round(time.perf_counter() - t_prep, 3)  # reads, compile or cache hit, scan
        if cand is None:
            return
        with device_gate() as gpu:
            dev = device_name(cfg.device, gpu)
            key = f"{hashlib.sha256(src.encode()).hexdigest()}|{dev}|{v.precision}"
            base = baseline_cache(cfg, key) if cfg.profile else None
            base = base if base and base.get("timing") == BASELINE_TIMING else None  # older entries: re-timed
            if warm_spares(cfg) > 0:  # spares start while the reference runs (first check)
                _SPARES.fill(*_spare_kind(cfg, gpu, hidden_candidate(cfg, sol if form == "b" else None)))
            t_ref = time.perf_counter()
            ref, plan = reference_pool(src, cfg, cfg.profile and base is None, gpu, dev)
            t_cand = time.perf_counter()
            v.device = ref["device_name"]
            if "phase_s" in ref:  # this check ran the reference child (not a pooled one)
                v.timings["reference_phases"] = ref["phase_s"]
                v.timings["reference_startup"] = ref.get("startup")  # a spare's start-up, when it was one
            if cfg.profile and base is None:
                base = baseline_cache(cfg, key, baseline_entry(ref, v.precision, v.device))
            import torch
            torch.save(ref["state_dict"], os.path.join(wdir, "state_dict.pt"))
            r, seen = _run_candidate(form, cand, wdir, jobdir, ref, plan, cfg, gpu, sol if form == "b" else None)
            v.timings.update({"reference_s": round(t_cand - t_ref, 3),  # where a check's time goes
                              "candidate_s": round(time.perf_counter() - t_cand, 3)})
            _judge(r, seen, ref, cfg, v, form)
            if v.correct and cfg.profile:
                timing(seen, base, v, cfg, lambda: retime(src, cfg, gpu, key, base))
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)




_SPARES = Spares()  # candidate children


def start_spares(cfg: SandboxConfig, gpus: list) -> None:
    """Start every device slot's warm children now, in the background (candidate spares and a reference
    child), so that even the first check of a trainer or an evaluation finds them ready."""
    if warm_spares(cfg) > 0:
        guard_library(cfg)  # what a spare binds at its start
        bytecode_cache(cfg)
        for gpu in gpus:
            _SPARES.fill(*_spare_kind(cfg, gpu, hidden_candidate(cfg)))
            REF_SPARES.fill(*ref_spare(cfg, gpu))


def _spare_kind(cfg, gpu, hide) -> tuple:
    """(key, count, spawn) of the warm spares a candidate of this check can use."""
    return ((cfg.device, gpu, cfg.mem_limit_mb, hide, isolation()), warm_spares(cfg),
            lambda: Child(new_jobdir(), device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, hide=hide))


def _run_candidate(form, cand, wdir, jobdir, ref, plan, cfg, gpu, ws) -> tuple[ChildResult, dict]:
    """Run the candidate child and drive it through `plan`, comparing each reply as it arrives.

    Returns the child's result and what the host saw: per-trial comparisons, the profiler's op list, and
    per timed call the child's time, the host's wall time of the same span and the sketch comparison."""
    timeout = cfg.run_timeout_s + (cfg.compile_timeout_s if form == "a" else 0)  # load_inline args that differ
    # from the build's build again in the candidate child
    child, warm, hide, spares = None, False, hidden_candidate(cfg, ws), warm_spares(cfg)
    if spares > 0:  # a warm child: move the prepared files into its own job dir
        child, warm = _SPARES.take(*_spare_kind(cfg, gpu, hide))
        for name in os.listdir(wdir):
            if name != "job.json":
                os.rename(os.path.join(wdir, name), os.path.join(child.wdir, name))
        cand, wdir = os.path.join(child.wdir, os.path.relpath(cand, wdir)), child.wdir
    kernels = {}
    if os.path.isdir(os.path.join(wdir, "kernels")):
        kernels = {f[:-3]: os.path.join(wdir, "kernels", f) for f in os.listdir(os.path.join(wdir, "kernels"))
                   if f.endswith(".so")}
    # No seed, count or plan in the job: the host sends each request when the previous one is answered.
    job = {"kind": "candidate", "task_path": os.path.join(wdir, "task.py"), "cand_path": cand, "cand_dir": wdir,
           "device": cfg.device, "init_seed": cfg.seed, "kernels": kernels,
           "state_dict_path": os.path.join(wdir, "state_dict.pt"), "precision": precision_of(cfg),
           "ext_dir": os.path.join(wdir, "ext") if form == "a" else None,
           "eager_beside": cfg.profile and cfg.eager_beside}
    seen = {"trials": [], "ops": None, "calls": [], "bad": None, "i": 0, "sent_at": 0.0, "warm_child": warm}
    out_bytes = sum(t.numel() * t.element_size() for t in next(iter(ref["outputs"].values())))

    def send(control, obj):
        with contextlib.suppress(OSError, ValueError):
            seen["sent_at"] = time.monotonic()
            control.write(json.dumps(obj) + "\n")
            control.flush()

    def advance(control, **extra):  # the next request; "done" at once after the first failure
        req = plan[seen["i"]] if seen["bad"] is None and seen["i"] < len(plan) else {"op": "done"}
        if req["op"] == "time" and not seen.get("settled"):  # the previous job's child has left the device
            settle(gpu)
            seen["settled"] = True
            seen["spares_starting"] = _SPARES.starting() + REF_SPARES.starting()  # start-ups beside the timing
        seen["i"] += 1
        seen["req"] = req
        send(control, {**extra, "next": req} if extra else req)

    on_gpu = compare_device(cfg, gpu)

    def on_msg(msg, control):
        t, req = msg.get("type"), seen.get("req") or {}
        try:
            if t == "stage" and msg.get("stage") == "load" and job["eager_beside"] and "eager_sent" not in seen:
                settle(gpu)  # the previous job's child has left the device before eager is timed here
                seen["eager_sent"] = True
                # a timing seed unrelated to the checked ones; eager's rounds as the baselines' (time_baselines)
                send(control, {"op": "eager", "timing_seed": secrets.randbelow(2**31), "warmup": cfg.warmup,
                               "iters": cfg.iters})
            elif t == "eager" and seen.get("eager_sent") and "eager" not in seen and "req" not in seen:
                seen["eager"] = {k: msg.get(k) for k in ("eager", "eager_launch", "eager_cv", "error")}
            elif t == "stage" and msg.get("stage") == "verify":
                advance(control)
            elif t == "trial" and req.get("op") == "trial":
                waited = time.monotonic() - seen["sent_at"]  # the child's trial: inputs, forward, copy, pipe
                advance(control)  # the child runs the next trial while this one is compared
                t0 = time.monotonic()
                res = _compare_kind(ref, req["seed"], msg, cfg, on_gpu)
                seen["trials"].append({"trial": len(seen["trials"]), **res, "child_s": round(waited, 4),
                                       "compare_s": round(time.monotonic() - t0, 4)})
                seen["bad"] = seen["bad"] or (None if res["ok"] else f"trial {len(seen['trials']) - 1}")
            elif t == "ops" and req.get("op") == "ops":
                seen["ops"] = list(msg.get("ops", []))
                advance(control)
            elif t == "iter" and req.get("op") == "time":
                seen["calls"].append({"ms": float(msg["ms"]), "launch_ms": float(msg.get("launch_ms", 0.0)),
                                      "cpu": int(msg.get("cpu", -1)),
                                      "span_ms": float(msg["span_ms"]),
                                      "host_ms": (time.monotonic() - seen["sent_at"]) * 1e3, "kind": msg.get("kind")})
                seen["sketch_seed"] = req["seed"]
                advance(control, keys=ref["keys"][req["seed"]])  # the keys only now, after the call returned
            elif t == "sketch" and "sketch_seed" in seen:
                seen["sent_at"] = time.monotonic()  # the next call's span starts once the child has sketched
                call = seen["calls"][-1]
                call["ok"], call["reason"] = sketch_close(msg["sketch"], ref["sketches"][seen.pop("sketch_seed")], cfg)
                if call["kind"] != ref["out_kind"]:
                    call["ok"], call["reason"] = False, f"returned a {call['kind']}, expected a {ref['out_kind']}"
                seen["bad"] = seen["bad"] or (None if call["ok"] else f"timed call {len(seen['calls']) - 1}")
            elif t != "stage" and t != "result":
                seen["bad"] = seen["bad"] or f"unexpected message {t!r} for request {req.get('op')!r}"
                send(control, {"op": "done"})
        except Exception as e:  # noqa: BLE001 - a malformed reply fails the candidate, never the host
            seen["bad"] = seen["bad"] or f"malformed {t!r} message ({type(e).__name__}: {e})"[:300]
            send(control, {"op": "done"})
    if child is None:
        r = run_child(job, jobdir, device=cfg.device, timeout_s=timeout, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu,
                      hide=hide, on_msg=on_msg,
                      max_msg_mb=(2 * out_bytes >> 20) + 16, shm_bytes=_shm_bytes(out_bytes, cfg))
        return r, seen
    try:
        return child.run(job, timeout, on_msg, max_msg_mb=(2 * out_bytes >> 20) + 16,
                         shm_bytes=_shm_bytes(out_bytes, cfg)), seen
    finally:
        shutil.rmtree(child.jobdir, ignore_errors=True)


def _shm_bytes(out_bytes: int, cfg: SandboxConfig) -> int:
    """The shared output buffer of a candidate child: two halves, each one trial's outputs (+ alignment), used
    in turn, so the child writes trial k+1 while the host still compares trial k. A trial's outputs travel
    through it instead of the pipe (a 64 MB output: ~1 ms device-to-host into the registered buffer, against
    ~60 ms to pageable memory and ~40 ms through the pipe on an H200 host; docs/RESULTS.md). Its pages count
    in the child's RSS, so outputs over 1/8 of the memory limit take the pipe, one trial at a time."""
    return 2 * (out_bytes + 64 * 64 + (1 << 20)) if out_bytes <= (cfg.mem_limit_mb << 20) // 8 else 0


def _compare_kind(ref: dict, seed: int, msg: dict, cfg: SandboxConfig, work_device: str = "cpu") -> dict:
    if msg.get("kind") != ref["out_kind"]:
        return {"ok": False, "reason": f"returned a {msg.get('kind')}, the reference returns a {ref['out_kind']}"}
    return compare(ref["outputs"][seed], msg["outs"], msg.get("devices"), cfg.device, cfg.atol, cfg.rtol,
                   work_device)


def compare_device(cfg: SandboxConfig, gpu: int | None) -> str:
    """Where the host compares a trial's outputs: the check's GPU when this process can use CUDA (both
    outputs are copied there a chunk at a time), else host memory. The comparison's arithmetic is the same."""
    if cfg.device != "cuda" or cfg.compare_on == "cpu":
        return "cpu"
    import torch
    return f"cuda:{gpu or 0}" if torch.cuda.is_available() else "cpu"


def _judge(r: ChildResult, seen: dict, ref: dict, cfg, v: Verdict, form: str):
    """Turn what the host saw into the verdict: errors, violations, trials, every timed call's check."""
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("USDT:"))  # profiler noise
    v.timings["candidate_phases"] = r.phases()  # e.g. verify_at_s: torch import + CUDA init + candidate load
    v.timings["warm_child"] = seen.get("warm_child", False)  # a spare started before this check
    v.timings["spares_starting"] = seen.get("spares_starting")  # children starting when the timed calls began
    v.timings["log"] = (err[-1500:] + ("\n[stdout]\n" + r.stdout[-500:] if r.stdout.strip() else "")).strip()
    v.trials = seen["trials"]
    if r.result is None:
        v.stage, v.error = r.stage or "load", f"candidate {r.error}"
        return
    res = r.result
    stage = res.get("stage", "load")
    v.stage = "profile" if seen["calls"] else ("verify" if stage == "done" else stage)
    if form == "a" and "Error building extension" in (res.get("error") or "") + r.stderr:
        v.compiled, v.compile_log = False, trim_log(r.stderr, False)
    if res.get("error") or res.get("violation"):
        v.error, v.violation = res.get("error"), res.get("violation")
        return
    ops = res.get("profiler_ops") or seen["ops"] or []
    bad = [n for n in ops if n[6:] not in _ALLOWED_OPS]  # the host's own allow-list
    if bad:
        v.violation = f"aten op {bad[0]} seen by the profiler inside forward"
        return
    failed = next((t for t in v.trials if not t["ok"]), None)
    if failed or len(v.trials) < cfg.n_trials:
        v.error = f"incorrect on trial {failed['trial']}: {failed['reason']}" if failed else \
            f"the protocol ended after {len(v.trials)} of {cfg.n_trials} trials ({seen['bad']})"
        return
    calls = seen["calls"]
    v.timings["checked_calls"] = len(calls)  # every timed call, warm-ups included
    bad_call = next((i for i, c in enumerate(calls) if not c.get("ok")), None)
    if bad_call is not None:
        v.error = f"incorrect on timed call {bad_call} (fresh inputs): {calls[bad_call].get('reason')}"
        return
    if cfg.profile and len(calls) < cfg.warmup + max(cfg.iters, 1):
        v.violation = f"timing protocol broken ({seen['bad'] or 'calls missing'})"
        return
    v.correct = True
    if not cfg.profile:
        v.stage = "done"


# ----------------------------------------------------------------------------- generic isolated call, pool
def run_isolated(fn: str, args: dict, cfg: SandboxConfig, timeout_s: float, device: str = "cpu",
                 env: dict | None = None) -> tuple[bool, object, str]:
    """Run `module:function`(**args) in a sandbox child; the result must be plain data (dict/list/str/
    numbers/tensors: it is read with torch.load(weights_only=True)). Returns (ok, result, error)."""
    import pickle
    jobdir = new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir)
        with open(os.path.join(wdir, "args.pkl"), "wb") as f:
            pickle.dump(args, f)
        r = run_child({"kind": "call", "fn": fn, "args_path": os.path.join(wdir, "args.pkl"), "device": device},
                      jobdir, device=device, timeout_s=timeout_s, mem_limit_mb=cfg.mem_limit_mb,
                      hide=(os.path.expanduser(cfg.cache_dir),), env=env or {})
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if r.result is None:
        return False, None, f"{fn}: {r.error}"
    if r.result.get("error"):
        return False, None, r.result["error"]
    return True, r.result.get("value"), ""


class SandboxPool:
    """Thread-safe pool. Compiles run in parallel (compile_workers CPU slots); verify/profile hold one
    device slot (one job per GPU; on cpu `cpu_slots`, default 1, since timing never shares the machine).
    Every job is its own child process, so there are no long-lived workers to die or replace."""

    def __init__(self, cfg: SandboxConfig, gpus: list[int] | None = None, compile_workers: int | None = None,
                 cpu_slots: int = 1):
        import queue
        self.cfg = cfg
        slots = (gpus or [0]) if cfg.device == "cuda" else [None] * cpu_slots
        self.gpus = list(gpus or [0]) if cfg.device == "cuda" else None
        self._free: queue.Queue = queue.Queue()
        for s in slots:
            self._free.put(s)
        n = compile_workers or os.cpu_count() or 1
        self._compile_sem = threading.Semaphore(n)
        start_spares(cfg, slots)
        self._ex = cf.ThreadPoolExecutor(max_workers=len(slots) + n, thread_name_prefix="sandbox")

    @contextlib.contextmanager
    def _compile_gate(self):
        with self._compile_sem:
            yield

    @contextlib.contextmanager
    def _device_gate(self):
        gpu = self._free.get()
        try:
            yield gpu
        finally:
            self._free.put(gpu)

    def submit(self, task: str, solution: str, cfg: SandboxConfig | None = None) -> cf.Future:
        return self._ex.submit(_check, task, solution, cfg or self.cfg, self._compile_gate, self._device_gate)

    def prewarm(self, tasks: list[str], workers: int, on_done=None) -> dict[str, str | None]:
        """sandbox.prewarm on this pool's GPUs; call it before the first check (nothing may be timed meanwhile)."""
        return prewarm(tasks, self.cfg, workers, self.gpus, on_done)

    def compile(self, ws: str) -> cf.Future:
        def job():
            with self._compile_gate():
                return compile_workspace(ws, self.cfg)
        return self._ex.submit(job)

    def close(self):
        self._ex.shutdown(wait=True)
