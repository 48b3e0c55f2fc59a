"""Code that runs INSIDE an isolated sandbox child (`python sandbox_worker.py JOBFILE`).

The host (`sandbox.py`) never imports candidate code; it starts this file in a fresh process per job,
inside bubblewrap (see sandbox.py's threat model). Three job kinds:
  * `reference`: load the pristine task; compute full outputs for the trial seeds and sketches
    (`sketch`) for the timing seeds, always in strict fp32; optionally time the eager and
    `torch.compile` baselines in interleaved rounds.
  * `candidate`: load the task; time its eager forward on the host's request (`eager`, before any candidate
    code is imported); load the candidate `ModelNew` (import and `__init__` under the dispatch
    guard with the init allow-list), then serve the host's requests ONE AT A TIME over the control
    pipe: `trial` (fresh seeded inputs, guarded forward, outputs shipped for the host to compare),
    `ops` (the profiler's aten list), `time` (fresh seeded inputs, guarded and timed forward, then a
    sketch of the output on projection keys sent only after the call), `done`. The job file holds no
    seed, count or plan; the candidate never sees a reference output.
  * `call`: run a generic `module:function(**args)` for `sandbox.run_isolated`.
Results go to the host as nonce-framed JSON messages (tensors as raw frames) on an inherited pipe fd, never stdout;
the nonce arrives as the first control line, before any candidate code runs.

It also exports the runtime helpers that a workspace's `model_new.py` uses (contract, form (b)):
    from sandbox_worker import load_kernel, ptr, stream

With sandbox_measure.py (inputs, sketches, the baseline timer), sandbox_wire.py (the result channel) and
sandbox_inline.py (form (a)'s load_inline) it is the only project code a child can see: the repository is
hidden and these four files alone are bound in at HARNESS_DIR, so none of them imports another module of the
project.

Smoke: python -m pytest tests/test_sandbox.py -q -k honest
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import sys
import threading
import time
import traceback

import sandbox_inline  # these three are bound beside this file in the child (sandbox_child.HARNESS_FILES)
from sandbox_measure import (SKETCH_KEYS, Timer, flatten, import_file, load_task, make_inputs, nan_equal, one_line,
                             scrub, set_precision, sketch, time_baselines)
from sandbox_measure import bind_torch as bind_measure
from sandbox_wire import Channel
from sandbox_wire import bind_torch as bind_wire

# Bound before any candidate code is imported: a candidate that monkeypatches time.perf_counter or
# torch.cuda.synchronize afterwards does not change what the harness measures with.
_perf = time.perf_counter
_sleep = time.sleep
_sync = lambda: None  # noqa: E731 - torch.cuda.synchronize, bound in main() before candidate import


_KERNELS: dict[str, str] = {}      # kernel name -> path of the compiled .so (set by the worker)
_LIBS: dict[str, ctypes.CDLL] = {}
_GUARD: list = []  # the dispatch guard's context-manager class, once loaded (_guard_cls)

# aten ops a candidate's forward may call: allocation, views and metadata. Everything else is compute.
ALLOWED_OPS = frozenset("""
empty empty_like empty_strided new_empty new_empty_strided empty_permuted
view _unsafe_view reshape _reshape_alias as_strided t transpose permute expand expand_as squeeze
unsqueeze slice select split split_with_sizes unbind narrow chunk detach detach_ alias lift_fresh
view_as flatten unflatten movedim diagonal unfold view_as_real view_as_complex resolve_conj resolve_neg
sym_size sym_stride sym_numel sym_storage_offset size stride numel dim is_contiguous contiguous
is_same_size _local_scalar_dense item to record_stream is_nonzero _has_compatible_shallow_copy_type
""".split())

# What the candidate's import and `ModelNew.__init__` may call besides ALLOWED_OPS: creation, random and
# in-place initialisation (nn.Linear/Conv*/Norm/Embedding/RNN/MultiheadAttention construct with these),
# dtype/device copies, and the elementwise scaling that init schemes apply. Matrix products, convolutions,
# reductions and activations are refused: nothing the candidate computes before its first forward can be
# an answer, since no input it will see exists yet.
INIT_OPS = ALLOWED_OPS | frozenset("""
zeros zeros_like ones ones_like full full_like fill fill_ zero_ scalar_tensor arange linspace logspace eye
rand rand_like randn randn_like randint randint_like randperm normal normal_ uniform_ random_ bernoulli_
exponential_ cauchy_ log_normal_ geometric_ erfinv_ erfinv lift_fresh_copy _to_copy copy_ clone
_copy_from _copy_from_and_resize set_ resize_ tril triu tril_ triu_ mul mul_ div div_ add add_ sub sub_
rsub neg neg_ sqrt rsqrt clamp clamp_ clamp_min clamp_min_ clamp_max clamp_max_ abs pow masked_fill_
masked_fill index_fill_ lt le gt ge eq ne logical_not bitwise_not where sign floor ceil round cat stack
""".split())


# ----------------------------------------------------------------------------- runtime helpers (contract)
def load_kernel(name: str) -> ctypes.CDLL:
    """ctypes.CDLL of the compiled kernels/NAME.{cu,cpp} of this workspace."""
    if name not in _LIBS:
        path = _KERNELS.get(name)
        if path is None:  # outside the sandbox: env var, then ./kernels/NAME.so
            path = json.loads(os.environ.get("CUDA_AGENT_KERNELS", "{}")).get(name, f"kernels/{name}.so")
        assert os.path.exists(path), f"kernel {name!r} not compiled (no {path})"
        _LIBS[name] = ctypes.CDLL(os.path.abspath(path))
    return _LIBS[name]


def ptr(t) -> ctypes.c_void_p:
    """Raw data pointer of a plain torch.Tensor, for ctypes calls."""
    if type(t) not in _TENSOR_TYPES:
        _bind_helpers()
        assert type(t) in _TENSOR_TYPES, f"ptr() needs a torch.Tensor, got {type(t).__name__}"
    return ctypes.c_void_p(t.data_ptr())


def stream() -> ctypes.c_void_p | None:
    """The current CUDA stream as a cudaStream_t (c_void_p), or None before CUDA is up (cpu). On the launch
    path of every call, so it costs two C calls once CUDA is up: the host time a launch-bound candidate spends
    here is part of its measured time (torch.cuda.current_stream() builds Python objects)."""
    if not _RAW_STREAM:
        import torch
        if not torch.cuda.is_initialized():
            return None
        _RAW_STREAM[:] = [torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice]
    return ctypes.c_void_p(_RAW_STREAM[0](_RAW_STREAM[1]()))


_TENSOR_TYPES: tuple = ()  # (torch.Tensor, torch.nn.Parameter), bound at the first ptr()
_RAW_STREAM: list = []     # torch's raw current-stream and current-device getters, once CUDA is up


def _bind_torch(device: str):
    """Bind the torch functions the harness's checks and channel use, and the device-wide sync, before any
    candidate code can rebind them."""
    global _sync
    _sync = bind_measure(device)
    bind_wire()
    _bind_helpers()


def _bind_helpers():
    global _TENSOR_TYPES
    import torch
    _TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


# ----------------------------------------------------------------------------- task / candidate loading
# ----------------------------------------------------------------------------- job kinds
def run_reference(job: dict, ch: Channel):
    """Full outputs for the trial seeds, sketches for the timing seeds (strict fp32), the state_dict, and
    optionally the baselines."""
    import torch
    device, t0 = job["device"], _perf()
    phase_s = {}  # seconds of each phase, from the job's start (torch import and CUDA init come before it)
    try:
        task = load_task(job["task_path"])
        torch.manual_seed(job["init_seed"])
        init = task.get_init_inputs()
        model = task.Model(*init).to(device)
        phase_s["model"] = _perf() - t0
        if job.get("warm"):
            return ch.send(_warm_compile(task, model, job))
        sketches, kind = {}, None
        set_precision(False)
        for seed in job["seeds"]:  # one message per seed: this process holds one output on the host at a time
            with torch.no_grad():
                kind, ys = flatten(model(*make_inputs(task, seed, device)))
            ch.send({"type": "ref_out", "seed": seed, "outs": ys})
            del ys
        phase_s["outputs"] = _perf() - t0
        for seed, keys in job.get("sketch_seeds", {}).items():
            with torch.no_grad():
                kind, ys = flatten(model(*make_inputs(task, int(seed), device)))
            sketches[int(seed)] = sketch(ys, keys)
        phase_s["sketches"] = _perf() - t0
    except (ValueError, TypeError) as e:
        return ch.send({"type": "result", "task_error": str(e)[:400]})
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "task_error": f"reference forward failed: {one_line(e)}"})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    res = {"type": "result", "sketches": sketches, "out_kind": kind, "state_dict": sd,
           "device_name": name}
    if job.get("baselines"):
        ch.send({"type": "stage", "stage": "timing"})  # (timestamped by the host: where a first check's time goes)
        res["baselines"] = time_baselines(task, model, job)
        phase_s["baselines"] = _perf() - t0
    res["phase_s"] = {k: round(v, 3) for k, v in phase_s.items()}
    ch.send(res)


def _warm_compile(task, model, job: dict) -> dict:
    """Prewarm (sandbox.prewarm): one eager and one compiled forward under the baseline's precision and grad
    mode, so inductor's on-disk caches hold this graph when the baselines are timed. Nothing is timed."""
    import torch
    set_precision(job["precision"] == "tf32")
    xs = make_inputs(task, job["timing_seed"], job["device"])
    res = {"type": "result", "warmed": True, "compile_error": None}
    with torch.no_grad():
        model(*xs)
        try:
            torch.compile(model)(*xs)
        except BaseException as e:  # noqa: BLE001 - the timed run records the same error
            res["compile_error"] = one_line(e)
    _sync()
    return res


def _guard_cls():
    """The dispatch guard (sandbox_guard.cpp, loaded from $CUDA_AGENT_GUARD with both allow-lists) as a context
    manager class: `with Guard(INIT_OPS):` refuses and records every aten op outside the list on this thread;
    `guard.bad` holds the first refused op after the block. Its C functions are bound here, before any
    candidate code (made once per process), so nothing the candidate rebinds later changes what it calls."""
    if _GUARD:
        return _GUARD[0]
    lib = ctypes.CDLL(os.environ.pop("CUDA_AGENT_GUARD"))  # loading it registers the fallback with the dispatcher
    lib.sandbox_guard_allow.argtypes = [ctypes.c_int, ctypes.c_char_p]
    lib.sandbox_guard_on.argtypes = [ctypes.c_int]
    lib.sandbox_guard_off.argtypes = [ctypes.c_char_p, ctypes.c_int]
    on, off, buf = lib.sandbox_guard_on, lib.sandbox_guard_off, ctypes.create_string_buffer(256)
    modes = {ALLOWED_OPS: 0, INIT_OPS: 1}
    for ops, mode in modes.items():
        for name in sorted(ops):
            lib.sandbox_guard_allow(mode, name.encode())
    lib.sandbox_guard_seal()  # the ops every mode allows skip the guard's key (no boxed trip for empty_like)

    class Guard:
        def __init__(self, allowed=ALLOWED_OPS):
            self.mode, self.bad = modes[allowed], []

        def __enter__(self):
            on(self.mode)
            return self

        def __exit__(self, *exc):
            if off(buf, len(buf)):
                self.bad = [buf.value.decode()]
            return False
    _GUARD.append(Guard)
    return Guard


def _new_threads(base: set) -> set:
    """OS threads not in `base`; a joined thread can linger for a moment while it exits, so re-check."""
    grown = _native_threads() - base
    for _ in range(5):
        if not grown:
            break
        _sleep(0.02)
        grown = _native_threads() - base
    return grown


_LIBC = ctypes.CDLL(None)


def _getcpu() -> int:
    """The core this thread runs on now (after a timed call: which core its host part ran on)."""
    return _LIBC.sched_getcpu()


def _native_threads() -> set:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def _inherits_reference(cls, task) -> str | None:
    for base in cls.__mro__[1:]:
        if base is task.Model or base.__name__ == "Model" or \
                os.path.basename(getattr(sys.modules.get(base.__module__), "__file__", "") or "") == "model.py":
            return f"ModelNew inherits from the reference ({base.__module__}.{base.__name__})"
    return None


def _load_candidate(job: dict, task, guard_cls):
    """Import model_new and build ModelNew under the init guard; then load the reference weights."""
    import torch
    for name, path in job.get("kernels", {}).items():
        _KERNELS[name] = path
    sys.path.insert(0, job["cand_dir"])
    os.chdir(job["cand_dir"])
    guard = guard_cls(INIT_OPS)
    try:
        with guard:
            mod = import_file(job["cand_path"], "model_new")
            assert hasattr(mod, "ModelNew"), "solution defines no ModelNew"
            torch.manual_seed(job["init_seed"])
            model = mod.ModelNew(*task.get_init_inputs())
    except BaseException:
        if guard.bad:
            raise PermissionError(f"aten op {guard.bad[0]} called while importing or constructing ModelNew "
                                  f"(compute before the first input exists)") from None
        raise
    assert isinstance(model, torch.nn.Module), "ModelNew must be an nn.Module"
    ref_sd = torch.load(job["state_dict_path"], weights_only=True)
    own = model.state_dict()
    for k, v in ref_sd.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise ValueError(f"state_dict shape mismatch for {k}: {tuple(own[k].shape)} vs {tuple(v.shape)}")
    model.load_state_dict(ref_sd, strict=False)
    return model.to(job["device"])


def _forward(model, xs, guard_cls, device, clocks, timed: bool):
    """One guarded forward: (output, (ms, launch ms) or None, violation or None). Raises on candidate
    exceptions. The launch part is the host's time until forward returned (Python, allocation, launches), the
    rest the wait for the device: where a launch-bound call's time goes, reported beside the time."""
    import torch
    perf, sync = clocks
    scrub(device, sync)
    py_before = set(threading.enumerate())
    guard, ms = guard_cls(), None
    try:
        with torch.no_grad(), guard:
            t0 = perf()
            out = model(*xs)
            t1 = perf()
            sync()
            ms = ((perf() - t0) * 1e3, (t1 - t0) * 1e3) if timed else None
    except BaseException:
        if guard.bad:
            return None, None, f"aten op {guard.bad[0]} called inside forward (dispatch guard)"
        raise
    if guard.bad:  # an op the candidate caught and swallowed
        return None, None, f"aten op {guard.bad[0]} called inside forward (dispatch guard)"
    alive = [t for t in threading.enumerate() if t not in py_before and t.is_alive()]
    if alive:
        return out, ms, f"a thread started in forward is still alive after it returned ({alive[0].name})"
    return out, ms, None


def run_candidate(job: dict, ch: Channel):
    import torch
    device, res = job["device"], {"type": "result", "stage": "load"}
    clocks = (_perf, _sync)  # local references: rebinding sandbox_worker._perf/_sync later changes nothing
    if device == "cuda":
        # one job per GPU: the cap turns a runaway allocation into a clean OOM error, below the driver's limit
        torch.cuda.set_per_process_memory_fraction(job.get("gpu_mem_fraction", 0.9))
    set_precision(job["precision"] == "tf32")
    task = load_task(job["task_path"])
    torch.randn(1 << 20).mul_(2).sum()  # start torch's own intra-op thread pool before the thread checks
    guard_cls = _guard_cls()
    snapshot = _snapshot()
    ch.send({"type": "stage", "stage": "load"})  # torch imported, CUDA up (timestamped by the host)
    if job.get("eager_beside"):  # before any candidate code exists in this process; the host sends the
        ch.send(_time_eager(task, job, ch.recv_control()))  # request once the GPU is free of earlier jobs
    if job.get("shm_bytes"):  # before any candidate code: the trial outputs' way to the host
        ch.map_shm(job["shm_fd"], job["shm_bytes"], device)
    if job.get("ext_dir"):  # form (a): load_inline imports what the build child built (a private copy)
        sandbox_inline.install(job["ext_dir"])
    try:
        model = _load_candidate(job, task, guard_cls)
    except PermissionError as e:
        res["violation"] = str(e)
        return ch.send(res)
    except BaseException as e:  # noqa: BLE001 - SystemExit from candidate code included
        res["error"] = f"loading the candidate failed: {one_line(e)}"
        return ch.send(res)
    _restore(snapshot)  # undo monkeypatches of this module made by the candidate's import
    res["violation"] = _inherits_reference(type(model), task)
    if res["violation"]:
        return ch.send(res)
    res["stage"] = "verify"
    ch.send({"type": "stage", "stage": "verify"})  # the host answers with the first request
    res.update(_serve(model, task, guard_cls, job, ch, clocks, snapshot))
    ch.send(res)


def _time_eager(task, job: dict, spec: dict) -> dict:
    """The task's eager rounds, timed in the candidate's own child before the candidate is imported: the
    candidate's speedup over eager compares two measurements of one process a fraction of a second apart.
    A baseline timed once per task in another process would be compared with candidates timed in other
    phases of the host's speed, which drifts by up to ~1.8x over seconds on some machines (docs/RESULTS.md).
    `spec`, the host's request, holds the timing seed (unrelated to any checked seed), warm-up and iterations."""
    import torch
    try:
        torch.manual_seed(job["init_seed"])  # the reference child's weights: same seed, same code
        model = task.Model(*task.get_init_inputs()).to(job["device"])
        res = time_baselines(task, model, {**spec, "device": job["device"], "precision": job["precision"]},
                             with_compile=False)
    except BaseException as e:  # noqa: BLE001 - the host falls back to the cached eager baseline
        return {"type": "eager", "error": one_line(e)}
    del model
    if job["device"] == "cuda":
        torch.cuda.empty_cache()  # the candidate gets the memory the reference model held
    return {"type": "eager", "eager": res["eager"], "eager_launch": res.get("eager_launch", []),
            "eager_cv": res["eager_cv"]}


def _snapshot() -> tuple:
    """The harness modules' globals and their classes' attributes, to undo Python-level patches by the candidate."""
    mods = [sys.modules[n] for n in (__name__, Timer.__module__, Channel.__module__)]
    return {m: dict(vars(m)) for m in mods}, {c: dict(vars(c)) for c in (Timer, Channel)}


def _restore(snap: tuple):
    mods, classes = snap
    for m, g in mods.items():
        vars(m).update(g)
    for cls, attrs in classes.items():
        for k, v in attrs.items():
            if k not in ("__dict__", "__weakref__") and getattr(cls, k, None) is not v:
                setattr(cls, k, v)


def _serve(model, task, guard_cls, job, ch, clocks, snapshot) -> dict:
    """Answer the host's requests one at a time until `done`; returns the result fields.

    Each request carries the one seed it needs; the worker sends exactly one reply per request (a `time`
    request two: the time, then the sketch once the host has sent the keys) and the host sends the next
    request only after that reply, so no future seed is ever in this process. After a timed call the
    keys and the next request come in one line (one pipe round trip per timed call, not two): the next
    seed arrives only once the call it follows has returned."""
    import torch
    device, threads0, last_xs, trials = job["device"], None, None, 0
    req = ch.recv_control()
    while req["op"] != "done":
        t_req = clocks[0]()  # the child's span of this request, cross-checked against the host's wall clock
        xs = make_inputs(task, int(req["seed"]), device) if req["op"] in ("trial", "time") else last_xs
        if req["op"] == "ops":  # layer 2: the profiler's record of aten ops, without the dispatch guard
            grown = _new_threads(threads0) if threads0 is not None else set()
            if grown:
                return {"violation": f"forward left {len(grown)} new native thread(s) running"}
            try:
                with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                    model(*xs)
                    clocks[1]()  # work left on a side stream ends here, not inside the next call's inputs
                names = {e.name for e in p.events()}
            except BaseException as e:  # noqa: BLE001
                return {"error": f"forward raised under the profiler: {one_line(e)}"}
            ops = sorted(n for n in names if n.startswith("aten::"))  # the host re-checks these
            bad = [n for n in ops if n[6:] not in ALLOWED_OPS]
            if bad:
                return {"violation": f"aten op {bad[0]} seen by the profiler inside forward", "profiler_ops": ops}
            threads0 = _native_threads()  # the profiler starts a thread of its own
            ch.send({"type": "ops", "ops": ops})
            req = ch.recv_control()
            continue
        copies = [x.clone() for x in xs] if req["op"] == "trial" else None
        try:
            out, ms, viol = _forward(model, xs, guard_cls, device, clocks, timed=req["op"] == "time")
        except BaseException as e:  # noqa: BLE001
            return {"error": f"forward raised on a {'timed call' if req['op'] == 'time' else 'trial'}: {one_line(e)}"}
        if viol:
            return {"violation": viol}
        try:
            kind, ys = flatten(out)
        except TypeError as e:
            return {"error": str(e)}
        if threads0 is None:  # the first call: the output must not change after forward returned
            snap = [y.clone() for y in ys]
            _sleep(0.05)
            clocks[1]()
            if not all(nan_equal(a, b) for a, b in zip(snap, ys)):
                return {"violation": "the output changed after forward returned (background writer)"}
            threads0 = _native_threads()
        if copies is not None:
            if not all(nan_equal(x, c) for x, c in zip(xs, copies)):
                return {"violation": "forward modified its inputs"}
            ch.send({"type": "trial", "kind": kind, "outs": ys, "devices": [y.device.type for y in ys]},
                    slot=trials % 2)  # the host compares this half while the next trial fills the other
            trials += 1
            last_xs = xs
        else:
            ch.send({"type": "iter", "ms": ms[0], "launch_ms": ms[1], "kind": kind, "cpu": _getcpu(),
                     "span_ms": (clocks[0]() - t_req) * 1e3})
            reply = ch.recv_control(spin_s=0.01)  # keys drawn by the host after the call, and the next request
            ch.send({"type": "sketch", "sketch": sketch(ys, reply["keys"])})
        del out, ys
        _restore(snapshot)  # ... and patches made by its forward
        req = reply["next"] if req["op"] == "time" else ch.recv_control()
    grown = _new_threads(threads0) if threads0 is not None else set()
    if grown:
        return {"violation": f"forward left {len(grown)} new native thread(s) running"}
    return {"stage": "done"}


def run_build(job: dict, ch: Channel):
    """Import the solution and construct ModelNew once, so that load_inline builds into the shared build dir.
    No input, seed or reference exists in this process; errors are left to the candidate run to report."""
    import torch
    sandbox_inline.install(job["ext_dir"])
    try:
        task = load_task(job["task_path"])
        sys.path.insert(0, job["cand_dir"])
        os.chdir(job["cand_dir"])
        mod = import_file(job["cand_path"], "model_new")
        torch.manual_seed(job["init_seed"])
        mod.ModelNew(*task.get_init_inputs())
    except BaseException as e:  # noqa: BLE001 - SystemExit from candidate code included
        err = str(e) if "Error building extension" in str(e) else one_line(e)
        return ch.send({"type": "result", "built": False, "error": err[-4000:]})
    ch.send({"type": "result", "built": True})


def run_call(job: dict, ch: Channel):
    import importlib
    with open(job["args_path"], "rb") as f:
        args = pickle.load(f)  # written by the host: trusted data
    mod_name, fn_name = job["fn"].split(":")
    try:
        result = getattr(importlib.import_module(mod_name), fn_name)(**args)
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "error": f"{job['fn']} raised {one_line(e)}",
                        "traceback": traceback.format_exc()[-2000:]})
    ch.send({"type": "result", "value": result})


def _warm_up(device: str, warm_for: str, ch: Channel):
    """A warm child's start-up, before its job exists: torch and CUDA up and, in a candidate spare, each of the
    harness's own checks (dispatch guard, profiler, sketch) run once on a throwaway tensor, so the first
    candidate call pays none of their one-time costs; a reference spare instead imports torch.compile's
    machinery (dynamo, inductor); a build spare only torch's extension builder (no CUDA context). A stage
    message after each step shows where a spare's start-up goes (scripts/bench_child_start.py)."""
    import torch
    if warm_for == "build":  # a load_inline build child needs torch's extension builder, not the device
        import torch.utils.cpp_extension  # noqa: F401
        return ch.send({"type": "stage", "stage": "warm"})
    x = torch.ones(1 << 10, device=device)
    ch.send({"type": "stage", "stage": "device"})
    if warm_for == "reference":
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        ch.send({"type": "stage", "stage": "inductor"})
    else:
        with torch.no_grad(), _guard_cls()():
            torch.empty_like(x)
        ch.send({"type": "stage", "stage": "guard"})
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            torch.relu(x)
        ch.send({"type": "stage", "stage": "profiler"})
    sketch([x], [1] * SKETCH_KEYS)
    ch.send({"type": "stage", "stage": "sketch"})
    torch.randn(1 << 20).mul_(2).sum()  # torch's intra-op thread pool, started before any thread check
    _sync()
    ch.send({"type": "stage", "stage": "warm"})


def main(jobfile: str) -> int:
    sys.modules.setdefault("sandbox_worker", sys.modules[__name__])  # model_new imports the helpers
    with open(jobfile) as f:
        job = json.load(f)
    ch = Channel(job["result_fd"], b"", job.get("control_fd"))
    ch.nonce = bytes.fromhex(ch.recv_control()["nonce"])  # first control line; never in a file
    ch.send({"type": "stage", "stage": "started"})  # before any task or candidate code: the host can tell a
    # child that never started (its own failure) from a candidate that crashed (a verdict)
    if job["kind"] in ("reference", "candidate", "warm") or job.get("device") == "cuda":
        _bind_torch(job.get("device", "cpu"))  # before any candidate code runs (patched timers)
    if job["kind"] == "warm":  # a spare: everything that needs no job, then wait for the one job it serves
        ch.send({"type": "stage", "stage": "torch"})
        _warm_up(job["device"], job.get("for", "candidate"), ch)
    # Everything imported so far is moved out of the collector's reach: a full collection with torch, CUDA and
    # inductor loaded took ~0.1 s, and would otherwise run on the job's clock (and again in its timed calls).
    gc.collect()
    gc.freeze()
    if job["kind"] == "warm":
        job = {**ch.recv_control()["job"], **{k: job[k] for k in ("result_fd", "control_fd", "shm_fd")}}
    {"reference": run_reference, "candidate": run_candidate, "build": run_build, "call": run_call}[job["kind"]](job, ch)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (candidate atexit hooks, CUDA teardown races)


if __name__ == "__main__":
    if sys.argv[1] == "--probe":  # sandbox.isolation(): the interpreter and this file start under the wrapper
        print("sandbox_worker ok")
        sys.exit(0)
    main(sys.argv[1])
