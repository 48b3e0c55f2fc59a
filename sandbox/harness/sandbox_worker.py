"""Code that runs INSIDE an isolated sandbox child (`python sandbox_worker.py JOBFILE`).

The host (`sandbox/core.py`) never imports candidate code; it starts this file in a fresh process per job,
inside bubblewrap (see sandbox/core.py's threat model). The job kinds:
  * `driver` (driver.py): the trusted side of checks: the pristine task, the inputs of every call,
    the reference outputs, the clock and every comparison. It never runs candidate code.
  * `candidate` / `baseline` (`run_compute`): a child that only computes, for one driver pairing. It maps the
    driver's shared regions, and answers the driver's requests one at a time over their link: a call (forward
    on the shared inputs, the output copied into the shared output region), "load" (import and construct
    the candidate `ModelNew` under the dispatch guard with the init allow-list), "end". A candidate child runs
    the task's eager forward first (the eager baseline beside it), then the candidate's; nothing it measures
    or reports enters a verdict's correctness or time, and no reference output or seed exists in it.
  * `reference`: validate a task (one forward), or fill inductor's caches (`warm`).
  * `build`: import a load_inline solution once so that its extension builds; `call`: `sandbox.run_isolated`.
Results go to the host as nonce-framed JSON messages (tensors as raw frames) on an inherited pipe fd, never
stdout; the nonce arrives as the first control line, before any candidate code runs.

It also exports the runtime helpers that a workspace's `model_new.py` uses (contract, form (b)), which is why
this file keeps the module name candidates import:
    from sandbox_worker import load_kernel, ptr, stream

With the other harness files (sandbox.child.HARNESS_FILES: the driver, the shared memory, the channel, the
task's inputs, the comparison, form (a)'s load_inline) it is the only project code a child can see: the
repository is hidden and these files alone are bound in at HARNESS_DIR, so they import only each other: by
flat module name in a child, where this file runs as a script beside them; as modules of the package
sandbox.harness on the host.

Smoke: python -m pytest tests/test_sandbox.py -q -k honest
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import pickle
import sys
import threading
import time
import traceback

if __package__:  # on the host: a module of the package sandbox.harness
    from . import inline
    from .measure import bind_torch as bind_measure
    from .measure import flatten, import_file, load_task, make_inputs, one_line, set_precision
    from .share import GpuOps, Region
    from .wire import Channel, Link, recv_fds
    from .wire import bind_torch as bind_wire
else:  # in a child, run as a script: the other harness files are bound beside it (sandbox.child.HARNESS_FILES)
    import inline
    from measure import bind_torch as bind_measure
    from measure import flatten, import_file, load_task, make_inputs, one_line, set_precision
    from share import GpuOps, Region
    from wire import Channel, Link, recv_fds
    from wire import bind_torch as bind_wire

# Bound before any candidate code is imported: a candidate that monkeypatches time.perf_counter or
# torch.cuda.synchronize afterwards does not change what the harness measures with.
_perf = time.perf_counter
_sleep = time.sleep
_sync = lambda: None  # noqa: E731 - torch.cuda.synchronize, bound in main() before candidate import


_KERNELS: dict[str, str] = {}      # kernel name -> path of the compiled .so (set by the worker)
_LIBS: dict[str, ctypes.CDLL] = {}
_GUARD: list = []  # the dispatch guard's context-manager class, once loaded (_guard_cls)

# aten ops a candidate's forward may call: allocation, views and metadata. Everything else is compute.
# Constant fills are allocation (`torch::zeros` for an output that is accumulated into; the static scan's
# profiles read them the same way, rules.ALLOC): zeros/ones/full and their _like and new_ forms call
# empty and fill_ / zero_ in turn.
ALLOWED_OPS = frozenset("""
empty empty_like empty_strided new_empty new_empty_strided empty_permuted
zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full fill fill_ zero_
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


# ----------------------------------------------------------------------------- job kinds
def run_reference(job: dict, ch: Channel):
    """Validate the task (import, names, tensor inputs, one forward), or with `warm` fill inductor's caches."""
    import torch
    device = job["device"]
    try:
        task = load_task(job["task_path"])
        torch.manual_seed(job["init_seed"])
        model = task.Model(*task.get_init_inputs()).to(device)
        if job.get("warm"):
            return ch.send(_warm_compile(task, model, job))
        set_precision(False)
        with torch.no_grad():
            kind, _ = flatten(model(*make_inputs(task, 0, device)))
    except (ValueError, TypeError) as e:
        return ch.send({"type": "result", "task_error": str(e)[:400]})
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "task_error": f"reference forward failed: {one_line(e)}"})
    ch.send({"type": "result", "out_kind": kind,
             "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu"})


def _warm_compile(task, model, job: dict) -> dict:
    """Prewarm (sandbox.prewarm): one eager and one compiled forward under the baseline's precision and grad
    mode, so inductor's on-disk caches hold this graph when the baselines are timed. Nothing is timed."""
    import torch
    set_precision(job["precision"] == "tf32")
    xs = make_inputs(task, 0, job["device"])
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
    """The dispatch guard (guard.cpp, loaded from $CUDA_AGENT_GUARD with both allow-lists) as a context
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


def _snapshot() -> tuple:
    """The harness modules' globals and their classes' attributes, to undo Python-level patches by the candidate.
    A convenience for honest code that patches by accident: nothing the verdict rests on is in this process."""
    classes = (Channel, Link, Region, GpuOps, _Shared)
    mods = [sys.modules[c.__module__] for c in classes] + [sys.modules["measure"]]
    return {m: dict(vars(m)) for m in dict.fromkeys(mods)}, {c: dict(vars(c)) for c in classes}


def _restore(snap: tuple):
    mods, classes = snap
    for m, g in mods.items():
        vars(m).update(g)
    for cls, attrs in classes.items():
        for k, v in attrs.items():
            if k not in ("__dict__", "__weakref__") and getattr(cls, k, None) is not v:
                setattr(cls, k, v)


class _Shared:
    """The driver's regions as this child sees them: the inputs of every call (the same tensors each call),
    the output tensors it copies its result into, and on a GPU the go/done flags."""

    def __init__(self, device: str, attach: dict, fds: list):
        self.ops = GpuOps() if device == "cuda" else None
        regions = [Region(device, size, fd, self.ops) for size, fd in zip(attach["sizes"], fds)]
        self.xs, self.outs, self.specs = regions[0].views(attach["in"]), regions[1].views(attach["out"]), attach["out"]
        self.flags = regions[2].ptr if self.ops else None


def _compute(fn, sh: _Shared, req: dict, device: str, guard_cls) -> dict:
    """One call: (on a GPU, behind a wait for the driver's go flag) forward on the shared inputs, the output copied
    into the shared output, (GPU: the done flag written behind it on the same stream, then a sync unless the
    call is "queued", whose go comes only after the reply). The reply to the driver; a candidate's forward runs
    under the dispatch guard (and, for "ops", the profiler)."""
    import torch
    k = req["k"]
    stream = torch.cuda.current_stream().cuda_stream if sh.ops else None
    if sh.ops:
        sh.ops.wait_flag(stream, sh.flags, k)
    guard = guard_cls() if guard_cls else contextlib.nullcontext()
    py_before, prof = set(threading.enumerate()), None
    try:
        with torch.no_grad(), guard:
            if req["op"] == "ops":  # layer 2: the profiler's record of aten ops (outside the guard's view)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out = fn(*sh.xs)
                    _sync()
            else:
                out = fn(*sh.xs)
    except BaseException as e:  # noqa: BLE001
        if getattr(guard, "bad", None):
            return {"violation": f"aten op {guard.bad[0]} called inside forward (dispatch guard)"}
        return {"error": f"forward raised: {one_line(e)}"}
    if getattr(guard, "bad", None):  # an op the candidate caught and swallowed
        return {"violation": f"aten op {guard.bad[0]} called inside forward (dispatch guard)"}
    try:
        kind, ys = flatten(out)
    except TypeError as e:
        return {"error": str(e)}
    if len(ys) != len(sh.specs):
        return {"error": f"returned {len(ys)} tensors, expected {len(sh.specs)}"}
    for i, (y, (dt, shape)) in enumerate(zip(ys, sh.specs)):
        where = f"output {i}: " if len(ys) > 1 else ""
        if y.device.type != device:
            return {"error": f"{where}on {y.device.type}, expected {device}"}
        if str(y.dtype)[6:] != dt:
            return {"error": f"{where}dtype {str(y.dtype)[6:]}, expected {dt}"}
        if list(y.shape) != shape:
            return {"error": f"{where}shape {tuple(y.shape)}, expected {tuple(shape)}"}
    for dst, y in zip(sh.outs, ys):
        dst.copy_(y)
    if sh.ops:
        sh.ops.write_flag(stream, sh.flags + 4, k)
    if not req.get("queued"):  # queued: the driver writes the inputs and raises go only after this reply
        _sync()
    reply = {"k": k, "kind": kind}
    if prof is not None:
        ops = sorted({e.name for e in prof.events() if e.name.startswith("aten::")})
        bad = [n for n in ops if n[6:] not in ALLOWED_OPS]
        if bad:
            return {"violation": f"aten op {bad[0]} seen by the profiler inside forward", "ops": ops}
        reply["ops"] = ops
    if guard_cls:
        alive = [t for t in threading.enumerate() if t not in py_before and t.is_alive()]
        if alive:
            return {"violation": f"a thread started in forward is still alive after it returned ({alive[0].name})"}
    return reply


def _null(specs: list, device: str):
    """The forward of the driver's null calls (the queued clock's floor): no work, tensors of the outputs' specs
    allocated once, so that a call's copy into the output region and its flags are all it times."""
    import torch
    ys = [torch.empty(shape, dtype=getattr(torch, dt), device=device) for dt, shape in specs]
    return lambda *xs: ys


def run_compute(job: dict, ch: Channel):
    """A child that computes and nothing else (role "candidate": the task's eager forward, then the candidate's;
    role "baseline": eager and torch.compile). Inputs, outputs, the clock and every comparison are the driver's."""
    import torch
    device, cand = job["device"], job["role"] == "candidate"
    if device == "cuda" and cand:
        # one job per GPU: the cap turns a runaway allocation into a clean OOM error, below the driver's limit
        torch.cuda.set_per_process_memory_fraction(job.get("gpu_mem_fraction", 0.8))
    set_precision(job["precision"] == "tf32")
    task = load_task(job["task_path"])
    torch.randn(1 << 20).mul_(2).sum()  # start torch's own intra-op thread pool before the thread checks
    guard_cls = _guard_cls() if cand else None
    snapshot = _snapshot()
    ch.send({"type": "stage", "stage": "load"})  # torch imported, CUDA up (timestamped by the host)
    attach = ch.recv_control()["attach"]
    _, fds = recv_fds(job["fd_sock"])
    link, res = Link(fds[0]), {"type": "result", "stage": "load"}
    try:
        sh = _Shared(device, attach, fds[1:])
        torch.manual_seed(job["init_seed"])  # the driver's weights: same seed, same code
        fns = {"eager": task.Model(*task.get_init_inputs()).to(device), "null": _null(sh.specs, device) if sh.ops else None}
        if not cand:
            fns["compile"] = torch.compile(fns["eager"])
    except BaseException as e:  # noqa: BLE001
        link.send({"error": f"attaching to the shared buffers failed: {one_line(e)}"})
        return ch.send({**res, "error": f"attaching to the shared buffers failed: {one_line(e)}"})
    link.send({"attached": True})
    threads0 = None
    while True:
        req = link.recv()
        if req is None or req.get("op") == "end":
            break
        if req["op"] == "load":
            reply = _load(job, task, guard_cls, snapshot, fns)
            link.send(reply)
            if not reply.get("loaded"):
                res.update({k: reply[k] for k in ("error", "violation") if k in reply})
                break
            res["stage"] = "verify"
            continue
        reply = _compute(fns[req["fn"]], sh, req, device, guard_cls if req["fn"] == "cand" else None)
        _restore(snapshot)  # ... and patches made by its forward
        if req["fn"] == "cand" and (threads0 is None or req["op"] == "ops"):  # the profiler starts a thread of its own
            threads0 = _native_threads()
        link.send(reply)
        if reply.get("error") or reply.get("violation"):
            res.update({k: reply[k] for k in ("error", "violation") if k in reply})
            break
    grown = _new_threads(threads0) if threads0 is not None else set()
    if grown and not res.get("error"):
        res["violation"] = f"forward left {len(grown)} new native thread(s) running"
    ch.send(res)


def _load(job: dict, task, guard_cls, snapshot, fns: dict) -> dict:
    """Import and construct the candidate (after the eager rounds: nothing of it existed while they ran)."""
    import torch
    if job.get("ext_dir"):  # form (a): load_inline imports what the build child built (a private copy)
        inline.install(job["ext_dir"])
    if job.get("extension"):  # form (c): `import cuda_extension` loads the host's build of the workspace (a copy)
        inline.install_extension(job["extension"])
    try:
        model = _load_candidate(job, task, guard_cls)
    except PermissionError as e:
        return {"violation": str(e)}
    except BaseException as e:  # noqa: BLE001 - SystemExit from candidate code included
        return {"error": f"loading the candidate failed: {one_line(e)}"}
    _restore(snapshot)  # undo monkeypatches of the harness made by the candidate's import
    bad = _inherits_reference(type(model), task)
    if bad:
        return {"violation": bad}
    del fns["eager"], fns["null"]
    if job["device"] == "cuda":
        torch.cuda.empty_cache()  # the candidate gets the memory the eager model held
    fns["cand"] = model
    return {"loaded": True}


def run_build(job: dict, ch: Channel):
    """Import the solution and construct ModelNew once, so that load_inline builds into the shared build dir.
    No input, seed or reference exists in this process; errors are left to the candidate run to report."""
    import torch
    inline.install(job["ext_dir"])
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


HARNESS = ("sandbox_worker", "inline", "measure", "wire", "share", "driver", "rules")  # their module names here


def run_call(job: dict, ch: Channel):
    import importlib
    with open(job["args_path"], "rb") as f:
        args = pickle.load(f)  # written by the host: trusted data
    mod_name, fn_name = job["fn"].split(":")
    # `fn` names a module of the repository (three levels above this file; a call child sees it), which may
    # import the sandbox package: the harness files already running here serve as its sandbox.harness modules
    # too, so no file runs twice in this process under two names
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if not __package__:
        for name in (n for n in HARNESS if n in sys.modules):
            sys.modules.setdefault(f"sandbox.harness.{name}", sys.modules[name])
    try:
        result = getattr(importlib.import_module(mod_name), fn_name)(**args)
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "error": f"{job['fn']} raised {one_line(e)}",
                        "traceback": traceback.format_exc()[-2000:]})
    ch.send({"type": "result", "value": result})


def _warm_up(device: str, warm_for: str, ch: Channel):
    """A warm child's start-up, before its job exists: torch and CUDA up and, in a candidate spare, each of the
    harness's own checks (dispatch guard, profiler) run once on a throwaway tensor, so the first candidate
    call pays none of their one-time costs; a reference (baseline) spare instead imports torch.compile's
    machinery (dynamo, inductor), a driver spare the driver and the driver API; a build spare only torch's
    extension builder (no CUDA context). A stage
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
    elif warm_for == "driver":
        _driver()  # imported before the job, like a reference spare's inductor
        if device == "cuda":
            GpuOps()
    else:
        with torch.no_grad(), _guard_cls()():
            torch.empty_like(x)
        ch.send({"type": "stage", "stage": "guard"})
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            torch.relu(x)
        ch.send({"type": "stage", "stage": "profiler"})
    torch.randn(1 << 20).mul_(2).sum()  # torch's intra-op thread pool, started before any thread check
    _sync()
    ch.send({"type": "stage", "stage": "warm"})


def _driver():
    """The driver's module (sandbox/harness/driver.py), imported by a driver child only."""
    if __package__:
        from . import driver
    else:
        import driver
    return driver


def main(jobfile: str) -> int:
    sys.modules.setdefault("sandbox_worker", sys.modules[__name__])  # model_new imports the helpers
    with open(jobfile) as f:
        job = json.load(f)
    ch = Channel(job["result_fd"], b"", job.get("control_fd"))
    ch.nonce = bytes.fromhex(ch.recv_control()["nonce"])  # first control line; never in a file
    ch.send({"type": "stage", "stage": "started"})  # before any task or candidate code: the host can tell a
    # child that never started (its own failure) from a candidate that crashed (a verdict)
    if job["kind"] in ("reference", "candidate", "baseline", "driver", "warm") or job.get("device") == "cuda":
        _bind_torch(job.get("device", "cpu"))  # before any candidate code runs (patched timers)
    if job["kind"] == "warm":  # a spare: everything that needs no job, then wait for the one job it serves
        ch.send({"type": "stage", "stage": "torch"})
        _warm_up(job["device"], job.get("for", "candidate"), ch)
    # Everything imported so far is moved out of the collector's reach: a full collection with torch, CUDA and
    # inductor loaded took ~0.1 s, and would otherwise run on the job's clock (and again in its timed calls).
    gc.collect()
    gc.freeze()
    if job["kind"] == "warm":
        job = {**ch.recv_control()["job"], **{k: job[k] for k in ("result_fd", "control_fd", "fd_sock")}}
    if job["kind"] == "driver":
        return _exit(_driver().run_driver(job, ch))
    if job["kind"] in ("candidate", "baseline"):
        job = {**job, "role": job["kind"]}
    run = {"reference": run_reference, "candidate": run_compute, "baseline": run_compute, "build": run_build,
           "call": run_call}[job["kind"]]
    _exit(run(job, ch))


def _exit(_=None):
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (candidate atexit hooks, CUDA teardown races)


if __name__ == "__main__":
    if sys.argv[1] == "--probe":  # sandbox.isolation(): the interpreter and this file start under the wrapper
        print("sandbox_worker ok")
        sys.exit(0)
    main(sys.argv[1])
