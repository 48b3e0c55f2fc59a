"""The trusted side of a check, on the host: a check's driver (sandbox/harness/driver.py, in its own child) and the
pairings it runs with a computing child, the eager / `torch.compile` baselines (timed by a driver in a
baseline child, exactly as candidates are: cached, re-timed, prewarmed) and the validation of a task.
Nothing here runs candidate code.

A driver holds one task and serves up to DRIVER_MAX_USES checks of it, one at a time (a pool's checks of one
GPU are serial): what it keeps between checks is its own (the reference model, the shared regions, its
private RNG), and every check gets a fresh computing child. Drivers are kept per device slot, at most
DRIVERS_PER_SLOT, the least recently used retired first.

Smoke: python -m pytest tests/test_sandbox.py -q -k "baseline or prewarm or pool"
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading

from workspace import TaskError, read_task

from .child import (Child, ChildResult, SandboxError, isolation, last_line, new_jobdir, run_child, settle,
                           visible_devices)
from .config import SandboxConfig
from .spares import Spares, warm_spares


def precision_of(cfg: SandboxConfig) -> str:
    assert cfg.precision in ("fp32", "tf32", "auto"), f"precision must be fp32|tf32|auto, got {cfg.precision}"
    if cfg.device != "cuda":
        return "fp32"
    return ("tf32" if cfg.rtol >= 1e-3 else "fp32") if cfg.precision == "auto" else cfg.precision


def baseline_timing(cfg: SandboxConfig) -> str:
    """How baselines are timed (a baseline child under a driver, as candidates are, with --sandbox.gpu-clock on a
    GPU); a cache entry timed any other way is timed again."""
    if cfg.device != "cuda":
        return "driver clock"
    return "driver clock, queued, less its floor" if cfg.gpu_clock == "queued" else "driver clock, go-first"


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




REF_SPARES = Spares()  # warm baseline children: torch, CUDA and torch.compile's modules already imported
DRIVER_SPARES = Spares()  # warm drivers: torch, CUDA and the driver API up


def _inductor_env(inductor: str) -> dict:
    """torch.compile in a child: its own cache dir, and one compile thread. Inductor's default is a pool of
    worker processes, one per core, each importing torch; they count towards the child's RSS limit (the whole
    process tree), and on a 16-core host the pool alone took the 128-sine task over 8 GB."""
    return {"TORCHINDUCTOR_CACHE_DIR": inductor, "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _inductor(cfg) -> str:
    path = os.path.join(os.path.expanduser(cfg.cache_dir), "inductor")
    os.makedirs(path, exist_ok=True)  # bound writable into the child: it must exist first
    return path


def ref_spare(cfg: SandboxConfig, gpu) -> tuple:
    """(key, count, spawn) of the warm baseline children of this config and device slot: two each, since a
    task's first check times its baselines in one and, when its candidate beats a baseline timed once, the
    re-timing runs another at once. Each holds a CUDA context."""
    inductor = _inductor(cfg)

    def spawn() -> Child:
        return Child(new_jobdir(), device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, writable=(inductor,),
                     env=_inductor_env(inductor), warm_for="reference")
    return (cfg.device, gpu, cfg.mem_limit_mb, inductor, isolation()), min(2, warm_spares(cfg)), spawn


def driver_spare(cfg: SandboxConfig, gpu) -> tuple:
    """(key, count, spawn) of warm drivers: a driver shares the host's PID namespace (it stops and continues
    the computing child) and runs only task code."""
    def spawn() -> Child:
        return Child(new_jobdir(), device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, warm_for="driver",
                     share_pid=True)
    return (cfg.device, gpu, cfg.mem_limit_mb, "driver", isolation()), min(2, warm_spares(cfg)), spawn


def run_reference(task_src: str, cfg: SandboxConfig, gpu: int | None = None, warm: bool = False) -> dict:
    """Validate a task in a child (import, names, tensor inputs, one forward), or with `warm` only compile it
    (prewarm); returns the child's result or raises TaskError."""
    inductor = _inductor(cfg)
    jobdir = new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir, exist_ok=True)
        with open(os.path.join(wdir, "task.py"), "w") as f:
            f.write(task_src)
        job = {"kind": "reference", "task_path": os.path.join(wdir, "task.py"), "device": cfg.device,
               "init_seed": cfg.seed, "precision": precision_of(cfg), "warm": warm}
        r = run_child(job, jobdir, device=cfg.device, timeout_s=cfg.run_timeout_s + (cfg.compile_timeout_s if warm
                      else 0), mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, writable=(inductor,),
                      env=_inductor_env(inductor))
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if r.result is None:
        raise TaskError(f"reference run failed: {r.error}")
    if r.result.get("task_error"):
        raise TaskError(r.result["task_error"])
    return r.result


# ----------------------------------------------------------------------------- drivers
DRIVER_MAX_USES = 50  # checks one driver serves before a new one is started (0: a new driver every check)
DRIVERS_PER_SLOT = 2


class Driver:
    """The host's handle on one driver child: started (warm or cold), ready (its specs, the reference weights,
    the shared regions' file descriptors, held here to hand to each computing child), then one pairing at a time."""

    def __init__(self, src: str, cfg: SandboxConfig, gpu):
        self.key, self.gpu, self.uses, self.broken = driver_key(src, cfg, gpu), gpu, 0, False
        self.events: list = []
        self._cv = threading.Condition()
        spares = warm_spares(cfg) > 0
        child = DRIVER_SPARES.take(*driver_spare(cfg, gpu))[0] if spares else None
        jobdir = child.jobdir if child else new_jobdir()
        wdir = os.path.join(jobdir, "w")
        os.makedirs(wdir, exist_ok=True)
        with open(os.path.join(wdir, "task.py"), "w") as f:
            f.write(src)
        job = {"kind": "driver", "task_path": os.path.join(wdir, "task.py"), "device": cfg.device,
               "init_seed": cfg.seed, "atol": cfg.atol, "rtol": cfg.rtol}
        limit = 2 * cfg.mem_limit_mb + 256  # the ready message carries the reference weights
        if child is None:
            child = Child(jobdir, device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, job=job, share_pid=True,
                          max_msg_mb=limit, on_msg=self._on_msg)
        else:
            child.start(job, self._on_msg, max_msg_mb=limit)
        self.child = child
        why = child.watch(lambda: self._seen("ready", "result"), cfg.run_timeout_s)
        ready = self._take("ready")
        if ready is None:
            res, said = self._take("result") or {}, last_line(child.stderr_tail())
            said = f" ({said})" if said else ""
            if not child.msgs and not res:  # nothing of the task ran: the sandbox's own failure
                rc = child.proc.poll()
                self.close()
                raise SandboxError(f"a sandbox child did not start: {why or f'the driver exited with code {rc}'}{said}")
            self.close()
            raise TaskError(res.get("task_error") or f"reference run failed: {why or 'the driver exited'}{said}")
        got = child.recv_fds(60)
        if got is None:
            self.close()
            raise SandboxError("the driver's shared regions did not arrive")
        self.fds = got[1]
        self.attach = {"sizes": ready["sizes"], "in": ready["in"], "out": ready["out"]}
        self.state_dict, self.device_name = ready["state_dict"], ready["device_name"]
        self.out_kind, self.prep_ms = ready["out_kind"], ready["prep_ms"]
        self.startup = child.startup

    def _on_msg(self, msg, control):
        with self._cv:
            self.events.append(msg)
            self._cv.notify_all()

    def _seen(self, *types) -> bool:
        with self._cv:
            return any(m.get("type") in types for m in self.events)

    def _take(self, t: str) -> dict | None:
        with self._cv:
            for i, m in enumerate(self.events):
                if m.get("type") == t:
                    return self.events.pop(i)
        return None

    def pairing(self, req: dict, link: socket.socket, timeout_s: float) -> tuple[list, dict]:
        """Run one pairing (the computing child already has the other end of the link); returns the driver's
        reports of the pairing (calls, the candidate's load) and its pairing_end. A driver that dies or
        overruns is the sandbox's failure: SandboxError, and the driver is not used again."""
        with self._cv:
            self.events.clear()
        self.uses += 1
        self.child.send({"op": "pairing", **req})
        self.child.send_fds({}, [link.fileno()])
        link.close()  # in flight to the driver, which now holds the only end
        why = self.child.watch(lambda: self._seen("pairing_end", "result"), timeout_s)
        end = self._take("pairing_end")
        with self._cv:
            reports = [m for m in self.events if m.get("type") in ("call", "load")]
        if end is None or end.get("driver_error"):
            self.broken = True
            err = (end or {}).get("driver_error") or why or f"the driver exited ({last_line(self.child.stderr_tail())})"
            raise SandboxError(f"the check's driver failed: {err}")
        return reports, end

    def alive(self) -> bool:
        return not self.broken and self.child.alive()

    def close(self):
        self.child.send({"op": "stop"})
        self.child.kill()
        shutil.rmtree(self.child.jobdir, ignore_errors=True)
        for fd in getattr(self, "fds", []):
            with contextlib.suppress(OSError):
                os.close(fd)


def driver_key(src: str, cfg: SandboxConfig, gpu) -> tuple:
    return (hashlib.sha256(src.encode()).hexdigest(), cfg.device, gpu, cfg.mem_limit_mb, cfg.seed, cfg.atol, cfg.rtol,
            isolation())


_DRIVERS: list = []  # idle drivers, least recently used first
_DRIVER_LOCK = threading.Lock()


@contextlib.contextmanager
def driver(src: str, cfg: SandboxConfig, gpu):
    """An idle driver of this task on this slot (or a new one) for one check; kept afterwards while it is
    well, has served fewer than DRIVER_MAX_USES checks, and is among the DRIVERS_PER_SLOT last used."""
    key = driver_key(src, cfg, gpu)
    with _DRIVER_LOCK:
        d = next((d for d in _DRIVERS if d.key == key), None)
        if d is not None:
            _DRIVERS.remove(d)
    if d is not None and not d.alive():
        d.close()
        d = None
    if d is None:
        if warm_spares(cfg) > 0:
            DRIVER_SPARES.fill(*driver_spare(cfg, gpu))
        d = Driver(src, cfg, gpu)
    ok = False
    try:
        yield d
        ok = True
    finally:
        retire = [d] if not ok or not d.alive() or d.uses >= DRIVER_MAX_USES else []
        with _DRIVER_LOCK:
            if not retire:
                _DRIVERS.append(d)
                mine = [x for x in _DRIVERS if x.gpu == gpu]
                retire = mine[:max(0, len(mine) - DRIVERS_PER_SLOT)]
                for x in retire:
                    _DRIVERS.remove(x)
        for x in retire:
            x.close()


@atexit.register
def _close_drivers():
    with _DRIVER_LOCK:
        idle = list(_DRIVERS)
        _DRIVERS.clear()
    for d in idle:
        with contextlib.suppress(Exception):
            d.close()


def run_pairing(drv: Driver, child: Child, job: dict | None, req: dict, timeout_s: float,
                on_msg=None, max_msg_mb: int = 16) -> tuple[ChildResult, list, dict]:
    """One pairing of `drv` with `child` computing: the child gets its job (a warm one; a cold one has it), the
    regions and its end of a fresh link; the driver the other end and `req`. Returns the child's result and
    the driver's reports and pairing_end."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out: dict = {}
    try:
        if job is not None:
            child.start(job, on_msg, max_msg_mb)
        child.send({"attach": drv.attach})
        child.send_fds({}, [b.fileno(), *drv.fds])
        b.close()  # the host keeps no end of the link: when the child dies, the driver sees EOF at once
        runner = threading.Thread(target=lambda: out.update(r=_run(child, timeout_s, on_msg, max_msg_mb)), daemon=True)
        runner.start()
        try:
            reports, end = drv.pairing({**req, "root_pid": child.proc.pid}, a, timeout_s + 30)
        except BaseException:
            child.kill()
            raise
        finally:
            a.close()
            b.close()
        runner.join(60)
        if "r" not in out:  # the child outlived its pairing: it is killed, and says so
            child.kill()
            runner.join(30)
    finally:
        a.close()
        b.close()
    r = out.get("r")
    if isinstance(r, BaseException):
        raise r
    return r, reports, end


def _run(child: Child, timeout_s: float, on_msg, max_msg_mb):
    try:
        return child.run(None, timeout_s, on_msg, max_msg_mb)
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
        return e


# ----------------------------------------------------------------------------- baselines
def baseline_entry(b: dict, precision: str, device: str, old: dict | None = None) -> dict:
    """A cache entry from a baseline pairing's rounds, merged with an earlier entry of the same task (re-timing).

    The baseline is the MINIMUM over every round median of every run: load on the machine only ever makes
    a measurement slower, so the minimum is the measurement least inflated by it."""
    old = old or {}
    eager = old.get("eager_rounds", []) + b["eager"]
    comp = None if b.get("compile") is None else old.get("compile_rounds", []) + b["compile"]
    return {"eager_ms": min(eager), "eager_rounds": eager, "compile_ms": min(comp) if comp else None,
            "compile_rounds": comp or [], "compile_error": b.get("compile_error"), "runs": old.get("runs", 0) + 1,
            "spread": (max(eager) - min(eager)) / min(eager) if min(eager) > 0 else 0.0,
            "precision": precision, "device": device, "timing": b["timing"],
            "clocks": b.get("clocks"),  # the last run's timed calls by clock (GPU: "queued" unless forward syncs)
            "floor_ms": b.get("floor_ms")}  # the last run's queued-clock floor (GPU)


def time_baselines(drv: Driver, src: str, cfg: SandboxConfig, gpu) -> dict:
    """Eager and compiled rounds of the task, in a baseline child (trusted code: the task and torch.compile)
    under `drv`: the same calls, clock and copies as a candidate's. Returns the pairing's rounds."""
    inductor = _inductor(cfg)
    child = REF_SPARES.take(*ref_spare(cfg, gpu))[0] if warm_spares(cfg) > 0 else None
    jobdir = child.jobdir if child else new_jobdir()
    wdir = os.path.join(jobdir, "w")
    os.makedirs(wdir, exist_ok=True)
    with open(os.path.join(wdir, "task.py"), "w") as f:
        f.write(src)
    job = {"kind": "baseline", "task_path": os.path.join(wdir, "task.py"), "device": cfg.device,
           "init_seed": cfg.seed, "precision": precision_of(cfg)}
    timeout = cfg.run_timeout_s + cfg.compile_timeout_s
    settle(gpu)  # timed: no earlier job's child may still be leaving the device
    try:
        if child is None:
            child = Child(jobdir, device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, gpu=gpu, writable=(inductor,),
                          env=_inductor_env(inductor), job=job)
            job = None
        r, _, end = run_pairing(drv, child, job, _request(cfg, "baseline"), timeout)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    if end.get("error") or not end.get("eager"):
        raise TaskError(f"baseline run failed: {end.get('error') or (r.result or {}).get('error') or r.error}")
    return {**end, "timing": baseline_timing(cfg)}


def _request(cfg: SandboxConfig, role: str, eager: bool = False) -> dict:
    """A pairing's request to the driver: what to run, with the check's counts and limits."""
    return {"role": role, "eager": eager, "n_trials": cfg.n_trials, "warmup": cfg.warmup, "iters": cfg.iters,
            "profile": cfg.profile, "call_timeout_s": cfg.run_timeout_s, "attach_timeout_s": cfg.run_timeout_s,
            "load_timeout_s": cfg.run_timeout_s + cfg.compile_timeout_s,
            "compile_timeout_s": cfg.run_timeout_s + cfg.compile_timeout_s, "queued": cfg.gpu_clock == "queued"}


def baselines(task: str | os.PathLike, cfg: SandboxConfig, gpu: int | None = None) -> dict:
    """{"eager_ms", "compile_ms", "precision", "device", rounds, runs} of the task (str: its source; a path: its
    .py file); cached per (task, device, torch, precision)."""
    src = read_task(task)
    prec, dev = precision_of(cfg), device_name(cfg.device, gpu)
    key = f"{hashlib.sha256(src.encode()).hexdigest()}|{dev}|{prec}"
    hit = baseline_cache(cfg, key)
    if hit and hit.get("timing") == baseline_timing(cfg):
        return hit
    with driver(src, cfg, gpu) as drv:
        end = time_baselines(drv, src, cfg, gpu)
        return baseline_cache(cfg, key, baseline_entry(end, prec, drv.device_name))


def retime(drv: Driver, src: str, cfg: SandboxConfig, gpu, key: str, base: dict) -> dict:
    """Time the baselines again in a new baseline child and merge the rounds into the cached entry."""
    end = time_baselines(drv, src, cfg, gpu)
    return baseline_cache(cfg, key, baseline_entry(end, base["precision"], base["device"], old=base))


def prewarm(tasks: list[str | os.PathLike], cfg: SandboxConfig, workers: int = 8, gpus: list[int] | None = None,
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
        if cfg.profile and (baseline_cache(cfg, f"{h}|{dev}|{prec}") or {}).get("timing") != baseline_timing(cfg):
            todo[h] = src
    out: dict[str, str | None] = {}

    def one(i_h):
        i, h = i_h
        try:
            run_reference(todo[h], cfg, slots[i % len(slots)], warm=True)
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
