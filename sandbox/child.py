"""Isolation and the child runner of the sandbox: every compile, reference and candidate job is one child
process started here, inside bubblewrap (or a weaker fallback), with wall-clock and memory limits, and read
back through a nonce-framed result channel. sandbox/core.py decides what runs; this file decides how.

A child that never reports (the interpreter or the worker cannot start, a broken wrapper) raises
SandboxError: the sandbox's failure, never a candidate's verdict.

Smoke: python -m pytest tests/test_sandbox.py -q -k "probe or start or isolation"
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import math
import os
import resource
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from .harness import wire

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "sandbox_worker.py")
# the modules the worker imports (by flat name, from its own directory): bound beside it when the repository
# is hidden
HARNESS_FILES = tuple(os.path.join(os.path.dirname(WORKER), f"{m}.py")
                      for m in ("inline", "measure", "wire", "share", "driver", "rules"))
GUARD: str | None = None  # the dispatch guard's .so, set by sandbox.build.guard_library; loaded by the worker
PYCACHE: str | None = None  # the trusted bytecode cache, set by sandbox.build.bytecode_cache; read-only in children


class SandboxError(Exception):
    """The sandbox itself failed (a child that cannot start, no GPU for --sandbox.device cuda): not the
    candidate's fault, so never a verdict or a reward; callers stop with str(e), one line."""


_ROOT: str | None = None
_ROOT_LOCK = threading.Lock()
_ISOLATION: str | None = None
_ISOLATION_LOCK = threading.Lock()
PASS_ENV = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "PYTHONPATH", "VIRTUAL_ENV",
            "CC", "CXX", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_CUDA_ARCH_LIST", "CUDA_AGENT_ARCH")


def root() -> str:
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
            probe = [sys.executable, WORKER, "--probe"]  # the real interpreter and worker, as a job runs them
            wdir = tempfile.mkdtemp(dir=root())
            probes = [("bwrap", bwrap_argv(probe, wdir, "cpu", [], [])),
                      ("unshare", ["unshare", "--net", "--map-root-user", *probe])]
            level = "rlimits"
            for name, cmd in probes:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    r = subprocess.run(cmd, capture_output=True, timeout=60) if shutil.which(cmd[0]) else None
                    if r is not None and r.returncode == 0 and b"sandbox_worker ok" in r.stdout:
                        level = name
                        break
            shutil.rmtree(wdir, ignore_errors=True)
            _ISOLATION = level  # published only once the probe is finished
        return _ISOLATION


HARNESS_DIR = "/tmp/.harness"  # where a child sees the worker script when the repository is hidden
PYCACHE_SEEN = os.path.join(HARNESS_DIR, "bytecode")  # where a bubblewrap child sees PYCACHE


def guard_seen(level: str) -> str:
    """Where a worker child finds the dispatch guard (CUDA_AGENT_GUARD)."""
    return os.path.join(HARNESS_DIR, "sandbox_guard.so") if level == "bwrap" else GUARD or ""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(WORKER)))  # the repository: hidden from children
_UNHIDEABLE = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/dev", "/proc", "/sys", "/run", "/tmp")


def hidden(cfg, ws: str | None = None) -> tuple[str, ...]:
    """What a compile or candidate child must not see: the cache dir (baseline times, other kernels), the
    repository (the harness, demo solutions, tests) and, for a workspace, its parent (other episodes')."""
    out = [os.path.expanduser(cfg.cache_dir), REPO]
    return tuple(out + ([os.path.dirname(os.path.realpath(ws))] if ws else []))


_SYSTEM = _UNHIDEABLE + ("/lib32", "/libx32", "/nix", "/gnu")  # what a candidate child still sees of `/`


def hidden_candidate(cfg, ws: str | None = None) -> tuple[str, ...]:
    """What a candidate child must not see: every top-level directory but the system's (it runs from a
    private copy of its files and needs nothing of the host's but the interpreter and libraries, which
    `_needed` binds back), plus `hidden(cfg, ws)`. The workspace's parent is listed only where the rest does
    not already hide it, so a warm spare started before its workspace was known hides it too."""
    top = [os.path.join("/", d) for d in sorted(os.listdir("/"))]
    top = [d for d in top if d not in _SYSTEM and os.path.isdir(d) and not os.path.islink(d)]
    inside = lambda p: any(p == d or p.startswith(d + os.sep) for d in top + ["/tmp"])  # noqa: E731
    return tuple(top) + tuple(h for h in hidden(cfg, ws) if h in hidden(cfg) or not inside(h))


def _needed() -> set[str]:
    """Host dirs a child runs from: the interpreter's prefixes (a venv), site-packages on sys.path, the CUDA
    toolkit, LD_LIBRARY_PATH. Bound back read-only when a hidden dir holds them."""
    need = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.environ.get("CUDA_HOME", ""),
            os.environ.get("CUDA_PATH", "")}
    need |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") or p.endswith(".zip")}
    need |= {p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p}
    nvcc = shutil.which("nvcc")
    if nvcc:  # e.g. /usr/local/cuda-13.0/bin/nvcc -> /usr/local/cuda-13.0 (through a wrapper: CUDA_HOME)
        need.add(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    return {os.path.realpath(p) for p in need if p and os.path.exists(p)}


def _wrap(cmd: list[str], wdir: str, device: str, writable: list[str], hide: list[str], mem_limit_mb: int,
          share_pid: bool) -> list[str]:
    """Prefix `cmd` with the isolation: only `wdir` and `writable` are writable; `hide` is invisible (empty
    tmpfs), except what the child runs from (`_needed`) and the worker script, which then appears at
    HARNESS_DIR (`cmd` is rewritten to it; `from sandbox_worker import ...` still works: the worker
    registers itself). Pass `_hidden(cfg, ws)` for compile and candidate children."""
    level = isolation()
    if level == "unshare":
        return ["unshare", "--net", "--map-root-user", *cmd]
    if level == "rlimits":
        return cmd
    return bwrap_argv(cmd, wdir, device, writable, hide, mem_limit_mb=mem_limit_mb, share_pid=share_pid)


def bwrap_argv(cmd: list[str], wdir: str, device: str, writable: list, hide: list[str], ro_binds: tuple = (),
               setenv: dict | None = None, mem_limit_mb: int = 8192, share_pid: bool = False) -> list[str]:
    """The bubblewrap command line of every sandboxed process (jobs here, the agent's bash tool in tools.py):
    read-only `/`, private /tmp and /dev/shm of capped size (`tmpfs_caps`), `hide` invisible (empty read-only
    tmpfs), `wdir` and `writable` writable, `ro_binds` read-only over them, no network, own namespaces; `cmd`
    last (empty: the caller appends it). `share_pid` keeps the host's PID namespace (and /proc): a check's
    driver, which stops and continues the computing child, and runs no candidate code."""
    runs_worker, args = WORKER in cmd, ["bwrap", "--ro-bind", "/", "/"]
    args += ["--dev-bind", "/dev", "/dev"] if device == "cuda" else ["--dev", "/dev"]
    tmp_mb, shm_mb = tmpfs_caps(mem_limit_mb)
    # the driver sees the host's /proc (to stop and continue the computing child); CUDA fails to start (error 304)
    # with it read-only. The driver runs no candidate code
    args += ["--bind", "/proc", "/proc"] if share_pid else ["--proc", "/proc"]
    args += ["--size", str(tmp_mb << 20), "--tmpfs", "/tmp", "--size", str(shm_mb << 20), "--tmpfs", "/dev/shm"]
    hidden = [h for h in dict.fromkeys(os.path.realpath(os.path.expanduser(x)) for x in [root(), *hide])
              if h not in _UNHIDEABLE and (os.path.isdir(h) or h.startswith("/tmp/"))]
    inside = lambda p, d: p.startswith(d + os.sep)  # noqa: E731 - strictly below
    named = hidden  # everything named hidden, the repository among them when the caller hides it
    hidden = [h for h in hidden if not any(inside(h, o) for o in hidden)]  # below another: hidden with it
    args += [a for h in hidden for a in ("--size", str(1 << 20), "--tmpfs", h)]  # after /tmp: mount points
    masked = hidden + ["/tmp", "/dev/shm"]  # the private /tmp also hides an interpreter or a repo kept there
    back = sorted(p for p in _needed() if any(inside(p, h) for h in masked))
    args += [a for p in back for a in ("--ro-bind", p, p)]
    still = [h for h in hidden if any(inside(h, p) for p in back)]
    args += [a for h in still for a in ("--size", str(1 << 20), "--tmpfs", h)]  # still hidden
    repo = os.path.realpath(REPO)
    if repo not in named and any(inside(repo, m) for m in masked):  # reference and call children import it
        args += ["--ro-bind", repo, repo]
    elif any(inside(os.path.realpath(WORKER), m) for m in masked):
        for f in (WORKER, *HARNESS_FILES):  # the worker and the modules it imports, side by side
            args += ["--ro-bind", os.path.realpath(f), os.path.join(HARNESS_DIR, os.path.basename(f))]
        shown = os.path.join(HARNESS_DIR, os.path.basename(WORKER))
        cmd = [shown if c == WORKER else c for c in cmd]
    if GUARD and runs_worker:  # the cache dir that holds it is hidden from candidates
        args += ["--ro-bind", GUARD, guard_seen("bwrap")]
    if PYCACHE and runs_worker:  # likewise; read-only, so no child can plant bytecode a later child runs
        args += ["--ro-bind", PYCACHE, PYCACHE_SEEN]
    for w in [wdir, *writable]:  # binds come last so that the tmpfs mounts above do not hide them
        src, dst = w if isinstance(w, tuple) else (w, w)  # (host dir, where the child sees it)
        args += ["--bind", src, dst]
    args += [a for p in ro_binds for a in ("--ro-bind", p, p)]
    # hidden directories hold nothing and take nothing: a writable tmpfs there would be host memory that no
    # process's RSS shows (binds inside them, made above, keep their own flags)
    args += [a for h in dict.fromkeys(hidden + still) for a in ("--remount-ro", h)]
    args += [a for k, v in (setenv or {}).items() for a in ("--setenv", k, v)]
    unshare = ["--unshare-user", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"] \
        if share_pid else ["--unshare-all"]
    return args + [*unshare, "--die-with-parent", "--new-session", "--chdir", wdir, *cmd]


def tmpfs_caps(mem_limit_mb: int) -> tuple[int, int]:
    """MB of a child's private /tmp and /dev/shm: tmpfs pages are in no process's RSS, so each mount is capped
    and what it holds is counted with the RSS against the memory limit (`Child.run`)."""
    return max(64, min(mem_limit_mb // 2, 4096)), max(16, min(mem_limit_mb // 4, 1024))


def _proc_tree(pid: int) -> list[int]:
    """pid and all its descendants, by each thread's /proc children list (an orphan is re-parented to the
    sandbox's own init, which is in the tree). Read every few polls while a job runs, holding the GIL: a
    scan of all of /proc took ~25 ms a time on a loaded host and delayed the replies to the child."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for t in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError, ValueError):
                    with open(f"/proc/{p}/task/{t}/children") as f:
                        todo += [int(c) for c in f.read().split()]
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
        return phases(self.messages, self.started)


def phases(messages: list, started: float) -> dict:
    """Seconds from `started` to each first stage/timing message and to the result (where a check's time goes);
    `messages` holds (host monotonic time, message) pairs."""
    out, seen = {}, set()
    for t, m in messages:
        name = m.get("stage") if m.get("type") == "stage" else m.get("type")
        if name and name not in seen:
            seen.add(name)
            out[f"{name}_at_s"] = round(t - started, 3)
    return out


def _reader(fd: int, nonce: bytes, out: list, on_msg, state: dict, max_msgs: int = 100_000):
    """Read nonce-framed messages (wire.Channel) until EOF; a bad frame, a message over
    state["max_msg_bytes"] (head and tensors together) or too many messages mark the channel corrupt. Each message is
    handed to `on_msg` and then only its small fields are kept (tensors under "outs" are dropped), so the
    host holds at most one message's payload at a time. Tensors are read straight into their own storage."""
    import torch
    with os.fdopen(fd, "rb", buffering=0) as f:
        def read_into(view) -> bool:
            while len(view):
                n = f.readinto(view[:1 << 24])
                if not n:
                    return False
                view = view[n:]
            return True

        def frame(limit: int | None) -> int | None:  # the next frame's length, or None at EOF / a bad frame
            head = bytearray(24)
            if not read_into(memoryview(head)):
                return None
            if bytes(head[:16]) != nonce:
                state["corrupt"] = "bad frame on the result channel"
                return None
            n = struct.unpack(">Q", head[16:])[0]
            if limit is None:  # a message's first frame: the limit as it is now (a warm child gets its job's
                limit = state["max_msg_bytes"]  # limit while this thread already waits for that frame)
            if n > limit:  # the host's memory is not the candidate's to fill
                cap = state["max_msg_bytes"] >> 20
                state["corrupt"] = f"a result message of {n >> 20} MB exceeds the {cap} MB limit"
                return None
            return n
        for _ in range(max_msgs):
            n = frame(None)
            if n is None:
                return
            max_msg_bytes = state["max_msg_bytes"]
            body = bytearray(n)
            try:
                assert read_into(memoryview(body))
                head = json.loads(body)
                assert isinstance(head, dict) and "type" in head
                specs = wire.tensor_specs(head)
                left = max_msg_bytes - n
                tensors = []
                for dt, shape in specs:
                    dtype = getattr(torch, dt)
                    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                    m = frame(left)
                    if m is None or m != size:
                        state.setdefault("corrupt", "a tensor frame does not match its spec")
                        return
                    left -= m
                    raw = torch.empty(m, dtype=torch.uint8)
                    assert read_into(memoryview(raw.numpy()))
                    tensors.append(raw.view(dtype).reshape(shape))
                msg = wire.decode(head, tensors)
            except Exception as e:  # noqa: BLE001 - anything but the plain format is refused
                state["corrupt"] = f"unreadable result message ({type(e).__name__})"
                return
            del body, tensors
            t = time.monotonic()
            on_msg(msg)
            out.append((t, {k: v for k, v in msg.items() if k != "outs"}))
        state["corrupt"] = f"more than {max_msgs} result messages"


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


_LIVE: set = set()  # every started child not yet reaped: kill_all() ends them (Ctrl-C)
_LIVE_LOCK = threading.Lock()
_REAPING: dict = {}  # gpu -> threads reaping children killed after their result (Child.run)


def settle(gpu: int | None, timeout_s: float = 30.0):
    """Wait until every child that ran on `gpu` has exited: nothing of a finished job may still be tearing
    down on the device while a later job is timed there."""
    with _LIVE_LOCK:
        reapers = list(_REAPING.get(gpu, ()))
    for t in reapers:
        t.join(timeout_s)


def kill_all() -> int:
    """Kill every sandbox child of this process (and its tree) now; returns how many. For Ctrl-C handlers:
    children are started with setsid, so the terminal's SIGINT never reaches them."""
    with _LIVE_LOCK:
        live = list(_LIVE)
        _LIVE.clear()
    for c in live:
        with contextlib.suppress(Exception):
            _kill_tree(c.proc)
    return len(live)


def interruptible(main):
    """Run `main()`; on Ctrl-C kill every sandbox child, print one line and exit 130 at once (worker threads
    still inside a check are not waited for; files already written, checkpoints included, stay)."""
    try:
        return main()
    except KeyboardInterrupt:
        n = kill_all()
        if _ROOT:
            shutil.rmtree(_ROOT, ignore_errors=True)
        print(f"interrupted{f' (killed {n} sandbox children)' if n else ''}", file=sys.stderr, flush=True)
        os._exit(130)


class Child:
    """One sandboxed child process and its channel. `Child(...)` starts it; `run(job)` hands it its job and
    collects its messages until it exits (a ChildResult). With `job=None` at start the child is WARM: the
    worker imports torch, brings CUDA up and warms its checks, then waits on the control pipe for the job,
    so a check does not pay the start-up (sandbox/core.py keeps spares per device). One job per child, always; a
    long-lived job (a check's driver) is driven with `start`, `send` and `watch` instead of `run`.

    Besides the result pipe (child -> host) and the control pipe (host -> child), a worker holds one end of a
    unix socket (`fd_sock`) over which file descriptors travel: the driver's shared regions and the link
    between a driver and the child that computes. Limits while it runs: the wall clock, memory (the RSS of its
    process tree plus what its private /tmp and /dev/shm hold), and `disk_limit_mb` over its job dir and
    `disk_dirs` (what a compile or build writes)."""

    def __init__(self, jobdir: str, *, device: str, mem_limit_mb: int, gpu: int | None = None, writable: tuple = (),
                 hide: tuple = (), env: dict | None = None, cmd: list[str] | None = None, max_msg_mb: int = 64,
                 job: dict | None = None, on_msg=None, warm_for: str = "candidate", share_pid: bool = False,
                 disk_limit_mb: int | None = None, disk_dirs: tuple = ()):
        self.jobdir, self.device, self.mem_limit_mb, self.on_msg = jobdir, device, mem_limit_mb, on_msg
        self.gpu, self.disk_limit_mb = gpu, disk_limit_mb
        self.wdir = os.path.join(jobdir, "w")
        self.disk_dirs = (self.wdir, *disk_dirs)
        os.makedirs(self.wdir, exist_ok=True)
        self.warm, self.is_worker = job is None and cmd is None, cmd is None
        nonce = secrets.token_bytes(16)
        rfd, wfd = os.pipe()
        crfd, cwfd = os.pipe()
        self.fd_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.state = {"max_msg_bytes": max_msg_mb << 20}
        with contextlib.suppress(OSError):  # 1 MiB instead of 64 KiB: fewer wake-ups for a large message
            fcntl.fcntl(wfd, fcntl.F_SETPIPE_SZ, 1 << 20)
        with open(os.path.join(self.wdir, "job.json"), "w") as f:  # no seed, plan or nonce: fds and kind only
            json.dump({**(job or {"kind": "warm", "device": device, "for": warm_for}), "result_fd": wfd,
                       "control_fd": crfd, "fd_sock": child_sock.fileno()}, f)
        child_env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        child_env.update({"HOME": self.wdir, "TMPDIR": "/tmp" if isolation() == "bwrap" else self.wdir,
                          "PYTHONDONTWRITEBYTECODE": "1", "CUDA_AGENT_GUARD": guard_seen(isolation()),
                          **(env or {})})
        if PYCACHE and self.is_worker and isolation() == "bwrap":  # compiled once, not in every child
            child_env["PYTHONPYCACHEPREFIX"] = PYCACHE_SEEN
        child_env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu) if device == "cuda" else ""  # cpu: no GPU
        cmd = cmd or [sys.executable, WORKER, os.path.join(self.wdir, "job.json")]
        full = _wrap(cmd, self.wdir, device, list(writable), list(hide), mem_limit_mb, share_pid)
        self.out_f = open(os.path.join(jobdir, "stdout"), "w+b")
        self.err_f = open(os.path.join(jobdir, "stderr"), "w+b")
        self.msgs = []
        self.control = os.fdopen(cwfd, "w")
        self.t_started, self.startup = time.monotonic(), None
        try:
            self.proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=self.out_f, stderr=self.err_f,
                                         env=child_env, cwd=self.wdir, pass_fds=(wfd, crfd, child_sock.fileno()),
                                         start_new_session=True,
                                         preexec_fn=_limits(mem_limit_mb + 4096 if device == "cpu" else None))
        finally:
            os.close(wfd)
            os.close(crfd)
            child_sock.close()
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._send({"nonce": nonce.hex()})  # the worker reads this line before anything else
        self.reader = threading.Thread(target=_reader, args=(rfd, nonce, self.msgs, self._handle, self.state),
                                       daemon=True)
        self.reader.start()

    def _handle(self, msg):
        if self.on_msg:
            self.on_msg(msg, self.control)

    def _send(self, obj: dict):
        with contextlib.suppress(OSError, ValueError):
            self.control.write(json.dumps(obj) + "\n")
            self.control.flush()

    send = _send

    def send_fds(self, obj: dict, fds: list[int]):
        """`obj` and the file descriptors `fds` to the child (it reads them with wire.recv_fds)."""
        socket.send_fds(self.fd_sock, [json.dumps(obj).encode()], fds)

    def recv_fds(self, timeout_s: float, max_fds: int = 16) -> tuple[dict, list[int]] | None:
        self.fd_sock.settimeout(timeout_s)
        try:
            data, fds, _, _ = socket.recv_fds(self.fd_sock, 1 << 16, max_fds)
        except (OSError, TimeoutError):
            return None
        return (json.loads(data) if data else {}), list(fds)

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.state.get("corrupt")

    def stderr_tail(self, n: int = 2000) -> str:
        """The end of what the child has written to stderr so far (its file stays open)."""
        with contextlib.suppress(OSError), open(self.err_f.name, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode(errors="replace")
        return ""

    def kill(self):
        _kill_tree(self.proc)
        self.proc.wait()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        for f in (self.out_f, self.err_f, self.control, self.fd_sock):
            with contextlib.suppress(OSError, ValueError):
                f.close()

    def _reap(self):
        self.proc.wait()
        with _LIVE_LOCK:
            _LIVE.discard(self)
            _REAPING.get(self.gpu, set()).discard(threading.current_thread())

    def start(self, job: dict, on_msg=None, max_msg_mb: int | None = None):
        """Hand a warm child its job (a cold one has it already)."""
        self.on_msg = on_msg or self.on_msg
        if max_msg_mb is not None:
            self.state["max_msg_bytes"] = max_msg_mb << 20
        self.started_before = bool(self.msgs)  # a warm child has reported before any candidate code exists in it
        if self.warm:
            self.startup = {**phases(self.msgs, self.t_started),
                            "job_at_s": round(time.monotonic() - self.t_started, 3)}  # a spare's start-up
            del self.msgs[:]
            self.t_started = time.monotonic()
            self._send({"job": job})
            self.warm = False

    def _used_mb(self, tree: list[int]) -> float:
        """What the child's private /tmp and /dev/shm hold, seen through one of its processes' root."""
        own = os.readlink("/proc/self/ns/mnt")
        for p in reversed(tree):
            try:
                if os.readlink(f"/proc/{p}/ns/mnt") == own:  # bwrap's own process: the host's mounts
                    continue
                mounts = [f"/proc/{p}/root{m}" for m in ("/tmp", "/dev/shm")]
                # a process still setting up its namespace sees the host's own /tmp (the root disk): not its own
                if any(os.stat(m).st_dev == os.stat(h).st_dev for m, h in zip(mounts, ("/tmp", "/dev/shm"))):
                    continue
                return sum((st.f_blocks - st.f_bfree) * st.f_frsize for st in map(os.statvfs, mounts)) / 2**20
            except OSError:
                continue
        return 0.0

    def _disk_mb(self) -> float:
        total = 0
        for d in self.disk_dirs:
            for dirpath, _, files in os.walk(d):
                for f in files:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
        return total / 2**20

    def watch(self, until, timeout_s: float) -> str | None:
        """Poll until `until()` holds or the child exits (None), or a limit is hit: the child is then killed
        and the reason returned. Limits: `timeout_s`, a corrupt channel, memory (RSS of the whole tree + its
        tmpfs mounts), disk."""
        proc, t_end, peak, tree, n = self.proc, time.monotonic() + timeout_s, 0.0, [self.proc.pid], 0
        why = None
        while proc.poll() is None and not until():
            if time.monotonic() > t_end:
                why = f"timed out after {timeout_s:.0f}s"
            elif self.state.get("corrupt"):  # the reader has stopped: nothing will answer the child any more
                why = self.state["corrupt"]
            else:
                if n % 5 == 0:  # the /proc scan is the costly part
                    tree = _proc_tree(proc.pid)
                    self.tmpfs_mb = self._used_mb(tree) if isolation() == "bwrap" else 0.0
                peak = max(peak, _rss_mb(tree) + getattr(self, "tmpfs_mb", 0.0))
                if peak > self.mem_limit_mb:
                    why = f"memory limit exceeded (RSS + tmpfs {peak:.0f} MB > {self.mem_limit_mb} MB)"
                elif self.disk_limit_mb and n % 20 == 0 and self._disk_mb() > self.disk_limit_mb:
                    why = f"disk limit exceeded (more than {self.disk_limit_mb} MB written)"
                n += 1
            if why:
                _kill_tree(proc)
                return why
            time.sleep(0.01 if self.warm else 0.05)
        if self.disk_limit_mb and self._disk_mb() > self.disk_limit_mb:  # written faster than the polls saw
            _kill_tree(proc)
            return f"disk limit exceeded (more than {self.disk_limit_mb} MB written)"
        return None

    def run(self, job: dict | None, timeout_s: float, on_msg=None, max_msg_mb: int | None = None) -> ChildResult:
        """Give a warm child `job` (a cold one has it already), then wait until it exits, killing it on the
        wall-clock limit, over the memory or disk limit, or on a corrupt channel."""
        if job is not None or self.warm:
            self.start(job, on_msg, max_msg_mb)
        else:
            self.on_msg = on_msg or self.on_msg
            self.started_before = False
        started = getattr(self, "started_before", False)
        answered = lambda: self.is_worker and bool(self.msgs) and self.msgs[-1][1].get("type") == "result"  # noqa: E731
        why = self.watch(answered, timeout_s)
        proc = self.proc
        if why is None and answered() and proc.poll() is None:
            # the worker's last message: its exit is not waited for. Killed now and reaped in the background: a
            # CUDA process's exit (context teardown) took ~0.2 s of every check on an H200; `settle` waits for it
            # before anything is timed
            _kill_tree(proc)
            reaper = threading.Thread(target=self._reap, daemon=True)
            with _LIVE_LOCK:
                _REAPING.setdefault(self.gpu, set()).add(reaper)
            reaper.start()
        else:
            proc.wait()
            with _LIVE_LOCK:
                _LIVE.discard(self)
            self.reader.join(timeout=10)
        for f in (self.control, self.fd_sock):
            with contextlib.suppress(OSError):
                f.close()
        rc, msgs, state = proc.returncode, self.msgs, self.state
        stdout, stderr = _tail(self.out_f), _tail(self.err_f)
        result = next((m for _, m in reversed(msgs) if m.get("type") == "result"), None)
        stage = next((m["stage"] for _, m in reversed(msgs) if m.get("type") == "stage" and m["stage"] != "started"),
                     None)
        if self.is_worker and not msgs and not started and not state.get("corrupt"):
            raise SandboxError(f"a sandbox child did not start: {why or _death_reason(rc, stderr)}")  # no
            # candidate code runs before the first message, so this is never the candidate's doing
        if why is None and state.get("corrupt"):
            why = state["corrupt"]
        if why is None and result is None and self.is_worker:
            why = _death_reason(rc, stderr)
        return ChildResult(result if why is None else None, msgs, why, stage, stdout, stderr, rc, self.t_started)


def run_child(job: dict, jobdir: str, *, device: str, timeout_s: float, mem_limit_mb: int, gpu: int | None = None,
              writable: tuple = (), hide: tuple = (), env: dict | None = None, on_msg=None,
              cmd: list[str] | None = None, max_msg_mb: int = 64, disk_limit_mb: int | None = None,
              disk_dirs: tuple = ()) -> ChildResult:
    """Run one sandboxed child (the worker with `job`, or `cmd`) and collect its messages (each at most
    `max_msg_mb`). The nonce that frames them goes down the control pipe, never into a file."""
    child = Child(jobdir, device=device, mem_limit_mb=mem_limit_mb, gpu=gpu, writable=writable, hide=hide, env=env,
                  cmd=cmd, max_msg_mb=max_msg_mb, job=job, on_msg=on_msg, disk_limit_mb=disk_limit_mb,
                  disk_dirs=disk_dirs)
    return child.run(None, timeout_s)


def visible_devices(gpu: int | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child pinned to pool index `gpu` (mapped through the host's own list)."""
    host = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is None:  # not pinned (plain check() outside a pool): the child sees what the host sees
        return host if host is not None else ",".join(str(i) for i in range(gpu_count()))
    ids = [x for x in host.split(",") if x.strip()] if host else None
    return ids[gpu] if ids else str(gpu)


def require_device(device: str):
    """SandboxError unless `device` can run here: "cpu", or "cuda" with at least one GPU listed by nvidia-smi
    (asked once, without CUDA: the host uses CUDA only to compare trial outputs, `SandboxConfig.compare_on`)."""
    if device == "cuda" and gpus_listed() == 0:
        raise SandboxError("--sandbox.device cuda, but no GPU is visible (nvidia-smi lists none); "
                           "use --sandbox.device cpu")


_LISTED: list = []


def gpus_listed() -> int:
    if not _LISTED:
        n = 0
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
            n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        _LISTED.append(n)
    return _LISTED[0]


def gpu_count() -> int:
    """GPUs on this machine, counted without initialising CUDA in the host (nvidia-smi; 1 if unknown)."""
    return max(1, gpus_listed())


def _death_reason(rc: int, stderr: str) -> str:
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else None
    if sig:
        with contextlib.suppress(ValueError):
            return f"process killed by {signal.Signals(sig).name}" + (f"; stderr: {last_line(stderr)}" if stderr else "")
    return f"process exited with code {rc} without a result" + (f"; stderr: {last_line(stderr)}" if stderr else "")


def _tail(f, n: int = 4000) -> str:
    f.seek(0, 2)
    size = f.tell()
    f.seek(max(0, size - n))
    data = f.read().decode(errors="replace")
    f.close()
    return data


def last_line(s: str) -> str:
    lines = [ln for ln in s.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def new_jobdir() -> str:
    return tempfile.mkdtemp(dir=root())
