"""The sandbox: isolated compile -> verify -> profile of a candidate kernel, and its verdict.

Every reward in training and every number in evaluation comes from `check()`. The host (this file) never
imports candidate code: each compile, reference run and candidate run is its own child process
(`python sandbox_worker.py JOBFILE`) inside bubblewrap, and the host compares the candidate's outputs
with reference outputs that only the host holds.

Threat model. COVERED:
  * Process isolation per job: bwrap (`--unshare-all`: no network, own pid/ipc/uts namespaces;
    `/` read-only, private tmpfs /tmp and /dev/shm, only the job's own copy of the workspace writable,
    the cache dir and every other job's dir hidden). Fallback when bwrap is missing: `unshare --net
    --map-root-user` (no network, but NO filesystem isolation), then plain rlimits (neither).
    The level used is in `Verdict.timings["isolation"]`.
  * Limits: wall clock (the whole process tree is SIGKILLed), memory (the host sums VmRSS over the
    child's process tree and kills it past mem_limit_mb; cpu children also get RLIMIT_AS; cuda children
    set_per_process_memory_fraction instead, since CUDA reserves huge VA), RLIMIT_CORE=0, RLIMIT_FSIZE,
    RLIMIT_NPROC (this user's current threads + 2048; not for root, whom it does not bind).
    Crashes, os._exit, SystemExit, hangs, OOM and CUDA errors all become Verdict(error=...).
  * Result channel: nonce-framed `torch.save` messages on an inherited pipe, read by the host with
    `weights_only=True` (no pickle code execution on the host). stdout/stderr are data only.
  * Reference outputs are computed in a separate child (strict fp32) and never enter the candidate's
    process; freed CUDA memory is filled with NaN before each candidate forward (Sakana's hack), and
    the device is synchronised before forward starts, so that fill cannot race a candidate's own stream.
    Inputs: get_inputs() is called under `torch.device(device)` in both children (same draw, no host copy).
  * Correctness: n_trials fresh seeded inputs (seeds salted per job), allclose AND relative L2 error
    <= rtol (kills "softmax = 1/N"), exact torch.Tensor type/shape/dtype/device, finite where the
    reference is, inputs unmodified, and a final check on the last TIMED iteration, whose inputs come
    from a seed the host sends only once timing has started (pointer-/content-keyed caches fail).
  * No torch compute in forward: (1) a TorchDispatchMode guard (sees Python AND C++ extension aten
    calls), (2) the profiler's aten event list on an unguarded forward, (3) a static AST scan on the
    host. Inheriting from the reference Model is a violation.
  * Threads: no Python thread started in forward may be alive after it; the native thread set must not
    grow after warm-up; the output must not change after forward returned.
  * Timing: clock references bound before candidate import; device-wide sync around every timed
    iteration (all streams); L2 flush and fresh in-place inputs between iterations; the host's own wall
    clock around the timing phase must agree with the child's. Same timer for baselines and candidate;
    precision fairness (TF32 for both or neither).
NOT COVERED (known gaps):
  * Code in the candidate's process can do anything that process can: C/C++ can read any memory of its
    own process, unregister the dispatch guard, disable the profiler, rewrite the worker's Python state,
    or forge result messages (the nonce is in its own address space). Module-level patches of the worker
    are undone after import and after verify, and clocks are held in locals captured before import, so
    the easy Python patches change nothing. The three independent no-torch
    layers, the host-side comparison and the host wall-clock check make this hard, not impossible.
  * The worker's own Python checks (threads, input mutation, the guard's bookkeeping) run in the
    candidate's process and can be neutralised from Python too; the host-side checks cannot: output
    comparison, the post-timing check on a late seed, the profiler op list (re-checked on the host
    against its own allow-list), the static scan and the wall-clock cross-check. A candidate that
    re-implements the worker's result protocol can still report made-up per-iteration times, bounded
    only by the host-measured duration of the timing phase.
  * No disk quota: a candidate can fill the host's /tmp through its job dir (RLIMIT_FSIZE caps each
    file at 1 GiB; the job dir is deleted afterwards).
  * No seccomp; no cgroup (memory is enforced by polling RSS every 50 ms, so a very fast allocation
    burst can overshoot briefly); GPU memory is capped only by the allocator fraction (cudaMalloc from
    C++ bypasses it); no per-job GPU isolation besides CUDA_VISIBLE_DEVICES.
  * The static scan cannot see arithmetic operators on tensors (x * 2); the dynamic layers do.
  * Reads: `/` is bound read-only, so a candidate can READ every file this user can, except the cache
    dir and the sandbox root (hidden). Keep secrets out of readable files; the child's environment is a
    whitelist (PASS_ENV), so API keys in env vars do not reach it. Fallback levels hide nothing.
  * Form (a): the load_inline build dir (cache_dir/torch_ext/<sha of the source>) is writable and kept,
    so re-checking the same source does not rebuild; that source could stash data there for its own
    later checks. Timing inputs are drawn from a fresh per-job seed, so a stash cannot pre-answer them.
  * Timed iterations other than the last run without the dispatch guard (its overhead would distort
    timing): a candidate that detects the guard could use torch ops only while timed.

Departures from the paper:
  1. The paper's sandbox is not public; this follows issue 2 and KernelBench's known hacks.
  2. Kernels (form b) compile per file to plain shared objects via ctypes (no torch headers), so an edit
     rebuilds one kernel in ~1 s instead of `load_inline`'s ~55 s.
  3. Reference outputs are always strict fp32; `precision` only affects the timed baselines/candidate.
  4. One reference child serves up to REF_POOL_MAX_USES checks of a task: it computes outputs for a small
     pool of host-random seeds and each check draws its own random subset (trial seeds + the late final
     seed). Safe because a candidate never sees reference outputs and keeps no state between checks;
     it halves the processes per check. Set REF_POOL_MAX_USES = 0 for a fresh reference every check.

Smoke: python -m pytest tests/test_sandbox.py -q -x
Full (H200): python -m pytest tests/test_sandbox.py tests/test_sandbox_gpu.py -q
             python scripts/bench_sandbox.py --device cuda --out $OUT/bench_sandbox.json
"""
from __future__ import annotations

import ast
import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import random
import re
import resource
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import reward as reward_mod

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_worker.py")


def _host_allowed_ops() -> frozenset:
    """The worker's allow-list, parsed from its source (the host never imports the worker module's state)."""
    src = open(WORKER).read()
    return frozenset(src.split('ALLOWED_OPS = frozenset("""', 1)[1].split('"""', 1)[0].split())


_ALLOWED_OPS = _host_allowed_ops()


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
    reward: str = "milestone"
    """reward kind: "milestone" | "speedup" """
    seed: int = 0
    """base seed (trial seeds are salted per job so a candidate cannot precompute)"""
    static_scan: bool = True
    """the static layer of the no-torch rule (imports, calls, harness introspection); the tests switch it
    off to prove that each dynamic layer catches its hack on its own"""
    allow_imports: str = ""
    """extra modules a candidate may import, comma-separated (default none: kernels must be its own; the
    adversarial tests widen it to use numpy as a stand-in kernel and reach the dynamic layers)"""


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
    reward: float = -1.0
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


# ----------------------------------------------------------------------------- isolation + child runner
_ROOT: str | None = None
_ROOT_LOCK = threading.Lock()
_ISOLATION: str | None = None
_ISOLATION_LOCK = threading.Lock()
PASS_ENV = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "PYTHONPATH", "VIRTUAL_ENV",
            "CC", "CXX", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_CUDA_ARCH_LIST", "CUDA_AGENT_ARCH")


def _root() -> str:
    """Host-private dir (mode 0700) holding every job dir; hidden inside every sandbox."""
    global _ROOT
    with _ROOT_LOCK:
        if _ROOT is None:
            _ROOT = tempfile.mkdtemp(prefix="cuda_agent_sbx_")
            os.chmod(_ROOT, 0o700)
            atexit.register(shutil.rmtree, _ROOT, True)
    return _ROOT


def isolation() -> str:
    """"bwrap" | "unshare" | "rlimits": the strongest isolation that works on this machine
    (CUDA_AGENT_ISOLATION=unshare|rlimits forces a weaker level, e.g. where bwrap breaks a driver).
    Probed once per process, under a lock: the pool's threads ask at the same moment, and a thread must never
    see a fallback value while another thread's probe is still running (a 2-GPU training run did: two of its
    first checks ran with rlimits only)."""
    global _ISOLATION
    with _ISOLATION_LOCK:
        if _ISOLATION is None and os.environ.get("CUDA_AGENT_ISOLATION") in ("bwrap", "unshare", "rlimits"):
            _ISOLATION = os.environ["CUDA_AGENT_ISOLATION"]
        if _ISOLATION is None:
            probes = [("bwrap", ["bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
                                 "--unshare-all", "--die-with-parent", "true"]),
                      ("unshare", ["unshare", "--net", "--map-root-user", "true"])]
            level = "rlimits"
            for name, cmd in probes:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    if shutil.which(cmd[0]) and subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0:
                        level = name
                        break
            _ISOLATION = level  # published only once the probe is finished
        return _ISOLATION


def _wrap(cmd: list[str], wdir: str, device: str, writable: list[str], hide: list[str]) -> list[str]:
    """Prefix `cmd` with the isolation: only `wdir` and `writable` are writable; `hide` is invisible."""
    level = isolation()
    if level == "unshare":
        return ["unshare", "--net", "--map-root-user", *cmd]
    if level == "rlimits":
        return cmd
    args = ["bwrap", "--ro-bind", "/", "/"]
    args += ["--dev-bind", "/dev", "/dev"] if device == "cuda" else ["--dev", "/dev"]
    args += ["--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
    for h in [_root(), *hide]:  # after /tmp: tmpfs over host-private dirs (mount points are created)
        if os.path.isdir(h) or h.startswith("/tmp/"):
            args += ["--tmpfs", h]
    for w in [wdir, *writable]:  # binds come last so that the tmpfs mounts above do not hide them
        args += ["--bind", w, w]
    return args + ["--unshare-all", "--die-with-parent", "--new-session", "--chdir", wdir, *cmd]


def _proc_tree(pid: int) -> list[int]:
    """pid and all its descendants (scan of /proc/*/stat)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
    return total / 1024


def _kill_tree(proc: subprocess.Popen):
    for p in reversed(_proc_tree(proc.pid)):
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass
class ChildResult:
    result: dict | None          # the final {"type": "result", ...} message, None if the child died first
    messages: list               # (host monotonic time, message) for every message received
    error: str | None            # why there is no (valid) result
    stage: str | None            # last stage message seen
    stdout: str
    stderr: str
    rc: int | None = None
    started: float = 0.0         # host monotonic time the child was started

    def phases(self) -> dict:
        """Seconds from start to each first stage/timing message and to the result (where a check's time goes)."""
        out, seen = {}, set()
        for t, m in self.messages:
            name = m.get("stage") if m.get("type") == "stage" else m.get("type")
            if name and name not in seen:
                seen.add(name)
                out[f"{name}_at_s"] = round(t - self.started, 3)
        return out


def _reader(fd: int, nonce: bytes, out: list, on_msg, state: dict, max_bytes: int):
    """Read nonce-framed messages until EOF; a bad frame (or more than max_bytes) marks the channel corrupt."""
    import torch
    total = 0
    with os.fdopen(fd, "rb", buffering=0) as f:
        def read(n):
            buf = bytearray()
            while len(buf) < n:
                chunk = f.read(n - len(buf))
                if not chunk:
                    return None
                buf += chunk
            return bytes(buf)
        while True:
            head = read(24)
            if head is None:
                return
            if head[:16] != nonce:
                state["corrupt"] = "bad frame on the result channel"
                return
            n = struct.unpack(">Q", head[16:])[0]
            total += n
            if total > max_bytes:  # the host's memory is not the candidate's to fill
                state["corrupt"] = f"result messages exceed {max_bytes >> 20} MB"
                return
            body = read(n)
            try:
                msg = torch.load(io.BytesIO(body or b""), weights_only=True)
                assert isinstance(msg, dict) and "type" in msg
            except Exception as e:  # noqa: BLE001 - non-plain data (e.g. a tensor subclass) is refused
                state["corrupt"] = f"unreadable result message ({type(e).__name__})"
                return
            out.append((time.monotonic(), msg))
            on_msg(msg)


def _user_threads() -> int:
    """Threads owned by this uid (RLIMIT_NPROC counts them all, so the child's limit is relative)."""
    n, uid = 0, str(os.getuid())
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{d}/status") as f:
                    st = dict(ln.split(":", 1) for ln in f if ":" in ln)
                if st.get("Uid", "").split()[:1] == [uid]:
                    n += int(st.get("Threads", "1"))
    return n


def _limits(cpu_as_mb: int | None):
    nproc = _user_threads() + 2048 if os.getuid() != 0 else None  # fork bombs (root ignores NPROC)

    def apply():
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))
        if cpu_as_mb:
            resource.setrlimit(resource.RLIMIT_AS, (cpu_as_mb << 20, cpu_as_mb << 20))
    return apply


def run_child(job: dict, jobdir: str, *, device: str, timeout_s: float, mem_limit_mb: int, gpu: int | None = None,
              writable: tuple = (), hide: tuple = (), env: dict | None = None, on_msg=None,
              cmd: list[str] | None = None) -> ChildResult:
    """Run one sandboxed child (the worker with `job`, or `cmd`) and collect its messages."""
    wdir = os.path.join(jobdir, "w")
    os.makedirs(wdir, exist_ok=True)
    nonce = secrets.token_bytes(16)
    rfd, wfd = os.pipe()
    crfd, cwfd = os.pipe()
    job = {**job, "nonce": nonce.hex(), "result_fd": wfd, "control_fd": crfd}
    with open(os.path.join(wdir, "job.json"), "w") as f:
        json.dump(job, f)
    child_env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    child_env.update({"HOME": wdir, "TMPDIR": "/tmp" if isolation() == "bwrap" else wdir,
                      "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})
    child_env["CUDA_VISIBLE_DEVICES"] = _visible(gpu) if device == "cuda" else ""  # cpu children see no GPU
    is_worker = cmd is None
    cmd = cmd or [sys.executable, WORKER, os.path.join(wdir, "job.json")]
    full = _wrap(cmd, wdir, device, list(writable), list(hide))
    out_f, err_f = open(os.path.join(jobdir, "stdout"), "w+b"), open(os.path.join(jobdir, "stderr"), "w+b")
    msgs, state = [], {}
    control = os.fdopen(cwfd, "w")
    t_started = time.monotonic()

    def handle(msg):
        if on_msg:
            on_msg(msg, control)
    try:
        proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, env=child_env,
                                cwd=wdir, pass_fds=(wfd, crfd), start_new_session=True,
                                preexec_fn=_limits(mem_limit_mb + 4096 if device == "cpu" else None))
    finally:
        os.close(wfd)
        os.close(crfd)
    reader = threading.Thread(target=_reader, args=(rfd, nonce, msgs, handle, state, (2 * mem_limit_mb + 256) << 20),
                              daemon=True)
    reader.start()
    t_end, why, peak, tree, n = time.monotonic() + timeout_s, None, 0.0, [proc.pid], 0
    while proc.poll() is None:
        if time.monotonic() > t_end:
            why = f"timed out after {timeout_s:.0f}s"
        else:
            tree = _proc_tree(proc.pid) if n % 5 == 0 else tree  # the /proc scan is the costly part
            n += 1
            peak = max(peak, _rss_mb(tree))
            if peak > mem_limit_mb:
                why = f"memory limit exceeded (RSS {peak:.0f} MB > {mem_limit_mb} MB)"
        if why:
            _kill_tree(proc)
            break
        time.sleep(0.05)
    proc.wait()
    reader.join(timeout=10)
    with contextlib.suppress(OSError):
        control.close()
    rc = proc.returncode
    stdout, stderr = _tail(out_f), _tail(err_f)
    result = next((m for _, m in reversed(msgs) if m.get("type") == "result"), None)
    stage = next((m["stage"] for _, m in reversed(msgs) if m.get("type") == "stage"), None)
    if why is None and state.get("corrupt"):
        why = state["corrupt"]
    if why is None and result is None and is_worker:
        why = _death_reason(rc, stderr)
    return ChildResult(result if why is None else None, msgs, why, stage, stdout, stderr, rc, t_started)


def _visible(gpu: int | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child pinned to pool index `gpu` (mapped through the host's own list)."""
    host = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is None:  # not pinned (plain check() outside a pool): the child sees what the host sees
        return host if host is not None else ",".join(str(i) for i in range(_gpu_count()))
    ids = [x for x in host.split(",") if x.strip()] if host else None
    return ids[gpu] if ids else str(gpu)


def _gpu_count() -> int:
    """GPUs on this machine, counted without initialising CUDA in the host (nvidia-smi; 1 if unknown)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))
    return 1


def _death_reason(rc: int, stderr: str) -> str:
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else None
    if sig:
        with contextlib.suppress(ValueError):
            return f"process killed by {signal.Signals(sig).name}" + (f"; stderr: {_last_line(stderr)}" if stderr else "")
    return f"process exited with code {rc} without a result" + (f"; stderr: {_last_line(stderr)}" if stderr else "")


def _tail(f, n: int = 4000) -> str:
    f.seek(0, 2)
    size = f.tell()
    f.seek(max(0, size - n))
    data = f.read().decode(errors="replace")
    f.close()
    return data


def _last_line(s: str) -> str:
    lines = [ln for ln in s.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _new_jobdir() -> str:
    return tempfile.mkdtemp(dir=_root())


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


def _compile_one(ws: str, name: str, ext: str, cfg: SandboxConfig) -> tuple[bool, str, str | None]:
    """Compile kernels/NAME.ext in its own sandbox, cached by sha256(sources, flags, compiler, arch)."""
    kdir = os.path.join(ws, "kernels")
    with open(os.path.join(kdir, f"{name}{ext}"), errors="replace") as f:
        cmd = _compile_cmd(f"{name}{ext}", f"{name}.so", f.read())
    h = hashlib.sha256()
    for fn in sorted(os.listdir(kdir)):  # the kernel + every header it could include
        if fn == f"{name}{ext}" or fn.endswith((".h", ".cuh", ".hpp", ".inc")):
            with open(os.path.join(kdir, fn), "rb") as f:
                h.update(fn.encode() + b"\0" + f.read() + b"\0")
    h.update(" ".join(cmd).encode() + _compiler_version(cmd[0]).encode())
    cache = os.path.join(os.path.expanduser(cfg.cache_dir), "kernels", h.hexdigest()[:32])
    so = os.path.join(cache, f"{name}.so")
    if os.path.exists(so):
        return True, "", so
    jobdir = _new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        shutil.copytree(kdir, wdir, ignore=shutil.ignore_patterns("*.so"))
        r = run_child({}, jobdir, device="cpu", timeout_s=cfg.compile_timeout_s, mem_limit_mb=cfg.mem_limit_mb,
                      cmd=cmd)
        log = r.stdout + r.stderr
        built = os.path.join(wdir, f"{name}.so")
        if r.error:  # timeout or memory
            return False, f"{name}{ext}: compiler {r.error}\n{_trim_log(log, False)}", None
        if r.rc != 0 or not os.path.exists(built):
            return False, f"{name}{ext}: compile failed\n{_trim_log(log, False)}", None
        os.makedirs(cache, exist_ok=True)
        tmp = f"{so}.{secrets.token_hex(4)}"
        shutil.copy(built, tmp)
        os.replace(tmp, so)  # atomic: concurrent compiles of the same source are fine
        return True, _trim_log(log, True), so
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def compile_workspace(ws: str, cfg: SandboxConfig, workers: int | None = None) -> tuple[bool, str, dict[str, str]]:
    """Compile every kernels/NAME.cu (cuda) / NAME.cpp (both) separately; returns (ok, log, {name: so})."""
    kdir = os.path.join(ws, "kernels")
    exts = (".cu", ".cpp") if cfg.device == "cuda" else (".cpp",)
    srcs = sorted(fn for fn in os.listdir(kdir) if fn.endswith(exts)) if os.path.isdir(kdir) else []
    names = [os.path.splitext(s) for s in srcs]
    dup = {n for n, _ in names if sum(m == n for m, _ in names) > 1}
    if dup:
        return False, f"two kernel sources share the name {sorted(dup)[0]}", {}
    with cf.ThreadPoolExecutor(max(1, min(len(names), workers or os.cpu_count() or 1))) as ex:
        results = list(ex.map(lambda ne: _compile_one(ws, ne[0], ne[1], cfg), names))
    ok = all(r[0] for r in results)
    log = "\n".join(r[1] for r in results if r[1]).strip()
    return ok, log, {n: r[2] for (n, _), r in zip(names, results) if r[2]}


# ----------------------------------------------------------------------------- static scan (layer 3)
TORCH_OK = {"empty", "empty_like", "empty_strided", "from_numpy", "is_tensor", "Size", "device", "dtype", "no_grad",
            "inference_mode", "get_default_dtype", "is_grad_enabled", "set_grad_enabled", "finfo", "iinfo"}
TORCH_OK_PREFIX = ("torch.cuda.", "torch.utils.", "torch.backends.", "torch.nn.Parameter", "torch.nn.Module",
                   "torch.ops.")
METHODS_BAD = set("""add add_ sub sub_ mul mul_ div div_ matmul mm bmm addmm baddbmm einsum sum mean max min amax
amin argmax argmin softmax log_softmax relu relu_ sigmoid tanh gelu exp log sqrt rsqrt pow abs neg clamp clamp_
clip where masked_fill masked_fill_ fill_ zero_ copy_ clone cumsum cumprod prod norm std var sort topk gather
scatter scatter_ scatter_add index_select index_add_ conv1d conv2d conv3d linear float half double bfloat16
long int bool round floor ceil sign maximum minimum lerp addcmul addcdiv tril triu diag outer dot cross
logsumexp all any nonzero masked_select repeat tile flip roll cat stack""".split())
# Ways out of torch into another array library without importing it (`x.numpy() * (x.numpy() > 0)` is a
# numpy ReLU with no import): refused unless the config allows numpy.
METHODS_ESCAPE = {"numpy", "tolist", "__dlpack__", "__array__"}
CPP_OK = {"empty", "empty_like", "empty_strided", "from_blob"}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


# Introspection of the harness's own guards. Only the last timed iteration runs under the dispatch guard
# (its overhead would distort timing), so a candidate that could tell guarded from unguarded calls could
# use torch only while unguarded: any reference to the dispatch-mode stack, the profiler, tracing hooks,
# frame inspection or the worker's internals is a violation by itself.
INTROSPECTION = re.compile(
    r"_python_dispatch|dispatch_stack|dispatch_mode|DispatchMode|_is_profiler_enabled|\bprofiler\b|"
    r"\bautograd\.profiler|kineto|setprofile|settrace|_getframe|\binspect\b|\bgc\.|"
    r"sandbox_worker\.(?!load_kernel|ptr|stream)\w+|\bsys\.modules|\b__class__\.__subclasses__")


# Modules a candidate may import. Kernels must be the candidate's own (compiled by the sandbox, or built
# with load_inline / a compiler it runs at import): other compute libraries (numpy, cupy, triton, numba,
# jax, scipy, ...) would be a fallback that never exercises a custom kernel. Seen: a numpy ReLU earned
# reward 3 on the cpu backend before this rule.
IMPORT_OK = {"torch", "torch.nn", "torch.nn.functional", "torch.utils.cpp_extension", "ctypes", "math", "os",
             "os.path", "shutil", "subprocess", "tempfile", "hashlib", "pathlib", "typing", "functools",
             "__future__", "dataclasses", "sandbox_worker"}
CALLS_BAD_IN_FORWARD = ("importlib.", "__import__")   # dynamic imports would dodge IMPORT_OK


def _import_violation(tree, allow: tuple[str, ...] = ()) -> str | None:
    ok = IMPORT_OK | set(allow)
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            if name not in ok:
                return (f"static scan: import of {name!r} (line {node.lineno}) is not allowed: compute must go "
                        f"through your own kernels; allowed imports: {', '.join(sorted(IMPORT_OK))}")
    return None


def _strip_comments(source: str) -> str:
    """Source with # comments blanked (line numbers kept), so prose in comments cannot trip the scan."""
    import tokenize
    lines = source.splitlines(keepends=True)
    with contextlib.suppress(tokenize.TokenError, IndentationError, SyntaxError):
        for tok in reversed(list(tokenize.generate_tokens(io.StringIO(source).readline))):
            if tok.type == tokenize.COMMENT:
                (r, c0), (_, c1) = tok.start, tok.end
                lines[r - 1] = lines[r - 1][:c0] + lines[r - 1][c1:]
    return "".join(lines)


def static_scan(source: str, allow_imports: tuple[str, ...] = ()) -> str | None:
    """Conservative scan of candidate Python (+ C++ strings) for torch compute outside __init__."""
    code = _strip_comments(source)
    m = INTROSPECTION.search(code)
    if m:
        line = code.count("\n", 0, m.start()) + 1
        return f"static scan: harness introspection {m.group(0)!r} (line {line}) is not allowed"
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # the child reports the syntax error as a load error
    bad_import = _import_violation(tree, allow_imports)
    if bad_import:
        return bad_import
    alias = {"F": "torch.nn.functional", "nn": "torch.nn"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith("torch"):
                    alias[a.asname] = a.name
    # Names bound to a compiled library (`lib = load_kernel("k")`, `ctypes.CDLL(...)`): `lib.mm(...)` is the
    # candidate's own launcher, not a tensor method, and must not trip the METHODS_BAD rule below.
    libs = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
            and _dotted(n.value.func).rsplit(".", 1)[-1] in ("load_kernel", "CDLL", "LoadLibrary")
            for t in n.targets if isinstance(t, ast.Name)}
    bodies = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
              and getattr(n, "name", "") != "__init__"]
    for fn in bodies:
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            head, _, rest = name.partition(".")
            name = f"{alias[head]}.{rest}".rstrip(".") if head in alias else name
            bad = None
            if name.startswith("torch.nn.functional.") or name.startswith("torch.ops.aten."):
                bad = name
            elif name.startswith(CALLS_BAD_IN_FORWARD) or name == "__import__":
                bad = name
            elif name.startswith("torch.") and name.count(".") == 1 and name[6:] not in TORCH_OK:
                bad = name
            elif name.startswith("torch.") and name.count(".") > 1 and not name.startswith(TORCH_OK_PREFIX):
                bad = name if not name.startswith("torch.nn.") else None
            elif isinstance(node.func, ast.Attribute) and node.func.attr in METHODS_ESCAPE and \
                    "numpy" not in allow_imports:
                bad = f".{node.func.attr}()"
            elif isinstance(node.func, ast.Attribute) and node.func.attr in METHODS_BAD and head not in libs and \
                    not name.startswith(("math.", "np.", "numpy.", "os.", "ctypes.")):
                bad = f".{node.func.attr}()"
            elif name in ("getattr", "eval", "exec", "__import__") and node.args and \
                    (name != "getattr" or _dotted(node.args[0]) in ("torch", "F", "nn", "torch.nn.functional")):
                bad = f"{name}(...)"
            if bad:
                return f"static scan: torch compute {bad} in {getattr(fn, 'name', 'lambda')} (line {node.lineno})"
    for node in ast.walk(tree):  # C++ sources of load_inline (form a)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "#include" in node.value:
            for m in re.finditer(r"\b(?:at|torch)::([a-z_]\w*)\s*\(", node.value):
                if m.group(1) not in CPP_OK:
                    return f"static scan: C++ calls {m.group(0).rstrip('(').strip()} (torch compute)"
            for m in re.finditer(r"\.\s*([a-z_]\w*)\s*\(", node.value):
                if m.group(1) in METHODS_BAD:
                    return f"static scan: C++ calls tensor method .{m.group(1)}() (torch compute)"
    return None


# ----------------------------------------------------------------------------- comparison (host side)
def compare(ref: list, cand: list, devices: list | None, device: str, atol: float, rtol: float) -> dict:
    """One trial: {"ok", "max_abs_err", "max_rel_err", "rel_l2", "first_bad_index", "reason"}."""
    import torch
    res = {"ok": False, "max_abs_err": None, "max_rel_err": None, "rel_l2": None, "first_bad_index": None,
           "reason": None}
    if len(ref) != len(cand):
        return {**res, "reason": f"returned {len(cand)} tensors, expected {len(ref)}"}
    for i, (r, c) in enumerate(zip(ref, cand)):
        where = f"output {i}: " if len(ref) > 1 else ""
        if type(c) is not torch.Tensor:
            return {**res, "reason": f"{where}not a torch.Tensor ({type(c).__name__})"}
        if devices and devices[i] != device:
            return {**res, "reason": f"{where}on {devices[i]}, expected {device}"}
        if c.shape != r.shape:
            return {**res, "reason": f"{where}shape {tuple(c.shape)}, expected {tuple(r.shape)}"}
        if c.dtype != r.dtype:
            return {**res, "reason": f"{where}dtype {c.dtype}, expected {r.dtype}"}
        r64, c64 = r.double(), c.double()
        fin = torch.isfinite(r64)
        if bool((fin & ~torch.isfinite(c64)).any()):
            idx = int((fin & ~torch.isfinite(c64)).flatten().nonzero()[0])
            return {**res, "reason": f"{where}non-finite value where the reference is finite",
                    "first_bad_index": list(_unravel(idx, r.shape))}
        diff = torch.where(fin, (c64 - r64).abs(), torch.zeros_like(r64))
        close = torch.isclose(c64, r64, atol=atol, rtol=rtol, equal_nan=True)
        ref_norm = float(torch.linalg.vector_norm(torch.where(fin, r64, torch.zeros_like(r64))))
        rel_l2 = float(torch.linalg.vector_norm(diff)) / ref_norm if ref_norm > 1e-12 else 0.0
        mae = float(diff.max()) if diff.numel() else 0.0
        mre = float((diff / r64.abs().clamp_min(1e-6)).max()) if diff.numel() else 0.0
        res = {**res, "max_abs_err": max(mae, res["max_abs_err"] or 0.0),
               "max_rel_err": max(mre, res["max_rel_err"] or 0.0), "rel_l2": max(rel_l2, res["rel_l2"] or 0.0)}
        if not bool(close.all()):
            idx = int((~close).flatten().nonzero()[0])
            return {**res, "first_bad_index": list(_unravel(idx, r.shape)),
                    "reason": f"{where}not allclose(atol={atol}, rtol={rtol}): max abs err {mae:.3g}"}
        if rel_l2 > rtol:
            return {**res, "reason": f"{where}relative L2 error {rel_l2:.3g} > rtol {rtol}"}
    return {**res, "ok": True}


def _unravel(idx: int, shape) -> tuple:
    out = []
    for s in reversed(tuple(shape)):
        out.append(idx % s)
        idx //= s
    return tuple(reversed(out))


# ----------------------------------------------------------------------------- tasks, baselines
def _read_task(src_or_path: str) -> str:
    if "\n" not in src_or_path and os.path.isfile(src_or_path):
        with open(src_or_path) as f:
            return f.read()
    if "\n" not in src_or_path and src_or_path.endswith(".py"):
        raise TaskError(f"task file not found: {src_or_path}")
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
    idx = (_visible(gpu) or "0").split(",")[0]
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
               gpu: int | None = None, warm: bool = False) -> dict:
    """Run the reference child; returns its result dict or raises TaskError. `warm`: only compile (prewarm)."""
    jobdir = _new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir)
        with open(os.path.join(wdir, "task.py"), "w") as f:
            f.write(task_src)
        inductor = os.path.join(os.path.expanduser(cfg.cache_dir), "inductor")
        os.makedirs(inductor, exist_ok=True)
        job = {"kind": "reference", "task_path": os.path.join(wdir, "task.py"), "device": cfg.device,
               "seeds": seeds, "timing_seed": seeds[0] if seeds else cfg.seed, "init_seed": cfg.seed,
               "baselines": want_baselines, "precision": _precision(cfg),
               "warmup": cfg.warmup, "iters": cfg.iters, "warm": warm}
        env = {"TORCHINDUCTOR_CACHE_DIR": inductor}
        if warm:  # prewarm runs many children at once: one compile thread each, no worker pool per child
            env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        r = run_child(job, jobdir, device=cfg.device, timeout_s=cfg.run_timeout_s + (cfg.compile_timeout_s if
                      want_baselines or warm else 0), mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, writable=(inductor,),
                      env=env)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if r.result is None:
        raise TaskError(f"reference run failed: {r.error}")
    if r.result.get("task_error"):
        raise TaskError(r.result["task_error"])
    return r.result


def _baseline_entry(res: dict, precision: str, device: str) -> dict:
    b = res["baselines"]
    return {"eager_ms": b["eager"]["median_ms"], "eager_cv": b["eager"]["cv"],
            "compile_ms": b["compile"]["median_ms"] if b.get("compile") else None,
            "compile_error": b.get("compile_error"), "precision": precision, "device": device}


def baselines(task: str, cfg: SandboxConfig, gpu: int | None = None) -> dict:
    """{"eager_ms", "compile_ms", "precision", "device"} of the task; cached per (task, device, torch, precision)."""
    src = _read_task(task)
    prec, dev = _precision(cfg), _device_name(cfg.device, gpu)
    key = f"{hashlib.sha256(src.encode()).hexdigest()}|{dev}|{prec}"
    hit = _baseline_cache(cfg, key)
    if hit:
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


def _solution(solution: str) -> tuple[str, str | None]:
    """("b", workspace) | ("a", source)."""
    if "\n" not in solution and os.path.isdir(solution):
        return "b", solution
    if "\n" not in solution and solution.endswith(".py") and os.path.isfile(solution):
        with open(solution) as f:
            return "a", f.read()
    return "a", solution


def _check(task, solution, cfg, compile_gate, device_gate) -> Verdict:
    src = _read_task(task)
    v = Verdict(precision=_precision(cfg), device=cfg.device, timings={"isolation": isolation()})
    try:
        _run_check(src, solution, cfg, v, compile_gate, device_gate)
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - a host bug must still become a verdict, never a crash
        v.error = f"sandbox internal error: {type(e).__name__}: {e}"[:400]
        v.correct = False
    if v.error or v.violation:
        v.correct = False
    v.reward = reward_mod.reward_from_verdict(v.to_dict(), cfg.reward)
    return v


def _prepare(form: str, sol, cfg: SandboxConfig, v: Verdict, compile_gate, wdir: str) -> str | None:
    """Compile (form b) and copy the candidate into wdir; returns the candidate path, or None on failure."""
    if form == "b":
        if not os.path.isfile(os.path.join(sol, "model_new.py")):
            v.error = "workspace has no model_new.py"
            return None
        v.stage = "compile"
        with compile_gate():
            ok, v.compile_log, sos = compile_workspace(sol, cfg)
        if not ok:
            v.error = "compile failed: " + (_last_line(v.compile_log.split("\n")[0]) or "see compile_log")
            return None
        shutil.copytree(sol, wdir, symlinks=True,  # links stay links: no host file is copied in through them
                        ignore=shutil.ignore_patterns("*.so", "__pycache__", ".git"), dirs_exist_ok=True)
        for name, so in sos.items():
            shutil.copy(so, os.path.join(wdir, "kernels", f"{name}.so"))
        sources = [os.path.join(wdir, f) for f in os.listdir(wdir) if f.endswith(".py") and f != "model.py"]
        path = os.path.join(wdir, "model_new.py")
    else:
        path = os.path.join(wdir, "solution.py")
        with open(path, "w") as f:
            f.write(sol)
        sources = [path]
    v.compiled = True
    for p in sources:
        with open(p) as f:
            extra = tuple(m.strip() for m in cfg.allow_imports.split(",") if m.strip())
            v.violation = v.violation or (static_scan(f.read(), extra) if cfg.static_scan else None)
    if v.violation:
        v.stage = "verify"
        return None
    return path


def _run_check(src: str, solution: str, cfg: SandboxConfig, v: Verdict, compile_gate, device_gate):
    form, sol = _solution(solution)
    jobdir = _new_jobdir()
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
            t_ref = time.perf_counter()
            ref, seeds, final_seed = _reference_pool(src, cfg, cfg.profile and base is None, gpu, dev)
            t_cand = time.perf_counter()
            v.device = ref["device_name"]
            if cfg.profile and base is None:
                base = _baseline_cache(cfg, key, _baseline_entry(ref, v.precision, v.device))
            import torch
            torch.save(ref["state_dict"], os.path.join(wdir, "state_dict.pt"))
            r = _run_candidate(form, cand, wdir, jobdir, seeds, final_seed, cfg, gpu, src)
            v.timings.update({"reference_s": round(t_cand - t_ref, 3),  # where a check's time goes
                              "candidate_s": round(time.perf_counter() - t_cand, 3)})
        _judge(r, ref, base, seeds, final_seed, cfg, v, form)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


REF_POOL_EXTRA = 4      # a reference pool holds n_trials + 1 + this many seeds
REF_POOL_MAX_USES = 50  # checks served by one pool before it is recomputed (0: a fresh reference per check)
REF_POOL_MAX_MB = 2048  # pools whose outputs are larger than this are not kept (KernelBench L1: up to ~60 GB)
REF_POOL_TOTAL_MB = 8192  # host RAM for all kept pools; the oldest are dropped beyond it
_REF_POOLS: dict = {}
_REF_LOCK = threading.Lock()


def _reference_pool(src: str, cfg: SandboxConfig, want_baselines: bool, gpu, dev: str) -> tuple[dict, list, int]:
    """Reference outputs + (trial seeds, final seed) for one check.

    Seeds are random (host-private RNG), never derived from anything the candidate sees. The reference
    child's outputs for a small pool of seeds are reused for up to REF_POOL_MAX_USES checks of the same
    task (each check draws its own random subset), which halves the processes per check. A candidate
    cannot exploit the reuse: it never sees reference outputs and keeps no state between checks.
    """
    key = (hashlib.sha256(src.encode()).hexdigest(), cfg.device, dev, cfg.seed, cfg.n_trials)
    need = cfg.n_trials + 1
    with _REF_LOCK:
        entry = _REF_POOLS.get(key)
        if entry and entry["uses"] < REF_POOL_MAX_USES and not want_baselines:
            entry["uses"] += 1
            ref = entry["ref"]
        else:
            ref = None
    if ref is None:
        rng = random.Random(f"{cfg.seed}:{secrets.token_hex(8)}")  # per-pool salt: no precomputed answers
        pool = rng.sample(range(2**31), need + (REF_POOL_EXTRA if REF_POOL_MAX_USES > 0 else 0))
        ref = _reference(src, cfg, pool, want_baselines, gpu)
        mb = sum(t.numel() * t.element_size() for outs in ref["outputs"].values() for t in outs) / 2**20
        if REF_POOL_MAX_USES > 0 and mb <= REF_POOL_MAX_MB:
            with _REF_LOCK:
                _REF_POOLS[key] = {"ref": {k: v for k, v in ref.items() if k != "baselines"}, "uses": 1, "mb": mb}
                while len(_REF_POOLS) > 1 and sum(e["mb"] for e in _REF_POOLS.values()) > REF_POOL_TOTAL_MB:
                    _REF_POOLS.pop(next(iter(_REF_POOLS)))
    picked = secrets.SystemRandom().sample(sorted(ref["outputs"]), need)
    return ref, picked[:-1], picked[-1]  # the final seed reaches the candidate only once timing started


def _run_candidate(form, cand, wdir, jobdir, seeds, final_seed, cfg, gpu, src) -> ChildResult:
    writable, env, timeout = [], {}, cfg.run_timeout_s
    if form == "a":  # load_inline builds inside the child; cache them per solution source
        ext = os.path.join(os.path.expanduser(cfg.cache_dir), "torch_ext",
                           hashlib.sha256(open(cand).read().encode()).hexdigest()[:16])
        os.makedirs(ext, exist_ok=True)
        writable, env, timeout = [ext], {"TORCH_EXTENSIONS_DIR": ext}, timeout + cfg.compile_timeout_s
    kernels = {}
    if os.path.isdir(os.path.join(wdir, "kernels")):
        kernels = {f[:-3]: os.path.join(wdir, "kernels", f) for f in os.listdir(os.path.join(wdir, "kernels"))
                   if f.endswith(".so")}
    job = {"kind": "candidate", "task_path": os.path.join(wdir, "task.py"), "cand_path": cand, "cand_dir": wdir,
           "device": cfg.device, "seeds": seeds, "init_seed": cfg.seed, "kernels": kernels,
           "state_dict_path": os.path.join(wdir, "state_dict.pt"), "precision": _precision(cfg),
           "profile": cfg.profile, "warmup": cfg.warmup, "iters": max(cfg.iters, 1),
           "timing_seed": secrets.randbelow(2**31),
           "mem_limit_mb": cfg.mem_limit_mb}

    def on_msg(msg, control):
        if msg.get("type") == "timing_start":
            control.write(json.dumps({"final_seed": final_seed}) + "\n")
            control.flush()
    return run_child(job, jobdir, device=cfg.device, timeout_s=timeout, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu,
                     writable=tuple(writable), hide=(os.path.expanduser(cfg.cache_dir),), env=env, on_msg=on_msg)


def _judge(r: ChildResult, ref: dict, base: dict | None, seeds, final_seed, cfg, v: Verdict, form: str):
    """Turn the candidate child's report into the verdict (host-side comparison)."""
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("USDT:"))  # profiler noise
    v.timings["candidate_phases"] = r.phases()  # e.g. verify_at_s: torch import + CUDA init + candidate load
    v.timings["log"] = (err[-1500:] + ("\n[stdout]\n" + r.stdout[-500:] if r.stdout.strip() else "")).strip()
    if r.result is None:
        v.stage, v.error = r.stage or "load", f"candidate {r.error}"
        return
    res = r.result
    v.stage = res.get("stage", "load")
    if form == "a" and "Error building extension" in (res.get("error") or "") + r.stderr:
        v.compiled, v.compile_log = False, _trim_log(r.stderr, False)
    if res.get("error") or res.get("violation"):
        v.error, v.violation = res.get("error"), res.get("violation")
        return
    bad = [n for n in res.get("profiler_ops", []) if n[6:] not in _ALLOWED_OPS]  # host's own allow-list
    if bad:
        v.violation = f"aten op {bad[0]} seen by the profiler inside forward"
        return
    cand, kind = res.get("trials") or {}, res.get("out_kind")
    for s in seeds:
        if s not in cand:
            t = {"ok": False, "reason": "missing trial output"}
        elif kind != ref["out_kind"]:
            t = {"ok": False, "reason": f"returned a {kind}, the reference returns a {ref['out_kind']}"}
        else:
            t = compare(ref["outputs"][s], cand[s], res.get("devices"), cfg.device, cfg.atol, cfg.rtol)
        v.trials.append({"seed": s, **t})
    bad = next((t for t in v.trials if not t["ok"]), None)
    if bad:
        v.error = f"incorrect on trial seed {bad['seed']}: {bad['reason']}"
        return
    v.correct = True
    if not cfg.profile:
        v.stage = "done"
        return
    if res.get("final_seed") != final_seed or "final" not in res:
        v.correct, v.violation = False, "timing protocol broken (final output missing)"
        return
    t = compare(ref["outputs"][final_seed], res["final"], res.get("devices"), cfg.device, cfg.atol, cfg.rtol) \
        if res.get("final_kind") == ref["out_kind"] else {"ok": False, "reason": "output kind changed"}
    v.trials.append({"seed": final_seed, **t, "reason": t["reason"] and f"post-timing: {t['reason']}"})
    if not t["ok"]:
        v.correct, v.error = False, f"incorrect on the post-timing check (fresh seed): {t['reason']}"
        return
    _timing(r, res, base, v)


def _timing(r: ChildResult, res: dict, base: dict, v: Verdict):
    tm = res["timing"]
    t0 = next((t for t, m in r.messages if m.get("type") == "timing_start"), None)
    t1 = next((t for t, m in r.messages if m.get("type") == "timing_end"), None)
    host_ms = (t1 - t0) * 1e3 if t0 and t1 else None
    v.timings.update({"cand_cv": tm["cv"], "n_iters": tm["n_iters"], "host_wall_ms": host_ms,
                      "child_phase_ms": res["phase_ms"], "eager_cv": base.get("eager_cv"),
                      "compile_error": base.get("compile_error")})
    # the child's clock must agree with the host's around the timing phase (patched timers)
    if host_ms is None or res["phase_ms"] < host_ms - max(0.25 * host_ms, 50.0) or \
            tm["sum_ms"] > res["phase_ms"] * 1.01 + 1.0:
        v.correct, v.violation = False, (f"timer mismatch: host saw {host_ms and round(host_ms, 1)} ms, child "
                                         f"reported {res['phase_ms']:.1f} ms (sum of iters {tm['sum_ms']:.1f} ms)")
        return
    v.candidate_ms, v.eager_ms, v.compile_ms = tm["median_ms"], base["eager_ms"], base["compile_ms"]
    if v.candidate_ms > 0:
        v.speedup_eager = v.eager_ms / v.candidate_ms
        v.speedup_compile = v.compile_ms / v.candidate_ms if v.compile_ms else None
    v.stage = "done"


# ----------------------------------------------------------------------------- generic isolated call, pool
def run_isolated(fn: str, args: dict, cfg: SandboxConfig, timeout_s: float, device: str = "cpu",
                 env: dict | None = None) -> tuple[bool, object, str]:
    """Run `module:function`(**args) in a sandbox child; the result must be plain data (dict/list/str/
    numbers/tensors: it is read with torch.load(weights_only=True)). Returns (ok, result, error)."""
    import pickle
    jobdir = _new_jobdir()
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
