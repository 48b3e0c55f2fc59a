"""Isolation and the child runner of the sandbox: every compile, reference and candidate job is one child
process started here, inside bubblewrap (or a weaker fallback), with wall-clock and memory limits, and read
back through a nonce-framed result channel. sandbox.py decides what runs; this file decides how.

A child that never reports (the interpreter or the worker cannot start, a broken wrapper) raises
SandboxError: the sandbox's failure, never a candidate's verdict.

Smoke: python -m pytest tests/test_sandbox.py -q -k "probe or start or isolation"
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
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
from dataclasses import dataclass

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_worker.py")


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
REPO = os.path.dirname(WORKER)
_UNHIDEABLE = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/dev", "/proc", "/sys", "/run", "/tmp")


def _needed() -> set[str]:
    """Host dirs a child runs from: the interpreter's prefixes (a venv), site-packages on sys.path, the CUDA
    toolkit. Bound back read-only when a hidden dir holds them."""
    need = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.environ.get("CUDA_HOME", ""),
            os.environ.get("CUDA_PATH", "")}
    need |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") or p.endswith(".zip")}
    nvcc = shutil.which("nvcc")
    if nvcc:  # e.g. /usr/local/cuda-13.0/bin/nvcc -> /usr/local/cuda-13.0 (through a wrapper: CUDA_HOME)
        need.add(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    return {os.path.realpath(p) for p in need if p and os.path.exists(p)}


def _wrap(cmd: list[str], wdir: str, device: str, writable: list[str], hide: list[str]) -> list[str]:
    """Prefix `cmd` with the isolation: only `wdir` and `writable` are writable; `hide` is invisible (empty
    tmpfs), except what the child runs from (`_needed`) and the worker script, which then appears at
    HARNESS_DIR (`cmd` is rewritten to it; `from sandbox_worker import ...` still works: the worker
    registers itself). Pass `_hidden(cfg, ws)` for compile and candidate children."""
    level = isolation()
    if level == "unshare":
        return ["unshare", "--net", "--map-root-user", *cmd]
    if level == "rlimits":
        return cmd
    return bwrap_argv(cmd, wdir, device, writable, hide)


def bwrap_argv(cmd: list[str], wdir: str, device: str, writable: list, hide: list[str], ro_binds: tuple = (),
               setenv: dict | None = None) -> list[str]:
    """The bubblewrap command line of every sandboxed process (jobs here, the agent's bash tool in tools.py):
    read-only `/`, private /tmp and /dev/shm, `hide` invisible, `wdir` and `writable` writable, `ro_binds`
    read-only over them, no network, own namespaces; `cmd` last (empty: the caller appends it)."""
    args = ["bwrap", "--ro-bind", "/", "/"]
    args += ["--dev-bind", "/dev", "/dev"] if device == "cuda" else ["--dev", "/dev"]
    args += ["--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
    hidden = [h for h in dict.fromkeys(os.path.realpath(os.path.expanduser(x)) for x in [root(), *hide])
              if h not in _UNHIDEABLE and (os.path.isdir(h) or h.startswith("/tmp/"))]
    inside = lambda p, d: p.startswith(d + os.sep)  # noqa: E731 - strictly below
    args += [a for h in hidden for a in ("--tmpfs", h)]  # after /tmp: tmpfs mount points are created
    masked = hidden + ["/tmp", "/dev/shm"]  # the private /tmp also hides an interpreter or a repo kept there
    back = sorted(p for p in _needed() if any(inside(p, h) for h in masked))
    args += [a for p in back for a in ("--ro-bind", p, p)]
    args += [a for h in hidden if any(inside(h, p) for p in back) for a in ("--tmpfs", h)]  # still hidden
    repo = os.path.realpath(REPO)
    if repo not in hidden and any(inside(repo, m) for m in masked):  # reference and call children import it
        args += ["--ro-bind", repo, repo]
    elif any(inside(os.path.realpath(WORKER), m) for m in masked):
        shown = os.path.join(HARNESS_DIR, os.path.basename(WORKER))
        args += ["--ro-bind", os.path.realpath(WORKER), shown]
        cmd = [shown if c == WORKER else c for c in cmd]
    for w in [wdir, *writable]:  # binds come last so that the tmpfs mounts above do not hide them
        src, dst = w if isinstance(w, tuple) else (w, w)  # (host dir, where the child sees it)
        args += ["--bind", src, dst]
    args += [a for p in ro_binds for a in ("--ro-bind", p, p)]
    args += [a for k, v in (setenv or {}).items() for a in ("--setenv", k, v)]
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


def _reader(fd: int, nonce: bytes, out: list, on_msg, state: dict, max_msg_bytes: int, max_msgs: int = 100_000):
    """Read nonce-framed messages until EOF; a bad frame, a message over max_msg_bytes or too many messages
    mark the channel corrupt. Each message is handed to `on_msg` and then only its small fields are kept
    (tensors under "outs" are dropped), so the host holds at most one message's payload at a time."""
    import torch
    with os.fdopen(fd, "rb", buffering=0) as f:
        def read(n):
            buf = bytearray()
            while len(buf) < n:
                chunk = f.read(min(n - len(buf), 1 << 24))
                if not chunk:
                    return None
                buf += chunk
            return bytes(buf)
        for _ in range(max_msgs):
            head = read(24)
            if head is None:
                return
            if head[:16] != nonce:
                state["corrupt"] = "bad frame on the result channel"
                return
            n = struct.unpack(">Q", head[16:])[0]
            if n > max_msg_bytes:  # the host's memory is not the candidate's to fill
                state["corrupt"] = f"a result message of {n >> 20} MB exceeds the {max_msg_bytes >> 20} MB limit"
                return
            body = read(n)
            try:
                msg = torch.load(io.BytesIO(body or b""), weights_only=True)
                assert isinstance(msg, dict) and "type" in msg
            except Exception as e:  # noqa: BLE001 - non-plain data (e.g. a tensor subclass) is refused
                state["corrupt"] = f"unreadable result message ({type(e).__name__})"
                return
            del body
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


def run_child(job: dict, jobdir: str, *, device: str, timeout_s: float, mem_limit_mb: int, gpu: int | None = None,
              writable: tuple = (), hide: tuple = (), env: dict | None = None, on_msg=None,
              cmd: list[str] | None = None, max_msg_mb: int = 64) -> ChildResult:
    """Run one sandboxed child (the worker with `job`, or `cmd`) and collect its messages (each at most
    `max_msg_mb`). The nonce that frames them goes down the control pipe, never into a file."""
    wdir = os.path.join(jobdir, "w")
    os.makedirs(wdir, exist_ok=True)
    nonce = secrets.token_bytes(16)
    rfd, wfd = os.pipe()
    crfd, cwfd = os.pipe()
    job = {**job, "result_fd": wfd, "control_fd": crfd}
    with open(os.path.join(wdir, "job.json"), "w") as f:
        json.dump(job, f)
    child_env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    child_env.update({"HOME": wdir, "TMPDIR": "/tmp" if isolation() == "bwrap" else wdir,
                      "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})
    child_env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu) if device == "cuda" else ""  # cpu children see no GPU
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
    with contextlib.suppress(OSError):  # the worker reads this line before anything else
        control.write(json.dumps({"nonce": nonce.hex()}) + "\n")
        control.flush()
    reader = threading.Thread(target=_reader, args=(rfd, nonce, msgs, handle, state, max_msg_mb << 20),
                              daemon=True)
    reader.start()
    t_end, why, peak, tree, n = time.monotonic() + timeout_s, None, 0.0, [proc.pid], 0
    while proc.poll() is None:
        if time.monotonic() > t_end:
            why = f"timed out after {timeout_s:.0f}s"
        elif state.get("corrupt"):  # the reader has stopped: nothing will answer the child any more
            why = state["corrupt"]
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
    stage = next((m["stage"] for _, m in reversed(msgs) if m.get("type") == "stage" and m["stage"] != "started"),
                 None)
    if is_worker and not msgs and not state.get("corrupt"):  # no candidate code runs before the first message
        raise SandboxError(f"a sandbox child did not start: {why or _death_reason(rc, stderr)}")
    if why is None and state.get("corrupt"):
        why = state["corrupt"]
    if why is None and result is None and is_worker:
        why = _death_reason(rc, stderr)
    return ChildResult(result if why is None else None, msgs, why, stage, stdout, stderr, rc, t_started)


def visible_devices(gpu: int | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child pinned to pool index `gpu` (mapped through the host's own list)."""
    host = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is None:  # not pinned (plain check() outside a pool): the child sees what the host sees
        return host if host is not None else ",".join(str(i) for i in range(gpu_count()))
    ids = [x for x in host.split(",") if x.strip()] if host else None
    return ids[gpu] if ids else str(gpu)


def require_device(device: str):
    """SandboxError unless `device` can run here: "cpu", or "cuda" with at least one GPU listed by nvidia-smi
    (asked once; the host never initialises CUDA itself)."""
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
