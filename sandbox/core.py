"""The sandbox: isolated compile -> verify -> profile of a candidate kernel, and its verdict.

Every reward in training and every number in evaluation comes from `check()`. Three kinds of process take part,
and only one of them ever runs candidate code:
  * the host (this file): compiles through children, reads the verdict; never imports candidate code;
  * the driver (harness/driver.py, a child per task, kept across checks): the pristine task, the inputs of
    every call, the reference outputs, the clock and every comparison; it runs no candidate code;
  * the computing child (one per check, a warm spare or a fresh one): maps the driver's shared input and
    output regions and, when asked, runs forward on the inputs and copies the result into the output region.
    It is a candidate's, or a baseline's (eager and `torch.compile`, timed by the same driver path).
Files (in sandbox/): this one (what runs, the verdict), config.py (`SandboxConfig`), child.py (isolation, the
child and its channel), spares.py (the warm children), build.py (kernel compiles, load_inline builds, the dispatch
guard's build), extension.py (form (c)'s torch extension), reference.py (the host's side of drivers and pairings,
baselines); harness/rules.py (static scan, comparison, timing statistic); inside children (harness/):
driver.py, share.py (shared regions, GPU flags, the L2 controls, the freezer), sandbox_worker.py (the jobs, the
dispatch guard, the runtime helpers), measure.py (inputs), wire.py (the channels), inline.py and guard.cpp;
workspace.py (reading untrusted files, validating task and solution files).

Threat model. The candidate's process is the attacker's: Python or native code in it can rewrite any function,
message, clock or object of that process. So nothing it measures or reports enters a verdict's correctness or
time; it only computes, and the driver judges each call from outside:
  1. the driver draws the call's inputs from a seed the child never sees, computes the reference on them, and,
     while the child is stopped (SIGSTOP of its whole process tree, confirmed in /proc), copies them into the
     shared input region, poisons the output region (NaN) and, on a GPU, resets persisting L2 lines and the
     persisting set-aside and flushes the L2;
  2. the clock is the driver's: cpu, wall clock from "go" (the child continued) until the reply, read after
     every thread of the child is stopped again (no thread can finish the work afterwards); GPU, the driver's
     own events around a flag its stream writes ("go") and a flag the child's stream writes behind its output
     copy ("done"), the end event after a read of 4096 random output bytes. A timed GPU call is queued: the
     child enqueues its work behind the go flag and is stopped before the inputs exist, so the clock holds
     GPU work only, and nothing the child launched earlier can have read the inputs;
  3. the driver compares the output region in full with the reference (a stopped child, a settled GPU), checks
     the sampled bytes did not change since the clock stopped (work still running after "done"), and that
     the inputs are unmodified.
What the trusted side relies on: SIGSTOP (a stopped process runs no code on the CPU); separate processes and
CUDA contexts (the child maps only the two regions and the two flag words; the driver's memory, seeds and
reference are in another address space); the GPU's ordering of one stream's work, and of stream memory
operations across contexts; a GPU shared by two contexts running one at a time, so GPU work a stopped child
left queued lengthens the driver's preparation, and what exceeds its calibrated time is charged to the call.
COVERED:
  * Forged times, outputs and messages: the verdict reads only the driver's reports; what the child says of
    itself adds only its own errors and violations (it cannot claim success). Tested from Python (patched
    `json.dumps`, clocks, `torch.cuda.Event`, the harness's own objects) and from C++ (a kernel library running
    Python through the C API at load): tests/test_sandbox_attacks.py, tests/test_sandbox_gpu.py.
  * Work hidden in the harness: the child builds no input (a TorchFunctionMode sees nothing to answer), and a
    thread that watches the input region is stopped until the clock runs.
  * Every call is checked, warm-ups and timed calls included, on fresh inputs: caching by pointer or content,
    computing only on some calls, stale or uninitialised outputs (the output is poisoned) all fail.
  * Inputs beyond one distribution: trials and timed calls draw "plain" (get_inputs), "affine" (x * 2^U(-1,1)
    + U(-1,1) per float tensor) or "heavy" (one element in a thousand x 8) inputs; a variant on which the
    reference turns non-finite is drawn plain. Constants, identities and moment shortcuts that hold for randn
    only are wrong. Comparison: allclose AND relative L2 <= rtol, finite where the reference is, for float
    outputs; complex outputs as (real, imag) pairs; integer and bool outputs exactly; exact type, shape, dtype.
  * L2 persistence (an access-policy window with hitProp persisting keeps weights in L2 across a flush): reset
    before every timed call, baselines and candidates alike.
  * No torch compute: (1) the dispatch guard (sandbox/harness/guard.cpp: a C++ dispatcher fallback that sees every
    dispatched op, from Python or C++) on every forward, and on import and `__init__` with an init allow-list;
    (2) the profiler's aten list, re-checked on the host; (3) a static scan of the code reachable from ModelNew
    (sandbox/harness/rules.py; `rules` names the profile). The dynamic layers run in the candidate's process, so native
    code can switch them off; they are a rule of the task, not the integrity of the verdict.
  * Isolation per job: bwrap (`--unshare-all`: no network, own pid/ipc/uts namespaces; `/` read-only, private
    /tmp and /dev/shm, only the job's own dir writable). Compile and candidate children do not see the cache
    dir, the repository or the workspace's parent (other episodes). Fallbacks: `unshare --net`, then rlimits
    only; the level used is in `Verdict.timings["isolation"]`.
  * Limits: wall clock (process tree SIGKILLed), memory (RSS of the tree plus what its size-capped private /tmp
    and /dev/shm hold, polled; cpu children also get RLIMIT_AS; cuda children an allocator fraction), disk
    (what a compile, build or candidate child writes, polled and once more at its end), RLIMIT_CORE/FSIZE/
    NPROC; per workspace at most `max_kernels` kernels and `compile_budget_s` of compiling.
  * Workspace files: the host lstat()s before it reads, hashes or copies (workspace.py); symlinks, FIFOs,
    devices and sockets are refused with a verdict error; reads are capped; nothing is followed.
  * No state survives a check: one candidate per process (killed once its pairing ends; nothing is timed on
    its GPU until it has exited: `settle`); the driver's flags are zeroed at each pairing; job dirs are
    deleted; a load_inline source is built once by a child that sees no input, and runs from a private copy;
    form (c)'s extension is built by a child that runs compilers only (it never imports the module).
NOT COVERED (known gaps):
  * The child sees the inputs of the call it is asked for (it must compute on them), and the task's source and
    weights; a shortcut right on every variant above (integer inputs are drawn from get_inputs alone) passes.
  * A per-call fixed cost: on a GPU the queued clock holds the switches between the driver's and the child's
    contexts, the output copy, the flags and the output sample (~0.3 ms on an H100); each pairing measures it
    with null calls before any candidate code exists (the least of 8, `floor_ms`) and takes it off every
    queued call, the baselines' alike. A forward whose switches cost less than the null calls' would gain
    the difference (we know no way to). On cpu a signal round trip and the child's wake-up stay in every time.
    A forward that waits on the GPU (a sync) cannot be queued: its host time is inside its clock (the verdict
    counts such calls) and no floor is taken off.
  * A kernel left running on the GPU between calls (a persistent kernel polling the input region) is not
    stopped by SIGSTOP; the GPU runs one context at a time, so its GPU time while the driver prepares is
    charged to the call beyond PREP_SLACK, not prevented.
  * GPU work a child queues can run while the driver compares (it changes nothing the driver has not sampled
    or compared yet without being caught, but it slows the driver) or after its pairing until it exits.
  * No seccomp, no cgroup (a fast allocation burst can overshoot the RSS poll), GPU memory capped only by the
    allocator fraction (cudaMalloc from C++ bypasses it), no per-job GPU isolation besides CUDA_VISIBLE_DEVICES.
  * Reads: `/` is read-only but visible; anything this user can read outside the hidden dirs, a candidate
    can read. The child's environment is a whitelist (PASS_ENV). Fallback levels hide nothing, and at them the
    driver shares the host's process and mount namespaces.

Departures from the paper:
  1. The paper's sandbox is not public; this follows KernelBench's and other public harnesses' known hacks.
  2. Three solution forms (`Verdict.form`): (a) one file, KernelBench's; (b) a workspace whose kernels compile
     per file to plain shared objects called through ctypes (no torch headers), so an edit rebuilds one kernel
     in ~1 s instead of `load_inline`'s ~47 s; (c) the paper's released workspace (model_new.py importing
     `cuda_extension`, kernels/*.cu + kernels/*_binding.cpp + binding.cpp), built as one torch extension with
     the released flags, only changed sources recompiled (sandbox/extension.py). Form (a)'s `load_inline`
     sources and form (c)'s build against a slim stand-in for <torch/extension.h> first
     (sandbox.harness.inline.SLIM_TORCH_H), against torch's own headers when that fails; the verdict is the same.
  3. Reference outputs are always strict fp32; `precision` only affects the timed baselines/candidate.
  4. Every call is compared in full (the paper: 5 trials), and times are the driver's clock around one call
     (the released profiler script: the sum of kernel times over 10 iterations in the same process).

Smoke: python -m pytest tests/test_sandbox.py -q -x
Full (H200): python -m pytest tests/test_sandbox.py tests/test_sandbox_gpu.py -q
             python scripts/bench_sandbox.py --device cuda --out $OUT/bench_sandbox.json
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import workspace
from workspace import TaskError, WorkspaceError, python_error, read_file, read_task

from .build import build_inline, bytecode_cache, copy_build, guard_library, trim_log
from .build import compile_workspace as compile_kernels
from .child import (Child, ChildResult, SandboxError, hidden_candidate, isolation, last_line, new_jobdir,
                    require_device, run_child, settle)
from .config import SandboxConfig
from .extension import CPP_SUFFIXES, EXTENSION, build_extension, is_extension_workspace
from .harness import sandbox_worker
from .harness.rules import RULES, cpp_scan, static_scan, timing
from .reference import (DRIVER_SPARES, REF_SPARES, _request, baseline_cache, baseline_entry, baseline_timing,
                        device_name, driver, driver_spare, precision_of, prewarm, ref_spare, retime, run_pairing,
                        run_reference, time_baselines)
from .spares import Spares, warm_spares

_ALLOWED_OPS = sandbox_worker.ALLOWED_OPS  # the host's own copy: a candidate cannot widen it


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
    form: str = ""  # what the solution was read as (FORMS)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TASK_OK: set[str] = set()


def load_task(task: str | os.PathLike, device: str = "cpu", timeout_s: float = 300) -> str:
    """Validate a task (str: its source; a path: its .py file) in an isolated child (import, names, tensor
    inputs, one forward on `device`); returns its source; raises TaskError("one line")."""
    require_device(device)
    src = read_task(task)
    h = hashlib.sha256(f"{device}|{src}".encode()).hexdigest()
    if h not in _TASK_OK:
        run_reference(src, SandboxConfig(device=device, run_timeout_s=timeout_s))
        _TASK_OK.add(h)
    return src


# ----------------------------------------------------------------------------- check
def check(task: str | os.PathLike, solution: str | os.PathLike, cfg: SandboxConfig,
          gpu: int | None = None) -> Verdict:
    """Compile, verify and profile `solution` against `task`. A str is source text; a path (os.PathLike) is a
    location: the task's .py file, the solution's .py file or workspace directory. Never raises for candidate
    problems; raises TaskError for a malformed task. `gpu` pins the child to one GPU (the pool sets it)."""
    return _check(task, solution, cfg, contextlib.nullcontext, lambda: contextlib.nullcontext(gpu))


FORMS = {"a": "one file (form a)", "b": "workspace, ctypes kernels (form b)",
         "c": f"cuda-agent workspace ({EXTENSION})", "refused": "refused"}


def compile_workspace(ws: str, cfg: SandboxConfig, workers: int | None = None) -> tuple[bool, str, dict[str, str]]:
    """A workspace's build, (ok, log, {name: .so}): form (c) as one torch extension (sandbox/extension.py),
    form (b) kernel by kernel (sandbox.build.compile_workspace)."""
    if is_extension_workspace(ws):
        return build_extension(ws, cfg)
    return compile_kernels(ws, cfg, workers)


def _solution(solution: str | os.PathLike) -> tuple[str, str]:
    """A str is form (a)'s source: ("a", source). A path: ("b", workspace dir: form (b) or (c)) | ("a", the
    file's source) | ("refused", one line: a missing path, a file that is not a regular file of UTF-8 text or
    is larger than workspace.FILE_CAP)."""
    if isinstance(solution, str):
        return "a", solution
    path = os.fspath(solution)
    if os.path.isdir(path):
        return "b", path
    if not os.path.lexists(path):
        return "refused", f"solution not found: {path}"
    try:
        return "a", read_file(path, "solution", ValueError)
    except ValueError as e:
        return "refused", str(e)


def _check(task, solution, cfg, compile_gate, device_gate) -> Verdict:
    require_device(cfg.device)
    src = read_task(task)
    if not isinstance(solution, (str, os.PathLike)):  # the caller's mistake, not the candidate's: no verdict
        raise TypeError(f"solution: str (source) or os.PathLike (a location), not {type(solution).__name__}")
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


def _refused(sources: list[str], cfg: SandboxConfig, v: Verdict, cpp: tuple = (), imports: tuple = ()) -> bool:
    """The host's own checks of the candidate's Python files (paths of the host's copies): syntax, `ModelNew`
    in the entry file, the static scan (`imports` allowed besides cfg's); form (c)'s C++ files `cpp`, (name, path)
    pairs, are scanned too. Milliseconds, before any child starts; True if one refused it."""
    if cfg.rules not in RULES:  # the caller's configuration, not the candidate's doing: stop, one line
        raise SandboxError(f"--sandbox.rules {cfg.rules!r}: use one of {', '.join(RULES)}")
    v.timings["rules"] = cfg.rules
    texts = [workspace.read_text(p) for p in sources]  # the host's own copies, still read capped
    names = [os.path.basename(p) for p in sources]
    v.error = next(filter(None, (python_error(t, "solution" if n == "solution.py" else n,
                                              ("ModelNew",) if n in ("model_new.py", "solution.py") else ())
                                 for t, n in zip(texts, names))), None)
    if v.error or not cfg.static_scan:
        return v.error is not None
    extra = tuple(m.strip() for m in cfg.allow_imports.split(",") if m.strip()) + tuple(imports)
    v.violation = next(filter(None, (static_scan(t, extra, cfg.rules) for t in texts)), None) or \
        next(filter(None, (cpp_scan(workspace.read_text(p), name, cfg.rules) for name, p in cpp)), None)
    v.stage = "verify" if v.violation else v.stage
    return v.violation is not None


def _prepare(form: str, sol, cfg: SandboxConfig, v: Verdict, compile_gate, wdir: str) -> str | None:
    """Copy the candidate into wdir, check it on the host, then compile (form b) or build (forms a, c); returns
    the candidate path, or None on failure. The workspace is read only through `workspace` (no link followed, no
    special file opened, capped), and what is checked is the copy that runs."""
    if form == "refused":
        v.error = sol
        return None
    cpp = ()
    if form in ("b", "c"):
        try:
            copied = workspace.copy_tree(sol, wdir, ignore_suffixes=(".so",))
        except WorkspaceError as e:  # a link, FIFO, device or socket: the candidate's doing, one line
            v.error = str(e)
            return None
        if "model_new.py" not in copied:
            v.error = "workspace has no model_new.py"
            return None
        path = os.path.join(wdir, "model_new.py")
        sources = [os.path.join(wdir, f) for f in copied if f.endswith(".py") and "/" not in f and f != "model.py"]
        if form == "c":  # its C++ includes torch's headers: scanned like form (a)'s load_inline strings
            cpp = tuple((f, os.path.join(wdir, f)) for f in copied if f.endswith(CPP_SUFFIXES))
    else:
        path = os.path.join(wdir, "solution.py")
        with open(path, "w") as f:
            f.write(sol)
        sources = [path]
    if _refused(sources, cfg, v, cpp, (EXTENSION,) if form == "c" else ()):
        return None
    guard_library(cfg)  # built once per torch; every candidate child loads it
    bytecode_cache(cfg)  # filled once per Python and torch; every child imports from it
    v.stage = "compile"
    if form in ("b", "c"):
        t_build = time.perf_counter()
        with compile_gate():  # form (c): one torch extension, only its changed sources recompiled
            ok, v.compile_log, sos = build_extension(sol, cfg) if form == "c" else compile_kernels(sol, cfg)
        if form == "c":
            v.timings["build_s"] = round(time.perf_counter() - t_build, 3)  # ~0 when these sources were built before
        if not ok:
            v.error = "compile failed: " + (last_line(v.compile_log.split("\n")[0]) or "see compile_log")
            return None
        os.makedirs(os.path.join(wdir, "kernels"), exist_ok=True)
        for name, so in sos.items():
            shutil.copy(so, os.path.join(wdir, "kernels", f"{name}.so"))
    v.compiled = True
    if form == "a":  # load_inline: built once per source by a child that sees no input; a private copy runs
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


def _run_check(src: str, solution: str | os.PathLike, cfg: SandboxConfig, v: Verdict, compile_gate, device_gate):
    form, sol = _solution(solution)
    form = "c" if form == "b" and is_extension_workspace(sol) else form
    v.form = FORMS[form]
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
            base = base if base and base.get("timing") == baseline_timing(cfg) else None  # older entries: re-timed
            if warm_spares(cfg) > 0:  # spares start while the driver loads (first check)
                _SPARES.fill(*_spare_kind(cfg, gpu, hidden_candidate(cfg, sol if form in ("b", "c") else None)))
            t_drv = time.perf_counter()
            with driver(src, cfg, gpu) as drv:
                v.device = drv.device_name
                v.timings["driver_uses"] = drv.uses  # checks this driver served before this one
                if cfg.profile and base is None:
                    base = baseline_cache(cfg, key, baseline_entry(time_baselines(drv, src, cfg, gpu), v.precision,
                                                                   v.device))
                t_cand = time.perf_counter()
                import torch
                torch.save(drv.state_dict, os.path.join(wdir, "state_dict.pt"))
                r, calls, end = _run_candidate(form, cand, wdir, jobdir, drv, cfg, gpu,
                                               sol if form in ("b", "c") else None)
                v.timings.update({"driver_s": round(t_cand - t_drv, 3),  # where a check's time goes
                                  "candidate_s": round(time.perf_counter() - t_cand, 3)})
                _judge(r, calls, end, cfg, v, form)
                if v.correct and cfg.profile:
                    timing(calls, end, base, v, cfg, lambda: retime(drv, src, cfg, gpu, key, base))
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


_SPARES = Spares()  # candidate children


def start_spares(cfg: SandboxConfig, gpus: list) -> None:
    """Start every device slot's warm children now, in the background (candidate spares, drivers and
    baseline children), so that even the first check of a trainer or an evaluation finds them ready."""
    if warm_spares(cfg) > 0:
        guard_library(cfg)  # what a spare binds at its start
        bytecode_cache(cfg)
        for gpu in gpus:
            _SPARES.fill(*_spare_kind(cfg, gpu, hidden_candidate(cfg)))
            REF_SPARES.fill(*ref_spare(cfg, gpu))
            DRIVER_SPARES.fill(*driver_spare(cfg, gpu))


def _spare_kind(cfg, gpu, hide) -> tuple:
    """(key, count, spawn) of the warm spares a candidate of this check can use."""
    return ((cfg.device, gpu, cfg.mem_limit_mb, hide, isolation()), warm_spares(cfg),
            lambda: Child(new_jobdir(), device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, hide=hide,
                          disk_limit_mb=cfg.disk_limit_mb))


def _run_candidate(form, cand, wdir, jobdir, drv, cfg, gpu, ws) -> tuple[ChildResult, list, dict]:
    """The candidate's child, computing for one pairing of `drv`: eager's rounds (before any candidate code
    exists in it), then the candidate's load, trials, profiler call and timed calls. Returns the child's
    result (what it says of itself: only errors and violations are read from it) and the driver's reports."""
    timeout = cfg.run_timeout_s + (cfg.compile_timeout_s if form == "a" else 0)  # load_inline args that differ
    # from the build's build again in the candidate child
    child, warm, hide = None, False, hidden_candidate(cfg, ws)
    if warm_spares(cfg) > 0:  # a warm child: move the prepared files into its own job dir
        child, warm = _SPARES.take(*_spare_kind(cfg, gpu, hide))
        for name in os.listdir(wdir):
            if name != "job.json":
                os.rename(os.path.join(wdir, name), os.path.join(child.wdir, name))
        cand, wdir = os.path.join(child.wdir, os.path.relpath(cand, wdir)), child.wdir
    kernels = {}
    if os.path.isdir(os.path.join(wdir, "kernels")):
        kernels = {f[:-3]: os.path.join(wdir, "kernels", f) for f in os.listdir(os.path.join(wdir, "kernels"))
                   if f.endswith(".so")}
    # No seed, input, reference or plan in the job: it only ever computes what the driver asks for.
    job = {"kind": "candidate", "task_path": os.path.join(wdir, "task.py"), "cand_path": cand, "cand_dir": wdir,
           "device": cfg.device, "init_seed": cfg.seed, "kernels": kernels,
           "state_dict_path": os.path.join(wdir, "state_dict.pt"), "precision": precision_of(cfg),
           "ext_dir": os.path.join(wdir, "ext") if form == "a" else None,
           "extension": kernels.get(EXTENSION) if form == "c" else None}
    if child is None:
        child = Child(jobdir, device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, hide=hide, job=job,
                      disk_limit_mb=cfg.disk_limit_mb)
        job = None
    settle(gpu)  # the previous job's child has left the device before anything is timed here
    try:
        r, calls, end = run_pairing(drv, child, job, _request(cfg, "candidate", cfg.profile and cfg.eager_beside),
                                    timeout)
    finally:
        shutil.rmtree(child.jobdir, ignore_errors=True)
    r.warm = warm
    return r, calls, end


def _judge(r: ChildResult, calls: list, end: dict, cfg, v: Verdict, form: str):
    """The verdict from the driver's reports; the child's own result adds only its errors and violations
    (a forged one can hide nothing the driver saw, and claims no success)."""
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("USDT:"))  # profiler noise
    v.timings["candidate_phases"] = r.phases()  # e.g. load_at_s: torch import + CUDA init
    v.timings["warm_child"] = getattr(r, "warm", False)  # a spare started before this check
    v.timings["log"] = (err[-1500:] + ("\n[stdout]\n" + r.stdout[-500:] if r.stdout.strip() else "")).strip()
    trials = [c for c in calls if c.get("phase") == "trial"]
    v.trials = [{"trial": c["i"], **{k: c.get(k) for k in ("ok", "reason", "variant", "max_abs_err", "max_rel_err",
                                                             "rel_l2", "first_bad_index")}} for c in trials]
    res = r.result or {}
    load = next((c for c in calls if c.get("type") == "load"), None)
    stage = "verify" if trials else "load"
    if form == "a" and "Error building extension" in (res.get("error") or "") + ((load or {}).get("error") or "") + r.stderr:
        v.compiled, v.compile_log = False, trim_log(r.stderr, False)
    bad = next((c for c in calls if c.get("violation")), None)
    v.violation = res.get("violation") or (load or {}).get("violation") or (bad or {}).get("violation")
    ops = next((c.get("ops") for c in calls if c.get("phase") == "ops"), None) or []
    host_bad = [n for n in ops if n[6:] not in _ALLOWED_OPS]  # the host's own allow-list
    if not v.violation and host_bad:
        v.violation = f"aten op {host_bad[0]} seen by the profiler inside forward"
    timed = [c for c in calls if c.get("phase") == "time"]
    v.stage = "profile" if timed else stage
    if v.violation:
        return
    if load is not None:
        v.error = load.get("error") or "the candidate did not load"
        return
    failed = next((c for c in calls if not c.get("ok")), None)
    if failed is not None:
        where = f"trial {failed['i']}" if failed["phase"] == "trial" else \
            f"timed call {failed['i']} (fresh inputs)" if failed["phase"] == "time" else "the profiler's call"
        died = r.error if (failed.get("reason") or "").startswith("no reply") and r.error else None
        v.error = f"incorrect on {where}: " + (f"the candidate {died}" if died else str(failed["reason"]))
        return
    if r.result is None and len(trials) < cfg.n_trials:
        v.error = f"candidate {r.error}"
        return
    if res.get("error"):
        v.error = res["error"]
        return
    if len(trials) < cfg.n_trials or not any(c.get("phase") == "ops" for c in calls):
        v.error = f"the check ended after {len(trials)} of {cfg.n_trials} trials ({end.get('error') or r.error})"
        return
    v.timings["checked_calls"] = len(timed)  # every timed call, warm-ups included, compared in full
    if cfg.profile and len(timed) < cfg.warmup + max(cfg.iters, 1):
        v.error = f"the timed calls ended early ({end.get('error') or r.error or 'calls missing'})"
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

    def submit(self, task: str | os.PathLike, solution: str | os.PathLike,
               cfg: SandboxConfig | None = None) -> cf.Future:
        """A future of `check(task, solution)`'s Verdict (str: source; a path: a location)."""
        return self._ex.submit(_check, task, solution, cfg or self.cfg, self._compile_gate, self._device_gate)

    def prewarm(self, tasks: list[str | os.PathLike], workers: int, on_done=None) -> dict[str, str | None]:
        """sandbox.prewarm on this pool's GPUs; call it before the first check (nothing may be timed meanwhile)."""
        return prewarm(tasks, self.cfg, workers, self.gpus, on_done)

    def compile(self, ws: str) -> cf.Future:
        def job():
            with self._compile_gate():
                return compile_workspace(ws, self.cfg)
        return self._ex.submit(job)

    def close(self):
        self._ex.shutdown(wait=True)
