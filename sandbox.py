"""The sandbox: isolated compile -> verify -> profile of a candidate kernel, and its verdict.

Every reward in training and every number in evaluation comes from `check()`. The host (this file) never
imports candidate code: each compile, reference run and candidate run is its own child process
(`python sandbox_worker.py JOBFILE`) inside bubblewrap, and the host compares the candidate's outputs
with reference outputs that only the host holds. Files: this one (what runs, and the verdict),
sandbox_child.py (isolation, the child runner), sandbox_rules.py (static scan, comparison),
sandbox_worker.py (inside the child), workspace.py (reading untrusted files).

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
    request (a trial or a timed call, with its one seed) only after the previous one is answered. Every
    timed call, warm-ups included, runs on fresh inputs under the dispatch guard, and its output is checked
    against the reference by random projections whose keys are sent only after the call returned
    (`sketch_close`): computing only on some calls, recognising inputs or caching by pointer or content
    gains nothing. Trials are compared in full: allclose AND relative L2 <= rtol, exact type, shape,
    dtype and device, finite where the reference is, inputs unmodified.
  * No torch compute: (1) the dispatch guard on every forward, and on import and `__init__` with an
    init allow-list (creation, init, scaling: nothing computed before the first input can be an answer);
    (2) the profiler's aten list, re-checked on the host; (3) a static scan (sandbox_rules.py) that also
    refuses frame, traceback and gc introspection, raw-memory ctypes, and patches of torch, numpy, clocks
    or the harness.
  * Host memory: the host compares each reply as it arrives and keeps none of its tensors; a message over
    2 x the reference output (+16 MB) is refused from its header.
  * Timing: clocks and the torch functions of the checks bound before candidate import; a device-wide
    sync around every timed call; NaN-filled free memory and an L2 flush before each; the child's clock
    must agree with the host's over the same spans. Baselines: eager and compiled in interleaved rounds,
    the minimum round median kept, re-timed in a new child before a speedup tier is awarded on a baseline
    from a single run (`Verdict.timings["baseline"]`, `["baseline_retimed"]`).
  * No state survives a check: job dirs are deleted, the cache is hidden, and a load_inline source is built
    once by a child that sees no input; checked runs get a private copy of that build dir.
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
     rebuilds one kernel in ~1 s instead of `load_inline`'s ~55 s.
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

import ast
import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

import sandbox_worker
import workspace
from sandbox_child import (HARNESS_DIR, REPO, ChildResult, SandboxError, bwrap_argv, isolation,  # noqa: F401
                           last_line, new_jobdir, require_device, run_child, visible_devices)
from sandbox_rules import compare, sketch_close, static_scan
from workspace import WorkspaceError



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
    """host-memory limit per child (RSS of the process tree; cpu also RLIMIT_AS)"""
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


class TaskError(Exception):
    """A malformed task; str(e) is one clear line."""


# ----------------------------------------------------------------------------- what a child sees
def _hidden(cfg: SandboxConfig, ws: str | None = None) -> tuple[str, ...]:
    """What a compile or candidate child must not see: the cache dir (baseline times, other kernels), the
    repository (the harness, demo solutions, tests) and, for a workspace, its parent (other episodes')."""
    out = [os.path.expanduser(cfg.cache_dir), REPO]
    return tuple(out + ([os.path.dirname(os.path.realpath(ws))] if ws else []))




# ----------------------------------------------------------------------------- compile (form b)
_VERSIONS: dict[str, str] = {}


def _compiler_version(exe: str) -> str:
    if exe not in _VERSIONS:
        try:
            _VERSIONS[exe] = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            _VERSIONS[exe] = "missing"
    return _VERSIONS[exe]


def cuda_arch() -> str:
    """sm_XX of GPU 0 (nvidia-smi), overridable with CUDA_AGENT_ARCH=90; default 90 (H100/H200)."""
    if os.environ.get("CUDA_AGENT_ARCH"):
        return os.environ["CUDA_AGENT_ARCH"].replace("sm_", "").replace(".", "")
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return out[0].replace(".", "")
    return "90"


def _compile_cmd(src: str, so: str, text: str = "") -> list[str]:
    """nvcc for .cu (+ -lcublas when the source mentions cublas), g++ -fopenmp for .cpp."""
    if src.endswith(".cu"):
        a = cuda_arch()
        return ["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{a},code=sm_{a}",
                "-o", so, src] + (["-lcublas"] if "cublas" in text.lower() else [])
    return [os.environ.get("CXX", "g++"), "-O3", "-shared", "-fPIC", "-fopenmp", "-march=native", "-o", so, src]


def _trim_log(log: str, ok: bool, limit: int = 3000) -> str:
    """Keep error/warning lines (+2 lines of context); the tail when nothing matches."""
    lines, keep = log.splitlines(), []
    for i, ln in enumerate(lines):
        if re.search(r"\berror\b|\bwarning\b|undefined reference|cannot find|no such file", ln, re.I):
            keep += lines[i:i + 3]
    text = "\n".join(dict.fromkeys(keep)) if keep else ("" if ok else log[-1500:])
    return text[:limit]


def _compile_one(ws: str, name: str, ext: str, cfg: SandboxConfig,
                 deadline: float | None = None) -> tuple[bool, str, str | None]:
    """Compile kernels/NAME.ext in its own sandbox, cached by sha256(what the compiler sees, flags, compiler,
    arch). The job dir gets a safe copy (`workspace.copy_tree`) of all of kernels/, nested dirs included,
    minus the other kernels' sources and build products, and the key is the digest of that copy: a header
    in kernels/impl/ is part of the key, and an edit of another kernel does not rebuild this one.
    `deadline` (time.monotonic) is the workspace's shared compile budget."""
    kdir, own = os.path.join(ws, "kernels"), f"{name}{ext}"
    jobdir = new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        others = tuple(f for f in os.listdir(kdir) if f.endswith((".cu", ".cpp")) and f != own)
        workspace.copy_tree(kdir, wdir, ignore_suffixes=(".so",), skip_names=others)
        cmd = _compile_cmd(own, f"{name}.so", workspace.read_text(os.path.join(wdir, own)))
        h = hashlib.sha256(f"{workspace.tree_digest(wdir)}|{' '.join(cmd)}|{_compiler_version(cmd[0])}".encode())
        cache = os.path.join(os.path.expanduser(cfg.cache_dir), "kernels", h.hexdigest()[:32])
        so = os.path.join(cache, f"{name}.so")
        if os.path.exists(so):
            return True, "", so
        timeout = cfg.compile_timeout_s
        left = deadline - time.monotonic() if deadline is not None else timeout
        if left <= 0:
            return False, f"{own}: not compiled: the workspace's compile budget of {cfg.compile_budget_s:g} s is spent", None
        r = run_child({}, jobdir, device="cpu", timeout_s=min(timeout, left), mem_limit_mb=cfg.mem_limit_mb,
                      cmd=cmd, hide=_hidden(cfg, ws))
        log = r.stdout + r.stderr
        built = os.path.join(wdir, f"{name}.so")
        if r.error and left < timeout and r.error.startswith("timed out"):
            return False, f"{own}: compiler stopped: the workspace's compile budget of {cfg.compile_budget_s:g} s " \
                          f"is spent\n{_trim_log(log, False)}", None
        if r.error:  # timeout or memory
            return False, f"{own}: compiler {r.error}\n{_trim_log(log, False)}", None
        if r.rc != 0 or not os.path.exists(built):
            return False, f"{own}: compile failed\n{_trim_log(log, False)}", None
        os.makedirs(cache, exist_ok=True)
        tmp = f"{so}.{secrets.token_hex(4)}"
        shutil.copy(built, tmp)
        os.replace(tmp, so)  # atomic: concurrent compiles of the same source are fine
        return True, _trim_log(log, True), so
    except WorkspaceError as e:
        return False, str(e), None
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def compile_workspace(ws: str, cfg: SandboxConfig, workers: int | None = None) -> tuple[bool, str, dict[str, str]]:
    """Compile every kernels/NAME.cu (cuda) / NAME.cpp (both) separately; returns (ok, log, {name: so}).
    A link or special file anywhere in the workspace, more than cfg.max_kernels sources, or compiles that
    together outlast cfg.compile_budget_s fail it with one line first in the log."""
    exts = (".cu", ".cpp") if cfg.device == "cuda" else (".cpp",)
    try:
        files = workspace.walk(ws)
    except WorkspaceError as e:
        return False, str(e), {}
    srcs = sorted(f[len("kernels/"):] for f in files if f.startswith("kernels/") and f.count("/") == 1
                  and f.endswith(exts))
    names = [os.path.splitext(s) for s in srcs]
    dup = {n for n, _ in names if sum(m == n for m, _ in names) > 1}
    if dup:
        return False, f"two kernel sources share the name {sorted(dup)[0]}", {}
    if len(names) > cfg.max_kernels:
        return False, f"{len(names)} kernel sources in kernels/, more than max_kernels={cfg.max_kernels}", {}
    deadline = time.monotonic() + cfg.compile_budget_s  # one budget for the whole workspace
    with cf.ThreadPoolExecutor(max(1, min(len(names), workers or os.cpu_count() or 1))) as ex:
        results = list(ex.map(lambda ne: _compile_one(ws, ne[0], ne[1], cfg, deadline), names))
    ok = all(r[0] for r in results)
    log = "\n".join(r[1] for r in results if r[1]).strip()
    return ok, log, {n: r[2] for (n, _), r in zip(names, results) if r[2]}


# ----------------------------------------------------------------------------- tasks, baselines
def _looks_like_path(s: str) -> bool:
    return "\n" not in s and (s.endswith((".py", ".txt")) or os.sep in s or os.path.lexists(s))


def _read_file(path: str, what: str, err) -> str:
    """A file the user named: a regular file of UTF-8 text, read capped (links to one are fine)."""
    if os.path.isdir(path):
        raise err(f"{what} {path} is a directory" + (": give the task's .py file" if what == "task" else ""))
    try:
        data = workspace.read_bytes(path, follow_links=True)
    except WorkspaceError as e:
        raise err(f"{what} {e}") from None
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise err(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def _defines(tree: ast.Module) -> set[str]:
    """Top-level names a module binds (classes, functions, assignments, imports)."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def python_error(source: str, name: str, needs: tuple[str, ...]) -> str | None:
    """Host-side check of a Python file in milliseconds: it parses and defines `needs` at top level.
    Returns one line naming the file (and line), or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"{name}: line {e.lineno}: SyntaxError: {e.msg}"
    missing = [n for n in needs if n not in _defines(tree)]
    return f"{name} defines no {', '.join(missing)}" if missing else None


def _read_task(src_or_path: str) -> str:
    """The task's source: `src_or_path` itself, or the file it names; checked on the host (parses, defines
    Model, get_inputs and get_init_inputs). Raises TaskError with one line naming the file."""
    name = "task"
    if _looks_like_path(src_or_path):
        if not os.path.lexists(src_or_path):
            raise TaskError(f"task file not found: {src_or_path}")
        name, src_or_path = src_or_path, _read_file(src_or_path, "task", TaskError)
    err = python_error(src_or_path, name, ("Model", "get_inputs", "get_init_inputs"))
    if err:
        raise TaskError(err)
    return src_or_path


def _precision(cfg: SandboxConfig) -> str:
    assert cfg.precision in ("fp32", "tf32", "auto"), f"precision must be fp32|tf32|auto, got {cfg.precision}"
    if cfg.device != "cuda":
        return "fp32"
    return ("tf32" if cfg.rtol >= 1e-3 else "fp32") if cfg.precision == "auto" else cfg.precision


_NAMES: dict = {}


def _device_name(device: str, gpu: int | None) -> str:
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


def _baseline_cache(cfg: SandboxConfig, key: str, value: dict | None = None) -> dict | None:
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


def _reference(task_src: str, cfg: SandboxConfig, seeds: list[int], want_baselines: bool,
               gpu: int | None = None, warm: bool = False, sketch_seeds: dict | None = None) -> dict:
    """Run the reference child; returns its result dict or raises TaskError. `warm`: only compile (prewarm).
    `seeds` get full outputs, `sketch_seeds` ({seed: projection keys}) get sketches only."""
    jobdir = new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir)
        with open(os.path.join(wdir, "task.py"), "w") as f:
            f.write(task_src)
        inductor = os.path.join(os.path.expanduser(cfg.cache_dir), "inductor")
        os.makedirs(inductor, exist_ok=True)
        job = {"kind": "reference", "task_path": os.path.join(wdir, "task.py"), "device": cfg.device,
               "seeds": seeds, "sketch_seeds": {str(s): k for s, k in (sketch_seeds or {}).items()},
               "timing_seed": secrets.randbelow(2**31), "init_seed": cfg.seed,
               "baselines": want_baselines, "precision": _precision(cfg),
               "warmup": cfg.warmup, "iters": cfg.iters, "warm": warm}
        env = {"TORCHINDUCTOR_CACHE_DIR": inductor}
        if warm:  # prewarm runs many children at once: one compile thread each, no worker pool per child
            env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        r = run_child(job, jobdir, device=cfg.device, timeout_s=cfg.run_timeout_s + (cfg.compile_timeout_s if
                      want_baselines or warm else 0), mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, writable=(inductor,),
                      env=env, max_msg_mb=2 * cfg.mem_limit_mb + 256)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if r.result is None:
        raise TaskError(f"reference run failed: {r.error}")
    if r.result.get("task_error"):
        raise TaskError(r.result["task_error"])
    return r.result


def _baseline_entry(res: dict, precision: str, device: str, old: dict | None = None) -> dict:
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
            "precision": precision, "device": device}


def baselines(task: str, cfg: SandboxConfig, gpu: int | None = None) -> dict:
    """{"eager_ms", "compile_ms", "precision", "device", rounds, runs} of the task; cached per (task, device,
    torch, precision)."""
    src = _read_task(task)
    prec, dev = _precision(cfg), _device_name(cfg.device, gpu)
    key = f"{hashlib.sha256(src.encode()).hexdigest()}|{dev}|{prec}"
    hit = _baseline_cache(cfg, key)
    if hit and "eager_rounds" in hit:
        return hit
    res = _reference(src, cfg, [], True, gpu)  # no seeds: only the timings come back, not the outputs
    return _baseline_cache(cfg, key, _baseline_entry(res, prec, res["device_name"]))


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
    dev, prec = _device_name(cfg.device, slots[0]), _precision(cfg)
    for t in tasks:
        src = _read_task(t)
        h = hashlib.sha256(src.encode()).hexdigest()
        if cfg.profile and _baseline_cache(cfg, f"{h}|{dev}|{prec}") is None:
            todo[h] = src
    out: dict[str, str | None] = {}

    def one(i_h):
        i, h = i_h
        try:
            _reference(todo[h], cfg, [], False, slots[i % len(slots)], warm=True)
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


_TASK_OK: set[str] = set()


def load_task(src_or_path: str, device: str = "cpu", timeout_s: float = 300) -> str:
    """Validate a task in an isolated child (import, names, tensor inputs, one forward on `device`);
    returns its source; raises TaskError("one line")."""
    require_device(device)
    src = _read_task(src_or_path)
    h = hashlib.sha256(f"{device}|{src}".encode()).hexdigest()
    if h not in _TASK_OK:
        _reference(src, SandboxConfig(device=device, run_timeout_s=timeout_s), [0], False)
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
    if not _looks_like_path(solution):
        return "a", solution
    if os.path.isdir(solution):
        return "b", solution
    if not os.path.lexists(solution):
        return "refused", f"solution not found: {solution}"
    try:
        return "a", _read_file(solution, "solution", ValueError)
    except ValueError as e:
        return "refused", str(e)


def _check(task, solution, cfg, compile_gate, device_gate) -> Verdict:
    require_device(cfg.device)
    src = _read_task(task)
    v = Verdict(precision=_precision(cfg), device=cfg.device, timings={"isolation": isolation()})
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
    return path


def _run_check(src: str, solution: str, cfg: SandboxConfig, v: Verdict, compile_gate, device_gate):
    form, sol = _solution(solution)
    jobdir = new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir)
        cand = _prepare(form, sol, cfg, v, compile_gate, wdir)
        if cand is None:
            return
        with open(os.path.join(wdir, "task.py"), "w") as f:
            f.write(src)
        with device_gate() as gpu:
            dev = _device_name(cfg.device, gpu)
            key = f"{hashlib.sha256(src.encode()).hexdigest()}|{dev}|{v.precision}"
            base = _baseline_cache(cfg, key) if cfg.profile else None
            base = base if base and "eager_rounds" in base else None  # entries of an older format are re-timed
            t_ref = time.perf_counter()
            ref, plan = _reference_pool(src, cfg, cfg.profile and base is None, gpu, dev)
            t_cand = time.perf_counter()
            v.device = ref["device_name"]
            if cfg.profile and base is None:
                base = _baseline_cache(cfg, key, _baseline_entry(ref, v.precision, v.device))
            import torch
            torch.save(ref["state_dict"], os.path.join(wdir, "state_dict.pt"))
            r, seen = _run_candidate(form, cand, wdir, jobdir, ref, plan, cfg, gpu, sol if form == "b" else None)
            v.timings.update({"reference_s": round(t_cand - t_ref, 3),  # where a check's time goes
                              "candidate_s": round(time.perf_counter() - t_cand, 3)})
            _judge(r, seen, ref, cfg, v, form)
            if v.correct and cfg.profile:
                _timing(seen, base, v, cfg, lambda: _retime(src, cfg, gpu, key, base))
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


REF_POOL_EXTRA = 4      # a reference pool holds n_trials + this many trial seeds, warmup + iters + this many
REF_POOL_MAX_USES = 50  # timing seeds; checks served by one pool before it is recomputed (0: fresh each check)
REF_POOL_MAX_MB = 2048  # pools whose outputs are larger than this are not kept (KernelBench L1: up to ~60 GB)
REF_POOL_TOTAL_MB = 8192  # host RAM for all kept pools; the oldest are dropped beyond it
_REF_POOLS: dict = {}
_REF_LOCK = threading.Lock()


def _reference_pool(src: str, cfg: SandboxConfig, want_baselines: bool, gpu, dev: str) -> tuple[dict, list]:
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
        keys = {s: [rng.randrange(2**62) for _ in range(sandbox_worker.SKETCH_KEYS)] for s in time_seeds}
        ref = _reference(src, cfg, trial_seeds, want_baselines, gpu, sketch_seeds=keys if cfg.profile else None)
        ref["keys"] = keys if cfg.profile else {}
        mb = sum(t.numel() * t.element_size() for outs in ref["outputs"].values() for t in outs) / 2**20
        if REF_POOL_MAX_USES > 0 and mb <= REF_POOL_MAX_MB:
            with _REF_LOCK:
                _REF_POOLS[key] = {"ref": {k: v for k, v in ref.items() if k != "baselines"}, "uses": 1, "mb": mb}
                while len(_REF_POOLS) > 1 and sum(e["mb"] for e in _REF_POOLS.values()) > REF_POOL_TOTAL_MB:
                    _REF_POOLS.pop(next(iter(_REF_POOLS)))
    plan = [{"op": "trial", "seed": s} for s in rng.sample(sorted(ref["outputs"]), cfg.n_trials)] + [{"op": "ops"}]
    if cfg.profile:  # every timed call, warm-ups included, on fresh inputs and checked by its sketch
        plan += [{"op": "time", "seed": s} for s in rng.sample(sorted(ref["sketches"]), n_time)]
    return ref, plan + [{"op": "done"}]


def _run_candidate(form, cand, wdir, jobdir, ref, plan, cfg, gpu, ws) -> tuple[ChildResult, dict]:
    """Run the candidate child and drive it through `plan`, comparing each reply as it arrives.

    Returns the child's result and what the host saw: per-trial comparisons, the profiler's op list, and
    per timed call the child's time, the host's wall time of the same span and the sketch comparison."""
    writable, env, timeout = [], {}, cfg.run_timeout_s
    if form == "a":  # load_inline: built once per source with no input in sight, then run from a private copy
        ext = _build_inline(cand, wdir, cfg, gpu)
        mine = os.path.join(jobdir, "ext")
        _copy_build(ext, mine)
        if isolation() == "bwrap":  # the copy appears at the cache's path, so ninja finds the build up to date
            writable, env = [(mine, ext)], {"TORCH_EXTENSIONS_DIR": ext}
        else:
            writable, env = [mine], {"TORCH_EXTENSIONS_DIR": mine}
        timeout += cfg.compile_timeout_s  # a build that happens at the first forward
    kernels = {}
    if os.path.isdir(os.path.join(wdir, "kernels")):
        kernels = {f[:-3]: os.path.join(wdir, "kernels", f) for f in os.listdir(os.path.join(wdir, "kernels"))
                   if f.endswith(".so")}
    # No seed, count or plan in the job: the host sends each request when the previous one is answered.
    job = {"kind": "candidate", "task_path": os.path.join(wdir, "task.py"), "cand_path": cand, "cand_dir": wdir,
           "device": cfg.device, "init_seed": cfg.seed, "kernels": kernels,
           "state_dict_path": os.path.join(wdir, "state_dict.pt"), "precision": _precision(cfg)}
    seen = {"trials": [], "ops": None, "calls": [], "bad": None, "i": 0, "sent_at": 0.0}
    out_bytes = sum(t.numel() * t.element_size() for t in next(iter(ref["outputs"].values())))

    def send(control, obj):
        with contextlib.suppress(OSError, ValueError):
            seen["sent_at"] = time.monotonic()
            control.write(json.dumps(obj) + "\n")
            control.flush()

    def advance(control):  # the next request; "done" at once after the first failure
        req = plan[seen["i"]] if seen["bad"] is None and seen["i"] < len(plan) else {"op": "done"}
        seen["i"] += 1
        seen["req"] = req
        send(control, req)

    def on_msg(msg, control):
        t, req = msg.get("type"), seen.get("req") or {}
        try:
            if t == "stage" and msg.get("stage") == "verify":
                advance(control)
            elif t == "trial" and req.get("op") == "trial":
                res = _compare_kind(ref, req["seed"], msg, cfg)
                seen["trials"].append({"trial": len(seen["trials"]), **res})
                seen["bad"] = seen["bad"] or (None if res["ok"] else f"trial {len(seen['trials']) - 1}")
                advance(control)
            elif t == "ops" and req.get("op") == "ops":
                seen["ops"] = list(msg.get("ops", []))
                advance(control)
            elif t == "iter" and req.get("op") == "time":
                seen["calls"].append({"ms": float(msg["ms"]), "span_ms": float(msg["span_ms"]),
                                      "host_ms": (time.monotonic() - seen["sent_at"]) * 1e3, "kind": msg.get("kind")})
                send(control, {"keys": ref["keys"][req["seed"]]})  # only now, after the call returned
            elif t == "sketch" and req.get("op") == "time":
                call = seen["calls"][-1]
                call["ok"], call["reason"] = sketch_close(msg["sketch"], ref["sketches"][req["seed"]], cfg)
                if call["kind"] != ref["out_kind"]:
                    call["ok"], call["reason"] = False, f"returned a {call['kind']}, expected a {ref['out_kind']}"
                seen["bad"] = seen["bad"] or (None if call["ok"] else f"timed call {len(seen['calls']) - 1}")
                advance(control)
            elif t != "stage" and t != "result":
                seen["bad"] = seen["bad"] or f"unexpected message {t!r} for request {req.get('op')!r}"
                send(control, {"op": "done"})
        except Exception as e:  # noqa: BLE001 - a malformed reply fails the candidate, never the host
            seen["bad"] = seen["bad"] or f"malformed {t!r} message ({type(e).__name__}: {e})"[:300]
            send(control, {"op": "done"})
    r = run_child(job, jobdir, device=cfg.device, timeout_s=timeout, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu,
                  writable=tuple(writable), hide=_hidden(cfg, ws), env=env, on_msg=on_msg,
                  max_msg_mb=(2 * out_bytes >> 20) + 16)
    return r, seen


def _build_inline(cand: str, wdir: str, cfg: SandboxConfig, gpu) -> str:
    """The load_inline build dir of this source (cache_dir/torch_ext/<sha>), built if it is not yet.

    The build child imports the solution and constructs ModelNew, with the build dir writable and no input,
    seed or reference anywhere in reach. Candidate children only ever get a private copy of it, so nothing
    a checked run writes there survives into another check (no stash of answers across checks)."""
    with open(cand) as f:
        src = f.read()
    ext = os.path.join(os.path.expanduser(cfg.cache_dir), "torch_ext", hashlib.sha256(src.encode()).hexdigest()[:16])
    os.makedirs(ext, exist_ok=True)
    if os.path.exists(os.path.join(ext, ".built")):
        return ext
    jobdir = new_jobdir()
    try:
        bdir = os.path.join(jobdir, "w")
        os.makedirs(bdir)
        shutil.copy(cand, os.path.join(bdir, "solution.py"))
        shutil.copy(os.path.join(wdir, "task.py"), os.path.join(bdir, "task.py"))
        job = {"kind": "build", "cand_path": os.path.join(bdir, "solution.py"), "cand_dir": bdir,
               "task_path": os.path.join(bdir, "task.py"), "init_seed": cfg.seed, "device": cfg.device}
        r = run_child(job, jobdir, device=cfg.device, timeout_s=cfg.compile_timeout_s + 60,
                      mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, writable=(ext,), hide=_hidden(cfg),
                      env={"TORCH_EXTENSIONS_DIR": ext})
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if r.result is not None and r.result.get("built"):
        with open(os.path.join(ext, ".built"), "w") as f:
            f.write("ok")
    return ext  # a failed build is reported by the candidate child, which builds again in its copy


def _copy_build(src: str, dst: str):
    """Copy a build dir (written by candidate code: links and special files are refused), keeping mtimes so
    that ninja sees the objects as up to date."""
    for rel in workspace.copy_tree(src, dst, ignore_suffixes=(), file_cap=1 << 30, total_cap=2 << 30):
        st = os.lstat(os.path.join(src, rel))
        os.utime(os.path.join(dst, rel), ns=(st.st_atime_ns, st.st_mtime_ns))


def _compare_kind(ref: dict, seed: int, msg: dict, cfg: SandboxConfig) -> dict:
    if msg.get("kind") != ref["out_kind"]:
        return {"ok": False, "reason": f"returned a {msg.get('kind')}, the reference returns a {ref['out_kind']}"}
    return compare(ref["outputs"][seed], msg["outs"], msg.get("devices"), cfg.device, cfg.atol, cfg.rtol)


def _judge(r: ChildResult, seen: dict, ref: dict, cfg, v: Verdict, form: str):
    """Turn what the host saw into the verdict: errors, violations, trials, every timed call's check."""
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("USDT:"))  # profiler noise
    v.timings["candidate_phases"] = r.phases()  # e.g. verify_at_s: torch import + CUDA init + candidate load
    v.timings["log"] = (err[-1500:] + ("\n[stdout]\n" + r.stdout[-500:] if r.stdout.strip() else "")).strip()
    v.trials = seen["trials"]
    if r.result is None:
        v.stage, v.error = r.stage or "load", f"candidate {r.error}"
        return
    res = r.result
    stage = res.get("stage", "load")
    v.stage = "profile" if seen["calls"] else ("verify" if stage == "done" else stage)
    if form == "a" and "Error building extension" in (res.get("error") or "") + r.stderr:
        v.compiled, v.compile_log = False, _trim_log(r.stderr, False)
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


def _timing(seen: dict, base: dict, v: Verdict, cfg: SandboxConfig, retime):
    """Candidate time (median of the timed calls after warm-up), the timer cross-check, and the baselines,
    re-timed once before a speedup tier is awarded on a baseline measured in a single run."""
    import statistics
    calls = seen["calls"][cfg.warmup:]
    ms = [c["ms"] for c in calls]
    child_span, host_span = sum(c["span_ms"] for c in calls), sum(c["host_ms"] for c in calls)
    med, mean = statistics.median(ms), statistics.fmean(ms)
    v.timings.update({"cand_cv": statistics.pstdev(ms) / mean if mean > 0 else 0.0, "n_iters": len(ms),
                      "host_span_ms": round(host_span, 3), "child_span_ms": round(child_span, 3)})
    # The child's clock must agree with the host's over the same spans (patched or overwritten timers), and the
    # timed calls must fit in those spans. The host's span of a call also holds two pipe hops and its reader
    # thread's wake-up, a few ms on a loaded machine: hence the slack per call.
    slack = max(0.75 * host_span, 5.0 * len(calls) + 50.0)  # a stopped or swapped clock still fails
    if child_span < host_span - slack or sum(ms) > child_span * 1.01 + 1.0:
        v.correct, v.violation = False, (f"timer mismatch: host saw {host_span:.1f} ms, child reported "
                                         f"{child_span:.1f} ms (sum of timed calls {sum(ms):.1f} ms)")
        return
    if med < 0.95 * base["eager_ms"] and base.get("runs", 1) < 2:  # a speedup tier depends on this baseline
        base = retime()
        v.timings["baseline_retimed"] = True
    v.timings.update({"baseline": f"min of {len(base['eager_rounds'])} round medians over {base['runs']} run(s)",
                      "eager_spread": round(base.get("spread", 0.0), 4), "eager_cv": base.get("eager_cv"),
                      "compile_error": base.get("compile_error")})
    v.candidate_ms, v.eager_ms, v.compile_ms = med, base["eager_ms"], base["compile_ms"]
    if v.candidate_ms > 0:
        v.speedup_eager = v.eager_ms / v.candidate_ms
        v.speedup_compile = v.compile_ms / v.candidate_ms if v.compile_ms else None
    v.stage = "done"


def _retime(src: str, cfg: SandboxConfig, gpu, key: str, base: dict) -> dict:
    """Time the baselines again in a new reference child and merge the rounds into the cached entry."""
    res = _reference(src, cfg, [], True, gpu)
    return _baseline_cache(cfg, key, _baseline_entry(res, base["precision"], base["device"], old=base))


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
