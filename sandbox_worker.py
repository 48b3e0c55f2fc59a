"""Code that runs INSIDE an isolated sandbox child (`python sandbox_worker.py JOBFILE`).

The host (`sandbox.py`) never imports candidate code; it launches this file in a fresh process per job,
inside bubblewrap/unshare (see sandbox.py's threat model). Three job kinds:
  * `reference`: load the pristine task, compute reference outputs for the given seeds (always strict
    fp32, no TF32), return them with the reference's state_dict, and optionally time the eager and
    `torch.compile` baselines.
  * `candidate`: load the task (for get_inputs/get_init_inputs) and the candidate `ModelNew`, run the
    correctness trials under the dispatch guard, the profiler layer, the thread checks, and time it.
    It never sees the reference outputs: the host compares.
  * `call`: run a generic `module:function(**args)` for `sandbox.run_isolated`.
Results go to the host as nonce-framed `torch.save` messages on an inherited pipe fd, never stdout.

It also exports the runtime helpers that a workspace's `model_new.py` uses (contract, form (b)):
    from sandbox_worker import load_kernel, ptr, stream

Departures from the paper:
  1. The paper's sandbox is not public; the checks here follow issue 2 and KernelBench's known hacks
     (paper-notes section 6).

Smoke: python -m pytest tests/test_sandbox.py -q -k honest
"""
from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import os
import pickle
import struct
import sys
import threading
import time
import traceback

# Bound before any candidate code is imported: a candidate that monkeypatches time.perf_counter or
# torch.cuda.synchronize afterwards does not change what the harness measures with.
_perf = time.perf_counter
_sleep = time.sleep
_sync = lambda: None  # noqa: E731 - torch.cuda.synchronize, bound in main() before candidate import

_KERNELS: dict[str, str] = {}      # kernel name -> path of the compiled .so (set by the worker)
_LIBS: dict[str, ctypes.CDLL] = {}

# aten ops a candidate's forward may call: allocation, views and metadata. Everything else is compute.
ALLOWED_OPS = frozenset("""
empty empty_like empty_strided new_empty new_empty_strided empty_permuted
view _unsafe_view reshape _reshape_alias as_strided t transpose permute expand expand_as squeeze
unsqueeze slice select split split_with_sizes unbind narrow chunk detach detach_ alias lift_fresh
view_as flatten unflatten movedim diagonal unfold view_as_real view_as_complex resolve_conj resolve_neg
sym_size sym_stride sym_numel sym_storage_offset size stride numel dim is_contiguous contiguous
is_same_size _local_scalar_dense item to record_stream is_nonzero _has_compatible_shallow_copy_type
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
    import torch
    assert type(t) in (torch.Tensor, torch.nn.Parameter), f"ptr() needs a torch.Tensor, got {type(t).__name__}"
    return ctypes.c_void_p(t.data_ptr())


def stream() -> ctypes.c_void_p | None:
    """The current CUDA stream as a cudaStream_t (c_void_p), or None on cpu."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    return None


# ----------------------------------------------------------------------------- result channel
class Channel:
    """Nonce-framed messages on the inherited result fd: nonce(16) | len(8) | torch.save(dict)."""

    def __init__(self, fd: int, nonce: bytes, control_fd: int | None):
        self.fd, self.nonce, self.control_fd = fd, nonce, control_fd

    def send(self, msg: dict):
        import io
        import torch
        buf = io.BytesIO()
        torch.save(msg, buf)
        data = self.nonce + struct.pack(">Q", len(buf.getvalue())) + buf.getvalue()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def recv_control(self) -> dict:
        """One JSON line from the host (used for the late post-timing seed)."""
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(self.control_fd, 1)
            assert chunk, "host closed the control pipe"
            line += chunk
        return json.loads(line)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


# ----------------------------------------------------------------------------- task / candidate loading
def _import_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load_task(path: str):
    """Import the task and check its three names; raises ValueError('one line') on a malformed task."""
    try:
        mod = _import_file(path, "cuda_agent_task")
    except BaseException as e:  # noqa: BLE001 - any import failure is a task error
        raise ValueError(f"task import failed: {_one_line(e)}") from None
    missing = [n for n in ("Model", "get_inputs", "get_init_inputs") if not hasattr(mod, n)]
    if missing:
        raise ValueError(f"task is missing {', '.join(missing)}")
    return mod


def _make_inputs(task, seed: int, device: str) -> list:
    import torch
    torch.manual_seed(seed)
    # Factory calls in get_inputs() allocate on `device` directly: KernelBench level-1 inputs reach several GB,
    # and drawing them on the CPU then copying took most of a check (values differ from a CPU draw, but the
    # reference and the candidate draw the same way, which is all that matters).
    with torch.device(device):
        xs = task.get_inputs()
    if not isinstance(xs, (list, tuple)):
        raise ValueError(f"get_inputs() must return a list, got {type(xs).__name__}")
    bad = [type(x).__name__ for x in xs if not isinstance(x, torch.Tensor)]
    if bad:
        raise ValueError(f"get_inputs() returned non-tensor inputs: {', '.join(bad)}")
    return [x.to(device) for x in xs]


def _flatten(out):
    """(kind, [tensors]) for a Tensor or a tuple/list of plain Tensors; raises TypeError otherwise."""
    import torch
    if type(out) is torch.Tensor:
        return "tensor", [out]
    if type(out) in (tuple, list) and out and all(type(x) is torch.Tensor for x in out):
        return type(out).__name__, list(out)
    inner = ", ".join(type(x).__name__ for x in out) if isinstance(out, (tuple, list)) else ""
    raise TypeError(f"output must be exactly torch.Tensor (or a tuple/list of them), got "
                    f"{type(out).__name__}{'(' + inner + ')' if inner else ''}")


def _to_host(outs: list) -> list:
    return [x.detach().to("cpu", copy=True).contiguous() for x in outs]


def _set_precision(tf32: bool):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


# ----------------------------------------------------------------------------- timing (baselines AND candidate)
class Timer:
    """Times forward calls the same way for baselines and candidates.

    Per iteration (outside the timed region): refill the inputs IN PLACE with fresh values (same pointers,
    new content, so pointer- or content-keyed caches miss), flush the L2 (cuda: write 256 MB), then
    device-wide synchronize; timed region: forward + device-wide synchronize (covers every stream).
    """

    def __init__(self, task, inputs: list, device: str, seed: int, clocks: tuple | None = None):
        import torch
        self.device, self.inputs = device, inputs
        self.perf, self.sync = clocks or (_perf, _sync)  # captured before candidate import (run_candidate)
        self.variants = [_make_inputs(task, seed + 7919 * (k + 1), device) for k in range(3)]
        self.flush_buf = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device=device) \
            if device == "cuda" else None

    def refill(self, i: int, src: list | None = None):
        import torch
        src = src if src is not None else self.variants[i % len(self.variants)]
        with torch.no_grad():
            for x, v in zip(self.inputs, src):
                x.copy_(v)
                if src is not self.variants[i % len(self.variants)] or not x.is_floating_point():
                    continue
                x.mul_(1.0 + 1e-3 * (i + 1))  # unique content per iteration (content-keyed caches miss)
        if self.flush_buf is not None:
            self.flush_buf.fill_(float(i))
        self.sync()

    def run(self, fn, warmup: int, iters: int, final: list | None = None, final_wrap=None):
        """Returns (times_ms list, last output). If `final` is given, the last iteration uses it."""
        perf, sync = self.perf, self.sync  # read once: patching the Timer during forward changes nothing
        for i in range(warmup):
            self.refill(i)
            fn(*self.inputs)
        times, out = [], None
        for i in range(iters):
            last = final is not None and i == iters - 1
            self.refill(i, final if last else None)
            call = final_wrap(fn) if (last and final_wrap) else fn
            t0 = perf()
            out = call(*self.inputs)
            sync()
            times.append((perf() - t0) * 1e3)
        return times, out


def _stats(times: list) -> dict:
    import statistics
    med = statistics.median(times)
    mean = statistics.fmean(times)
    cv = statistics.pstdev(times) / mean if mean > 0 else 0.0
    return {"median_ms": med, "mean_ms": mean, "cv": cv, "n_iters": len(times), "sum_ms": sum(times)}


# ----------------------------------------------------------------------------- job kinds
def run_reference(job: dict, ch: Channel):
    """Reference outputs for every seed (strict fp32), the state_dict, and optionally the baselines."""
    import torch
    device = job["device"]
    try:
        task = _load_task(job["task_path"])
        torch.manual_seed(job["init_seed"])
        init = task.get_init_inputs()
        model = task.Model(*init).to(device)
        if job.get("warm"):
            return ch.send(_warm_compile(task, model, job))
        outs, kind = {}, None
        _set_precision(False)
        for seed in job["seeds"]:
            xs = _make_inputs(task, seed, device)
            with torch.no_grad():
                y = model(*xs)
            kind, ys = _flatten(y)
            outs[seed] = _to_host(ys)
    except (ValueError, TypeError) as e:
        return ch.send({"type": "result", "task_error": str(e)[:400]})
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "task_error": f"reference forward failed: {_one_line(e)}"})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    res = {"type": "result", "outputs": outs, "out_kind": kind, "state_dict": sd, "device_name": name,
           "init_inputs": [x for x in init if isinstance(x, (int, float, bool, str))]}
    if job.get("baselines"):
        res["baselines"] = _time_baselines(task, model, job)
    ch.send(res)


def _warm_compile(task, model, job: dict) -> dict:
    """Prewarm (sandbox.prewarm): one eager and one compiled forward under the baseline's precision and grad
    mode, so inductor's on-disk caches hold this graph when the baselines are timed. Nothing is timed."""
    import torch
    device = job["device"]
    _set_precision(job["precision"] == "tf32")
    xs = _make_inputs(task, job["timing_seed"], device)
    res = {"type": "result", "warmed": True, "compile_error": None}
    with torch.no_grad():
        model(*xs)
        try:
            torch.compile(model)(*xs)
        except BaseException as e:  # noqa: BLE001 - the timed run records the same error
            res["compile_error"] = _one_line(e)
    _sync()
    return res


def _time_baselines(task, model, job: dict) -> dict:
    import torch
    device, seed = job["device"], job["timing_seed"]
    _set_precision(job["precision"] == "tf32")
    xs = _make_inputs(task, seed, device)
    timer = Timer(task, xs, device, seed)
    res = {}
    with torch.no_grad():
        times, _ = timer.run(model, job["warmup"], job["iters"])
        res["eager"] = _stats(times)
        try:
            compiled = torch.compile(model)
            times, _ = timer.run(compiled, max(job["warmup"], 3), job["iters"])
            res["compile"] = _stats(times)
        except BaseException as e:  # noqa: BLE001 - e.g. no C compiler for inductor
            res["compile"] = None
            res["compile_error"] = _one_line(e)
    return res


def _guard_cls():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Guard(TorchDispatchMode):
        """Records (and refuses) every aten compute op called while ModelNew.forward runs."""

        def __init__(self):
            super().__init__()
            self.bad: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None, _allowed=ALLOWED_OPS):
            if func.namespace in ("aten", "prims") and func.overloadpacket.__name__ not in _allowed:
                self.bad.append(str(func))
                raise RuntimeError(f"sandbox: aten op {func} is not allowed inside ModelNew.forward")
            return func(*args, **(kwargs or {}))
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


def _load_candidate(job: dict, task):
    import torch
    for name, path in job.get("kernels", {}).items():
        _KERNELS[name] = path
    sys.path.insert(0, job["cand_dir"])
    os.chdir(job["cand_dir"])
    mod = _import_file(job["cand_path"], "model_new")
    assert hasattr(mod, "ModelNew"), "solution defines no ModelNew"
    torch.manual_seed(job["init_seed"])
    model = mod.ModelNew(*task.get_init_inputs())
    assert isinstance(model, torch.nn.Module), "ModelNew must be an nn.Module"
    ref_sd = torch.load(job["state_dict_path"], weights_only=True)
    own = model.state_dict()
    for k, v in ref_sd.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise ValueError(f"state_dict shape mismatch for {k}: {tuple(own[k].shape)} vs {tuple(v.shape)}")
    model.load_state_dict(ref_sd, strict=False)
    return model.to(job["device"])


def _forward_checked(model, xs, guard_cls, device, sync):
    """One guarded forward: (output, violation|None). Raises on candidate exceptions (no violation)."""
    import torch
    if device == "cuda":  # Sakana: freed memory is garbage, not a reference output or a previous result
        junk = torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(float("nan"))
        del junk
        sync()  # the harness's own queued work (inputs, copies, this fill) ends before the candidate's starts,
        # so a candidate on its own stream does not race it (that would be our bug, not the candidate's)
    py_before = set(threading.enumerate())
    guard = guard_cls()
    try:
        with torch.no_grad(), guard:
            out = model(*xs)
    except BaseException:
        if guard.bad:
            return None, f"aten op {guard.bad[0]} called inside forward (dispatch guard)"
        raise
    if guard.bad:
        return None, f"aten op {guard.bad[0]} called inside forward (dispatch guard)"
    sync()
    alive = [t for t in threading.enumerate() if t not in py_before and t.is_alive()]
    if alive:
        return out, f"a thread started in forward is still alive after it returned ({alive[0].name})"
    return out, None


def run_candidate(job: dict, ch: Channel):
    import torch
    device, res = job["device"], {"type": "result", "stage": "load"}
    clocks = (_perf, _sync)  # local references: rebinding sandbox_worker._perf/_sync later changes nothing
    if device == "cuda":
        # one job per GPU: the cap turns a runaway allocation into a clean OOM error, below the driver's limit
        torch.cuda.set_per_process_memory_fraction(job.get("gpu_mem_fraction", 0.9))
    _set_precision(job["precision"] == "tf32")
    task = _load_task(job["task_path"])
    trial_inputs = [_make_inputs(task, s, device) for s in job["seeds"]]  # drawn as the reference draws them
    ch.send({"type": "stage", "stage": "load"})  # torch imported, CUDA up, inputs drawn (timestamped by the host)
    torch.randn(1 << 20).mul_(2).sum()  # start torch's own intra-op thread pool before the thread checks
    guard_cls = _guard_cls()
    snapshot = _snapshot()
    try:
        model = _load_candidate(job, task)
    except BaseException as e:  # noqa: BLE001 - SystemExit from candidate code included
        res["error"] = f"loading the candidate failed: {_one_line(e)}"
        return ch.send(res)
    _restore(snapshot)  # undo monkeypatches of this module made by the candidate's import
    res["violation"] = _inherits_reference(type(model), task)
    if res["violation"]:
        return ch.send(res)
    res["stage"] = "verify"
    ch.send({"type": "stage", "stage": "verify"})
    res.update(_verify(model, task, trial_inputs, guard_cls, job, clocks))
    if res.get("error") or res.get("violation") or not job["profile"]:
        return ch.send(res)
    res["stage"] = "profile"
    _restore(snapshot)  # ... and by its forward during verify
    res.update(_profile(model, task, [x.to(device) for x in trial_inputs[0]], guard_cls, job, ch, clocks))
    ch.send(res)


def _snapshot() -> tuple:
    """This module's globals and its classes' attributes, to undo Python-level patches by the candidate."""
    return dict(globals()), {c: dict(vars(c)) for c in (Timer, Channel)}


def _restore(snap: tuple):
    g, classes = snap
    globals().update(g)
    for cls, attrs in classes.items():
        for k, v in attrs.items():
            if k not in ("__dict__", "__weakref__") and getattr(cls, k, None) is not v:
                setattr(cls, k, v)


def _verify(model, task, trial_inputs, guard_cls, job, clocks) -> dict:
    import torch
    device, res, outs, kind = job["device"], {}, {}, None
    threads0 = None
    for i, (seed, xs) in enumerate(zip(job["seeds"], trial_inputs)):
        xs = [x.to(device) for x in xs]
        copies = [x.clone() for x in xs]
        try:
            out, viol = _forward_checked(model, xs, guard_cls, device, clocks[1])
        except BaseException as e:  # noqa: BLE001
            return {"error": f"forward raised on trial {i}: {_one_line(e)}"}
        if viol:
            return {"violation": viol}
        try:
            kind, ys = _flatten(out)
        except TypeError as e:
            return {"error": str(e)}
        if i == 0:  # the output must not change after forward returned (a thread still writing it)
            snap = [y.clone() for y in ys]
            _sleep(0.05)
            clocks[1]()
            if not all(torch.equal(a, b) or _nan_equal(a, b) for a, b in zip(snap, ys)):
                return {"violation": "the output changed after forward returned (background writer)"}
            threads0 = _native_threads()
        for x, c in zip(xs, copies):
            if not _nan_equal(x, c):
                return {"violation": f"forward modified its inputs (trial {i})"}
        outs[seed] = _to_host(ys)
        res.setdefault("devices", [str(y.device.type) for y in ys])
    grown = _new_threads(threads0)
    if grown:
        return {"violation": f"forward left {len(grown)} new native thread(s) running"}
    res.update({"trials": outs, "out_kind": kind, "threads_after_warmup": sorted(threads0)})
    # layer 2: the profiler's record of aten ops, without the dispatch guard
    try:
        xs = [x.to(device) for x in trial_inputs[0]]
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(*xs)
        names = {e.name for e in prof.events()}
    except BaseException as e:  # noqa: BLE001
        return {"error": f"forward raised under the profiler: {_one_line(e)}"}
    res["profiler_ops"] = sorted(n for n in names if n.startswith("aten::"))  # the host re-checks these
    bad = [n for n in res["profiler_ops"] if n[6:] not in ALLOWED_OPS]
    if bad:
        res["violation"] = f"aten op {bad[0]} seen by the profiler inside forward"
    return res


def _nan_equal(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _profile(model, task, xs, guard_cls, job, ch, clocks) -> dict:
    """Time the candidate; the final iteration runs on inputs of a seed the host sends only now."""
    import torch
    device = job["device"]
    timer = Timer(task, xs, device, job["timing_seed"], clocks)  # fresh per job, not from the reference pool
    state = {}

    def guarded(fn):  # the final (checked) iteration also runs under the dispatch guard
        def call(*a):
            out, state["viol"] = _forward_checked(fn, a, guard_cls, device, clocks[1])
            return out
        return call

    threads0 = _native_threads()  # after the verify trials and the profiler (which starts its own thread)
    ch.send({"type": "timing_start"})
    t_phase = clocks[0]()
    final_seed = ch.recv_control()["final_seed"]
    final = _make_inputs(task, final_seed, device)
    try:
        with torch.no_grad():
            times, out = timer.run(model, job["warmup"], job["iters"], final=final, final_wrap=guarded)
    except BaseException as e:  # noqa: BLE001
        return {"error": f"forward raised during timing: {_one_line(e)}"}
    phase_ms = (clocks[0]() - t_phase) * 1e3
    ch.send({"type": "timing_end"})
    res = {"timing": _stats(times), "phase_ms": phase_ms, "final_seed": final_seed}
    if state.get("viol"):
        return {**res, "violation": state["viol"]}
    try:
        res["final_kind"], ys = _flatten(out)
    except TypeError as e:
        return {**res, "error": str(e)}
    res["final"] = _to_host(ys)
    grown = _new_threads(threads0)
    if grown:
        res["violation"] = f"forward left {len(grown)} new native thread(s) running (timing)"
    return res


def run_call(job: dict, ch: Channel):
    import importlib
    with open(job["args_path"], "rb") as f:
        args = pickle.load(f)  # written by the host: trusted data
    mod_name, fn_name = job["fn"].split(":")
    try:
        result = getattr(importlib.import_module(mod_name), fn_name)(**args)
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "error": f"{job['fn']} raised {_one_line(e)}",
                        "traceback": traceback.format_exc()[-2000:]})
    ch.send({"type": "result", "value": result})


def main(jobfile: str) -> int:
    sys.modules.setdefault("sandbox_worker", sys.modules[__name__])  # model_new imports the helpers
    with open(jobfile) as f:
        job = json.load(f)
    ch = Channel(job["result_fd"], bytes.fromhex(job["nonce"]), job.get("control_fd"))
    global _sync
    if job.get("device") == "cuda":
        import torch
        _sync = torch.cuda.synchronize  # bound before any candidate code runs (patched timers)
    gc.collect()
    {"reference": run_reference, "candidate": run_candidate, "call": run_call}[job["kind"]](job, ch)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (candidate atexit hooks, CUDA teardown races)


if __name__ == "__main__":
    main(sys.argv[1])
