"""The sandbox pool on a Ray cluster (`--sandbox.ray-address auto|HOST:PORT`), for runs that outgrow one node.

`make_pool` is what train, solve and kernelbench_eval open: `sandbox.SandboxPool` (this machine's GPUs or CPU
slots, unchanged) without the flag, `RayPool` with it; `check` runs one check on a lane; `synth` runs its filter
chunks through `RayPool.call`.
A RayPool has the local pool's interface (`submit`, `compile`, `prewarm`, `close`, `cfg`):
  * one lane per GPU of every Ray node (an actor with num_gpus=1; Ray sets its CUDA_VISIBLE_DEVICES), or on
    the cpu backend one per `--sandbox.ray-lane-cpus` CPUs a node offers Ray (num_cpus=k). A lane is a Ray
    actor process holding a one-slot `sandbox.SandboxPool`: every check runs `sandbox.check`'s code with all its
    isolation, warm spares, drivers and that node's baseline cache, exactly as a local lane runs it;
  * the host reads the task and the candidate (a workspace through `workspace.copy_tree`'s checks: no link
    followed, reads capped) and ships the bytes; the lane writes them into a private temp dir and checks that
    copy, so nodes share no filesystem with the host. The lanes run a copy of this checkout's top-level
    modules and sandbox package (Ray's `working_dir`), so every node needs only the same Python packages and
    system tools;
  * routing: a check goes to the least busy lane (DEPTH in flight each at most, the rest wait on the host);
    among equally busy lanes, one that checked the same task before (its driver is still warm), then one on
    a node that did (the node's baseline cache, keyed as today); `Verdict.timings["lane"]` says which node and
    GPU timed it, `timings["ray_overhead_ms"]` what Ray added to the lane's own time of the check;
  * a lane that dies (its process killed, its node lost) is replaced on the same node, or on any node with room
    when its node is gone, and each check it held is retried once on a live lane (`timings["lane_lost"]` says
    so). A check lost twice raises `SandboxError`: a lost node is the infrastructure's failure, never a
    candidate's reward of -1 (env.py lets it through and the run stops with one line; --resume goes on);
  * compiles for the agent's `compile` tool stay on this machine's cores (`compile`: nvcc here too, for cuda).

Not covered: nodes that join after the pool started are not used; lanes of one node share its cache dir, and
two lanes writing baselines.json at once can drop one entry (timed again later); a cpu lane's children run with
OMP_NUM_THREADS = its CPUs (Ray's setting), a GPU lane's with 1; a lane that hangs without dying holds its
checks until their own time limits.

Departures from the paper:
  1. The paper's 128-GPU sandbox pool is not public; this is ours, on Ray actors. Data-parallel trainer ranks
     (accelerate, torch.distributed: RANK, WORLD_SIZE) split the lanes among themselves, each rank its share.

Smoke: python -m pytest tests/test_sandbox_ray.py -q        (a 2-node local Ray cluster, cpu backend)
Full:  ray start --head (one node), ray start --address HEAD:6379 (each other node), then any command with
       --sandbox.ray-address auto; bench: python scripts/bench_ray.py --lanes 1 2 4
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import glob
import hashlib
import os
import pathlib
import shutil
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field

import workspace
from workspace import TaskError

from . import core
from .child import SandboxError
from .config import SandboxConfig
from .core import Verdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
DEPTH = 4             # checks in flight per lane: one timed, the next ones compiling (an nvcc compile outlasts a
#                       GPU check's ~0.6 s of timing); more wait on the host for the least busy lane
LANE_THREADS = 64     # calls a lane's actor serves at once (synth's chunks: --workers per lane)
LANE_START_S = 600.0  # a lane's start (a cold node imports torch and builds the dispatch guard)
RAY_VERSION = "2.60.0"  # the version CI installs


def _ray():
    """The ray module, imported only behind --sandbox.ray-address; SandboxError (one line) without it."""
    try:
        import ray
    except ImportError:
        raise SandboxError(f"--sandbox.ray-address needs ray: pip install 'ray=={RAY_VERSION}'") from None
    return ray


def _lost_errors(ray) -> tuple:
    """What a call raises when its lane's process or node is gone (not an exception inside the lane)."""
    e = ray.exceptions
    return (e.RayActorError, e.WorkerCrashedError, e.NodeDiedError, e.ObjectLostError, e.ActorUnschedulableError)


def _line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def make_pool(cfg: SandboxConfig, gpus: list[int] | None = None, compile_workers: int | None = None,
              cpu_slots: int = 1):
    """The sandbox pool a command opens: this machine's (`sandbox.SandboxPool`, unchanged) without
    --sandbox.ray-address, else the Ray cluster's lanes (`gpus` and `cpu_slots` are then the cluster's)."""
    if not cfg.ray_address:
        return core.SandboxPool(cfg, gpus=gpus, compile_workers=compile_workers, cpu_slots=cpu_slots)
    return RayPool(cfg, compile_workers=compile_workers)


def check(task: str | os.PathLike, solution: str | os.PathLike, cfg: SandboxConfig) -> Verdict:
    """`sandbox.check` (str: source; a path: a location), on one lane of the Ray cluster with
    --sandbox.ray-address."""
    if not cfg.ray_address:
        return core.check(task, solution, cfg)
    pool = RayPool(cfg, max_lanes=1)
    try:
        return pool.submit(task, solution).result()
    finally:
        pool.close()


# ----------------------------------------------------------------------------------------------------------
# What travels to a lane: the task's source and the candidate's bytes


def pack(solution: str | os.PathLike) -> tuple:
    """("a", source) | ("b", {relative path: (bytes, mode)}) | ("refused", one line), read on the host the way
    `sandbox.check` reads it (`sandbox._solution`, then `workspace.copy_tree`: no link, capped, no .so)."""
    form, sol = core._solution(solution)
    if form != "b":
        return form, sol
    tmp = tempfile.mkdtemp(prefix="cuda_agent_pack_")
    try:
        rels = workspace.copy_tree(sol, tmp, ignore_suffixes=(".so",))
        files = {}
        for rel in rels:
            path = os.path.join(tmp, rel)
            with open(path, "rb") as f:
                files[rel] = (f.read(), os.stat(path).st_mode & 0o777)
        return "b", files
    except workspace.WorkspaceError as e:  # a link or special file: the verdict refuses it, as it would locally
        return "refused", str(e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unpack(packed: tuple, where: str) -> str | pathlib.Path:
    """The `solution` argument of sandbox.check for a packed candidate: form (a)'s source, or a workspace
    written under the fresh dir `where`."""
    form, sol = packed
    if form == "refused":  # a path that cannot exist: the check refuses it before any child; the caller sets
        return pathlib.Path(where, "refused", "solution.py")  # the host's reason
    if form == "a":
        return sol
    ws = os.path.join(where, "ws")
    os.makedirs(ws)
    for rel, (data, mode) in sol.items():
        parts = rel.split("/")
        assert rel and not os.path.isabs(rel) and ".." not in parts, f"packed path {rel!r} leaves the workspace"
        path = os.path.join(ws, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, stat.S_IMODE(mode) & 0o755)
    return pathlib.Path(ws)


# ----------------------------------------------------------------------------------------------------------
# The lane: one Ray actor process


class Lane:
    """One sandbox lane (a Ray actor: `ray.remote(Lane)`): a one-slot `sandbox.SandboxPool` on this actor's GPU
    (the only one Ray lets it see) or its CPUs, so that a check here runs the local pool's code."""

    def __init__(self, cfg: SandboxConfig, index: int):
        import ray
        ctx = ray.get_runtime_context()
        gpus = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        self.where = {"lane": index, "node": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id()[:12],
                      "gpu": ",".join(gpus) or None}
        self.pool = core.SandboxPool(cfg, gpus=[0] if cfg.device == "cuda" else None, cpu_slots=1)
        self.tmp = tempfile.mkdtemp(prefix="cuda_agent_lane_")  # the candidates' copies, a dir each
        atexit.register(shutil.rmtree, self.tmp, True)

    def info(self) -> dict:
        import ray
        return {**self.where, "ray_node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "omp_threads": os.environ.get("OMP_NUM_THREADS"), "isolation": core.isolation(), "tmp": self.tmp}

    def check(self, src: str, packed: tuple, cfg: SandboxConfig):
        """The verdict (with `timings["lane"]`), or (exception name, message) for a TaskError / SandboxError."""
        with tempfile.TemporaryDirectory(dir=self.tmp) as d:
            solution = unpack(packed, d)
            t0 = time.perf_counter()
            try:
                v = self.pool.submit(src, solution, cfg).result()
            except (TaskError, SandboxError) as e:
                return type(e).__name__, str(e)
        if packed[0] == "refused":
            v.error = packed[1]
        v.timings["lane"] = {**self.where, "check_s": round(time.perf_counter() - t0, 3)}  # the local pool's time
        return v

    def call(self, fn, *args):
        """`fn(*args)` in this lane's process (a module-level function: Ray imports it here by name)."""
        return fn(*args)

    def prewarm(self, tasks: list[str], workers: int) -> dict:
        """`sandbox.prewarm` of the tasks' sources on this lane's pool."""
        return self.pool.prewarm(tasks, workers)


@dataclass
class _Slot:
    """The host's record of one lane: where it runs, its actor, how many calls it holds."""
    index: int
    node_id: str
    actor: object = None
    ready: bool = False
    gone: bool = False        # could not be replaced: no longer routed to
    busy: int = 0
    info: dict = field(default_factory=dict)


def _lane_nodes(ray, cfg: SandboxConfig) -> list[str]:
    """One node id per lane, lanes of different nodes interleaved (a node's first lane, every node's, then its
    second...), so that a few checks spread over the nodes first."""
    per_node = []
    for n in sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"]):
        res = n.get("Resources", {})
        k = int(res.get("GPU", 0)) if cfg.device == "cuda" else int(res.get("CPU", 0) // max(1, cfg.ray_lane_cpus))
        per_node.append([n["NodeID"]] * k)
    return [ids[i] for i in range(max(map(len, per_node), default=0)) for ids in per_node if i < len(ids)]


def _unreachable(address: str, timeout_s: float = 10.0) -> str | None:
    """Why nothing takes a connection at a HOST:PORT address (None: something does, or the address is "auto").
    ray.init would retry it 20 times, ~40 s each, printing warnings, before it raised."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return _line(e) if str(e) else type(e).__name__
    return None


def connect(address: str):
    """ray.init(address) for the lanes: a copy of this checkout's top-level modules and of the sandbox package
    (the harness and the guard's source with it) is the job's working_dir, which Ray ships to every node (runs/,
    data/ and tests/ stay here). RayPool calls it when the process is not connected yet; a program that connects
    itself calls this, or gives its job a working_dir from which `sandbox.ray` imports. SandboxError (one line) when no cluster answers there."""
    ray = _ray()
    if why := _unreachable(address):
        raise SandboxError(f"--sandbox.ray-address {address}: no Ray cluster there ({why})")
    code = tempfile.mkdtemp(prefix="cuda_agent_lanes_")
    try:
        for f in glob.glob(os.path.join(REPO, "*.py")):
            shutil.copy(f, code)
        shutil.copytree(os.path.join(REPO, "sandbox"), os.path.join(code, "sandbox"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        ray.init(address=address, runtime_env={"working_dir": code}, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - no cluster at that address (ray raises several kinds): one line
        raise SandboxError(f"--sandbox.ray-address {address}: no Ray cluster there ({_line(e)})") from None
    finally:
        shutil.rmtree(code, ignore_errors=True)  # uploaded by ray.init
    return ray


class RayPool:
    """The sandbox pool on a Ray cluster: `sandbox.SandboxPool`'s interface, one lane per GPU (or per
    `ray_lane_cpus` CPUs) of every node. Thread-safe; `submit` never blocks."""

    def __init__(self, cfg: SandboxConfig, compile_workers: int | None = None, max_lanes: int | None = None):
        ray = self._ray = _ray()
        self.cfg, self.gpus = cfg, None  # `gpus`: what prewarm needs of a local pool; the lanes have their own
        self._lane_cfg = dataclasses.replace(cfg, ray_address=None)
        self._cond = threading.Condition()
        self._closing, self._restarts, self._ex, self._cx, self.lanes = False, [], None, None, []
        self._seen: dict[str, set[int]] = {}  # task digest -> lanes that checked it
        self._own_ray = not ray.is_initialized()  # else the caller connected (`connect`, or its own working_dir)
        if self._own_ray:
            connect(cfg.ray_address)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        nodes = _lane_nodes(ray, cfg)[rank::world][:max_lanes]  # data-parallel ranks: each its share of lanes
        if not nodes:
            what = "GPU" if cfg.device == "cuda" else f"{cfg.ray_lane_cpus} free CPU(s)"
            self.close()
            raise SandboxError(f"--sandbox.ray-address {cfg.ray_address}: the Ray cluster offers no lane "
                               f"({what} per lane) to rank {rank} of {world}")
        self.lanes = [_Slot(i, n) for i, n in enumerate(nodes)]
        for s in self.lanes:
            self._start(s, soft=False)
        try:
            infos = ray.get([s.actor.info.remote() for s in self.lanes], timeout=LANE_START_S)
        except Exception as e:  # noqa: BLE001 - a lane that cannot start is the cluster's failure
            self.close()
            raise SandboxError(f"sandbox lanes on the Ray cluster did not start in {LANE_START_S:.0f} s: "
                               f"{_line(e)}") from None
        for s, info in zip(self.lanes, infos):
            s.info, s.ready = info, True
        n = compile_workers or os.cpu_count() or 1
        self._compile_sem = threading.Semaphore(n)
        self._ex = cf.ThreadPoolExecutor(len(self.lanes) * DEPTH, thread_name_prefix="sandbox-ray")
        self._cx = cf.ThreadPoolExecutor(n, thread_name_prefix="sandbox-compile")

    # ---- lanes ---------------------------------------------------------------------------------------
    def _start(self, s: _Slot, soft: bool) -> None:
        """A new actor for lane `s`, on its node (soft: anywhere with room when that node is gone)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        res = {"num_gpus": 1, "num_cpus": 0} if self.cfg.device == "cuda" else {"num_cpus": self.cfg.ray_lane_cpus}
        s.actor = self._ray.remote(Lane).options(
            **res, max_concurrency=LANE_THREADS, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(s.node_id, soft=soft)).remote(self._lane_cfg, s.index)

    def _replace(self, s: _Slot, dead) -> None:
        """Lane `s` lost its actor `dead`: start another (in the background; checks go to live lanes meanwhile)."""
        with self._cond:
            if s.actor is not dead or not s.ready or self._closing:
                return  # another call of the same actor saw it first
            s.ready = False
            t = threading.Thread(target=self._restart, args=(s,), daemon=True, name="sandbox-ray-restart")
            self._restarts.append(t)
        with contextlib.suppress(Exception):
            self._ray.kill(dead, no_restart=True)
        t.start()

    def _restart(self, s: _Slot) -> None:
        alive = any(n["NodeID"] == s.node_id and n.get("Alive") for n in self._ray.nodes())
        with self._cond:  # started under the lock: close() ends every actor started
            if self._closing:
                return
            self._start(s, soft=not alive)
            actor = s.actor
        try:
            info = self._ray.get(actor.info.remote(), timeout=LANE_START_S)
        except self._ray.exceptions.RayError:  # no room anywhere, or the pool closed: fewer lanes
            with self._cond:
                s.gone = True
                self._cond.notify_all()
            return
        with self._cond:
            s.info, s.node_id, s.ready = info, info["ray_node_id"], True  # its node, or the one it moved to
            self._cond.notify_all()

    def _take(self, digest: str | None) -> _Slot:
        """The lane for the next call: least busy; then one that checked this task; then one on such a node."""
        with self._cond:
            while True:
                live = [s for s in self.lanes if s.ready]
                if live:
                    break
                if all(s.gone for s in self.lanes):
                    raise SandboxError("every sandbox lane on the Ray cluster is gone (nodes lost, none replaced)")
                self._cond.wait(5.0)
            seen = self._seen.get(digest, set()) if digest else set()
            nodes = {self.lanes[i].node_id for i in seen}
            s = min(live, key=lambda s: (s.busy, s.index not in seen, s.node_id not in nodes, s.index))
            s.busy += 1
            if digest:
                self._seen.setdefault(digest, set()).add(s.index)
            return s

    def _run(self, method: str, digest: str | None, *args):
        """`actor.method(*args)` on a lane; once more on a live lane if that lane is lost. Returns (result, why
        the first lane was lost or None); SandboxError if both were."""
        ray, lost = self._ray, []
        for _ in range(2):
            s = self._take(digest)
            actor = s.actor
            try:
                return ray.get(getattr(actor, method).remote(*args)), (lost[0] if lost else None)
            except _lost_errors(ray) as e:
                lost.append(f"lane {s.index} on node {s.info.get('node')} ({s.info.get('node_id')}) was lost: "
                            f"{_line(e)}")
                self._replace(s, actor)
            except ray.exceptions.RayTaskError as e:  # the lane's own code failed: the sandbox's, not the candidate's
                raise SandboxError(f"sandbox lane {s.index} on node {s.info.get('node')} failed: "
                                   f"{_line(e.cause if getattr(e, 'cause', None) else e)}") from None
            finally:
                with self._cond:
                    s.busy -= 1
        raise SandboxError(f"a sandbox call was lost twice on the Ray cluster: {lost[1]} (before: {lost[0]})")

    # ---- the local pool's interface -------------------------------------------------------------------
    def _check(self, task: str | os.PathLike, solution: str | os.PathLike, cfg: SandboxConfig) -> Verdict:
        t0 = time.perf_counter()
        src = workspace.read_task(task)  # TaskError here, as sandbox.check raises it
        packed = pack(solution)
        out, lost = self._run("check", hashlib.sha256(src.encode()).hexdigest(), src, packed,
                              dataclasses.replace(cfg, ray_address=None))
        if isinstance(out, tuple):
            raise (TaskError if out[0] == "TaskError" else SandboxError)(out[1])
        if lost:
            out.timings["lane_lost"] = lost
        else:  # what Ray adds to the local pool's time: packing, transfers, the actor call, unpacking
            out.timings["ray_overhead_ms"] = round(1e3 * (time.perf_counter() - t0 - out.timings["lane"]["check_s"]), 2)
        return out

    def submit(self, task: str | os.PathLike, solution: str | os.PathLike,
               cfg: SandboxConfig | None = None) -> cf.Future:
        """A future of the Verdict of `solution` on `task`, checked on a lane (sandbox.check's contract: str is
        source, a path a location on this host; both are read here and travel as data)."""
        return self._ex.submit(self._check, task, solution, cfg or self.cfg)

    def call(self, fn, *args):
        """`fn(*args)` on the least busy lane (synth's filter chunks); blocks; retried once if the lane is lost."""
        return self._run("call", None, fn, *args)[0]

    def compile(self, ws: str) -> cf.Future:
        """The agent's compile tool: on this machine's cores, as the local pool does."""
        def job():
            with self._compile_sem:
                return core.compile_workspace(ws, self.cfg)
        return self._cx.submit(job)

    def prewarm(self, tasks: list[str | os.PathLike], workers: int, on_done=None) -> dict[str, str | None]:
        """sandbox.prewarm on one lane of every node (inductor's caches are per node); call it before the
        first check. {task sha256: None | the first node's error}. A task given as a path is read here: its
        source travels."""
        tasks = [workspace.read_task(t) for t in tasks]
        first = {}
        for s in self.lanes:
            first.setdefault(s.node_id, s)
        outs = self._ray.get([s.actor.prewarm.remote(tasks, workers) for s in first.values()])
        merged: dict[str, str | None] = {}
        for out in outs:
            for h, err in out.items():
                merged[h] = merged.get(h) or err
        for h, err in merged.items():
            if on_done:
                on_done(h, err)
        return merged

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Wait for the calls in flight, then end the lanes: each exits as a process does (its atexit handlers
        kill its warm children and remove its job dirs); one that does not within 30 s is killed."""
        for ex in (self._ex, self._cx):
            if ex is not None:
                ex.shutdown(wait=True)
        with self._cond:
            self._closing = True
            actors = [s.actor for s in self.lanes if s.actor is not None]
        with contextlib.suppress(Exception):
            self._ray.wait([a.__ray_terminate__.remote() for a in actors], num_returns=len(actors), timeout=30)
        for a in actors:
            with contextlib.suppress(Exception):
                self._ray.kill(a, no_restart=True)
        for t in self._restarts:  # each ends once its actor is killed
            t.join(timeout=60)
        if self._own_ray:
            self._ray.shutdown()
            self._own_ray = False
