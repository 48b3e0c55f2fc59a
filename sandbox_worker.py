"""Code that runs INSIDE an isolated sandbox child (`python sandbox_worker.py JOBFILE`).

The host (`sandbox.py`) never imports candidate code; it starts this file in a fresh process per job,
inside bubblewrap (see sandbox.py's threat model). Three job kinds:
  * `reference`: load the pristine task; compute full outputs for the trial seeds and sketches
    (`sketch`) for the timing seeds, always in strict fp32; optionally time the eager and
    `torch.compile` baselines in interleaved rounds.
  * `candidate`: load the task and the candidate `ModelNew` (import and `__init__` under the dispatch
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

Past the usual size on purpose: with sandbox_inline.py (form (a)'s load_inline) it is the only project code
a child can see (the repository is hidden and these two files alone are bound in at HARNESS_DIR), so nothing
it runs may import another module of the project.

Smoke: python -m pytest tests/test_sandbox.py -q -k honest
"""
from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import mmap
import os
import pickle
import select
import struct
import sys
import threading
import time
import traceback

import sandbox_inline  # bound beside this file in the child (sandbox_child.HELPERS)

# Bound before any candidate code is imported: a candidate that monkeypatches time.perf_counter or
# torch.cuda.synchronize afterwards does not change what the harness measures with.
_perf = time.perf_counter
_sleep = time.sleep
_sync = lambda: None  # noqa: E731 - torch.cuda.synchronize, bound in main() before candidate import

_T: dict = {}  # torch functions the harness's own checks use, bound in main() before candidate import

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
    import torch
    assert type(t) in (torch.Tensor, torch.nn.Parameter), f"ptr() needs a torch.Tensor, got {type(t).__name__}"
    return ctypes.c_void_p(t.data_ptr())


def stream() -> ctypes.c_void_p | None:
    """The current CUDA stream as a cudaStream_t (c_void_p), or None on cpu. On the launch path of every
    call: the raw-stream query costs well under a microsecond (torch.cuda.current_stream() builds objects)."""
    import torch
    if torch.cuda.is_initialized():
        return ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()))
    return None


# ----------------------------------------------------------------------------- result channel
WIRE_DTYPES = ("float32", "float16", "bfloat16", "float64", "complex64", "complex128", "int64", "int32", "int16",
               "int8", "uint8", "bool")  # all a message's tensors may be (the host allocates from this list)


def encode(msg, place=None) -> tuple[bytes, list]:
    """(JSON head, [contiguous cpu tensors]) for plain data with tensors in it. Tensors travel as raw bytes
    after the head, so neither side pickles (the host never unpickles what a candidate wrote) and a 64 MB
    output costs one device-to-host copy and one pipe write. `place(t)` may put a tensor in the shared output
    buffer instead and return its offset (`at` in its spec; None: it does not fit, it takes the pipe)."""
    import torch
    tensors: list = []

    def enc(o):
        if isinstance(o, torch.Tensor):
            o = o.detach()
            assert str(o.dtype)[6:] in WIRE_DTYPES and o.layout == torch.strided, f"cannot send a {o.dtype} tensor"
            spec = {"__t__": len(tensors), "dtype": str(o.dtype)[6:], "shape": list(o.shape)}
            at = place(o) if place is not None else None
            if at is not None:
                tensors.append(None)
                return {**spec, "at": at}
            # through pinned memory: a device-to-host copy into fresh pageable memory ran at ~1 GB/s on an H200
            # host (page faults), into pinned memory at ~50 GB/s (docs/RESULTS.md)
            t = _T.get("empty", torch.empty)(o.shape, dtype=o.dtype, pin_memory=True).copy_(o) if o.is_cuda \
                else o.contiguous()
            tensors.append(t)
            return spec
        if isinstance(o, dict):
            if all(type(k) is str and not k.startswith("__") for k in o):
                return {k: enc(v) for k, v in o.items()}
            return {"__items__": [[enc(k), enc(v)] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"__tuple__": [enc(x) for x in o]}
        if isinstance(o, list):
            return [enc(x) for x in o]
        if o is None or type(o) in (bool, int, float, str):
            return o
        raise TypeError(f"cannot send a {type(o).__name__}")
    return json.dumps(enc(msg)).encode(), tensors


def tensor_specs(head) -> list[tuple[str, list[int], int | None]]:
    """The (dtype, shape, offset in the shared buffer or None) of each tensor a decoded head refers to, in
    order; raises ValueError if malformed."""
    specs: dict[int, tuple] = {}

    def walk(o):
        if isinstance(o, dict):
            if "__t__" in o:
                i, dt, shape, at = o.get("__t__"), o.get("dtype"), o.get("shape"), o.get("at")
                if set(o) - {"at"} != {"__t__", "dtype", "shape"} or type(i) is not int or i in specs or \
                        dt not in WIRE_DTYPES or not isinstance(shape, list) or \
                        not all(type(d) is int and d >= 0 for d in shape) or \
                        ("at" in o and not (type(at) is int and at >= 0)):
                    raise ValueError("bad tensor spec")
                specs[i] = (dt, shape, at)
            else:
                for v in o.values():
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(head)
    if sorted(specs) != list(range(len(specs))):
        raise ValueError("bad tensor numbering")
    return [specs[i] for i in range(len(specs))]


def decode(head, tensors: list):
    """Inverse of `encode` (the host's side), given the tensors read for `tensor_specs(head)`."""
    if isinstance(head, dict):
        if "__t__" in head:
            return tensors[head["__t__"]]
        if "__items__" in head:
            return {decode(k, tensors): decode(v, tensors) for k, v in head["__items__"]}
        if "__tuple__" in head:
            return tuple(decode(x, tensors) for x in head["__tuple__"])
        return {k: decode(v, tensors) for k, v in head.items()}
    if isinstance(head, list):
        return [decode(x, tensors) for x in head]
    return head


class Channel:
    """Nonce-framed messages on the inherited result fd: nonce(16) | len(8) | JSON head, then one frame
    nonce(16) | len(8) | raw bytes per tensor the head names (`encode`) that is not in the shared buffer."""

    def __init__(self, fd: int, nonce: bytes, control_fd: int | None):
        self.fd, self.nonce, self.control_fd, self._buf = fd, nonce, control_fd, b""
        self.shm = None  # the output buffer shared with the host (memfd), mapped once a job gives its size

    def map_shm(self, fd: int, n: int, device: str):
        """Map the host's output buffer (n bytes; the host sealed it against shrinking) and, on a GPU, pin it
        for the device-to-host copies."""
        import torch
        self.shm = mmap.mmap(fd, n)
        if device == "cuda":  # a failed registration only makes the copies slower
            torch.cuda.cudart().cudaHostRegister(_T["frombuffer"](self.shm, dtype=torch.uint8).data_ptr(), n, 0)

    def _placer(self, slot: int):
        """`encode`'s `place` for half `slot` of the shared buffer: 64-byte aligned offsets, in order."""
        import torch
        half = len(self.shm) // 2
        end, cursor = (slot + 1) * half, [slot * half]

        def place(t) -> int | None:
            n, at = t.numel() * t.element_size(), (cursor[0] + 63) // 64 * 64
            if at + n > end:
                return None
            if n:
                dst = _T["frombuffer"](self.shm, dtype=torch.uint8, count=n, offset=at)
                dst.view(t.dtype).view(t.shape).copy_(t)
            cursor[0] = at + n
            return at
        return place

    def _write(self, data):
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view):]

    def send(self, msg: dict, slot: int | None = None):
        """Send `msg`; with `slot` (0 or 1) its tensors go into that half of the shared buffer where they fit."""
        import torch
        head, tensors = encode(msg, self._placer(slot) if slot is not None and self.shm is not None else None)
        self._write(self.nonce + struct.pack(">Q", len(head)) + head)
        for t in (t for t in tensors if t is not None):
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            self._write(self.nonce + struct.pack(">Q", t.numel() * t.element_size()))
            self._write(raw)

    def recv_control(self, spin_s: float = 0.0) -> dict:
        """One JSON line from the host. The host writes one line per request it answers, so the pipe never
        holds a request before the previous one is answered (a seed exists in this process only once it is
        used); only the nonce and a warm child's job line can arrive together. With `spin_s` it polls for
        that long before blocking: between timed calls the process stays awake, so the next call's host-side
        launch path is not slowed by a sleep (~30 us on an H200 host, docs/RESULTS.md)."""
        deadline = _perf() + spin_s
        while b"\n" not in self._buf:
            if spin_s and _perf() < deadline and not select.select([self.control_fd], [], [], 0)[0]:
                continue
            chunk = os.read(self.control_fd, 4096)
            assert chunk, "host closed the control pipe"
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
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


def _set_precision(tf32: bool):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


# ----------------------------------------------------------------------------- sketches (every timed call)
SKETCH_KEYS = 3          # projections per output; an output that is wrong by about its own norm passes one
SKETCH_CHUNK = 1 << 24   # with probability ~0.06 (see sandbox_rules.sketch_close), so three keys: ~2e-4


def sketch(ys: list, keys: list[int]) -> list[dict]:
    """Per output: shape, dtype, device, the count of non-finite values, the L2 norm of the finite values, and
    one projection <y, r_k> per key, r_k ~ N(0, 1) drawn on y's device from the key (same draw in the
    reference child and the candidate child: same code, same device type, same torch).

    The candidate child computes this on its output only after its forward returned and only then gets
    the keys, so no output can be shaped to match a projection it does not know. Uses the torch functions
    bound before candidate import (`_T`), not whatever the candidate left in `torch.*`. Sums stay on the
    device: one host sync per output. (1 M-element chunks were 0.6-0.9 s slower per check on an H200 for
    a 64 MB output and no faster per timed call; see docs/RESULTS.md.)"""
    import torch
    out = []
    for j, y in enumerate(ys):
        flat = _T["reshape"](y.detach(), (-1,))
        n = flat.shape[0]
        gens = [_T["Generator"](device=flat.device) for _ in keys]
        for g, k in zip(gens, keys):
            g.manual_seed((int(k) * 1_000_003 + j) % (2**63))
        acc = _T["zeros"](2 + len(keys), dtype=torch.float64, device=flat.device)  # nonfinite, sum sq, proj
        for i in range(0, n, SKETCH_CHUNK):
            x = _T["to"](flat[i:i + SKETCH_CHUNK], dtype=torch.float64)
            fin = _T["isfinite"](x)
            acc[0] += x.shape[0] - _T["sum"](fin)
            x = _T["where"](fin, x, _T["zeros_like"](x))
            acc[1] += _T["dot"](x, x)
            for kk, g in enumerate(gens):
                r = _T["randn"](x.shape[0], generator=g, device=x.device, dtype=torch.float32)
                acc[2 + kk] += _T["dot"](x, _T["to"](r, dtype=torch.float64))
        vals = acc.tolist()
        out.append({"shape": list(y.shape), "dtype": str(y.dtype), "device": y.device.type, "numel": n,
                    "nonfinite": int(vals[0]), "norm": max(vals[1], 0.0) ** 0.5, "proj": vals[2:]})
    return out


def _bind_torch():
    """Bind the torch functions `sketch` uses before any candidate code can rebind them."""
    import torch
    _T.update(reshape=torch.reshape, Generator=torch.Generator, to=torch.Tensor.to, isfinite=torch.isfinite,
              sum=torch.sum, where=torch.where, zeros_like=torch.zeros_like, dot=torch.dot, randn=torch.randn,
              zeros=torch.zeros, empty=torch.empty, frombuffer=torch.frombuffer)


# ----------------------------------------------------------------------------- baselines (trusted code)
class Timer:
    """Times forward calls of the trusted reference (eager and `torch.compile` baselines) exactly the way a
    candidate's timed calls are timed (`_serve`): fresh inputs drawn for every call, the NaN scrub, then
    forward + device-wide synchronize in the timed region, then a sketch of the output (untimed). A speedup
    then compares like with like: on an H200 the fresh inputs and the sketch between calls add ~15-25 us to
    a 50 us launch-bound call, to the baseline's and the candidate's alike (docs/RESULTS.md)."""

    def __init__(self, task, device: str, seed: int):
        self.task, self.device, self.seed = task, device, seed

    def run(self, fn, warmup: int, iters: int) -> list:
        import random
        times, rng = [], random.Random(self.seed)
        for i in range(warmup + iters):
            xs = _make_inputs(self.task, (self.seed + 7919 * (i + 1)) % 2**31, self.device)
            _scrub(self.device, _sync)
            t0 = _perf()
            out = fn(*xs)
            _sync()
            if i >= warmup:
                times.append((_perf() - t0) * 1e3)
            sketch(_flatten(out)[1], [rng.getrandbits(62) for _ in range(SKETCH_KEYS)])
            del out, xs
        return times


def _stats(times: list) -> dict:
    import statistics
    med = statistics.median(times)
    mean = statistics.fmean(times)
    cv = statistics.pstdev(times) / mean if mean > 0 else 0.0
    return {"median_ms": med, "mean_ms": mean, "cv": cv, "n_iters": len(times), "sum_ms": sum(times)}


BASELINE_ROUNDS = 3  # eager and compiled timed in interleaved rounds; the host keeps each round's median


def _time_baselines(task, model, job: dict) -> dict:
    """{"eager": [round medians], "compile": [round medians] | None, "eager_cv", "compile_error"}.

    Rounds alternate eager and compiled, so a burst of load on the machine inflates one round of each,
    not a whole baseline; the host takes the minimum over rounds (and over re-timings)."""
    import torch
    device, seed = job["device"], job["timing_seed"]
    _set_precision(job["precision"] == "tf32")
    timer = Timer(task, device, seed)
    n = max(5, job["iters"] // BASELINE_ROUNDS)
    res = {"eager": [], "compile": [], "eager_cv": 0.0, "compile_error": None}
    compiled = None
    with torch.no_grad():
        for r in range(BASELINE_ROUNDS):
            st = _stats(timer.run(model, job["warmup"] if r == 0 else 1, n))
            res["eager"].append(st["median_ms"])
            res["eager_cv"] = max(res["eager_cv"], st["cv"])
            if res["compile_error"]:
                continue
            try:
                t_c = _perf()
                compiled = torch.compile(model) if compiled is None else compiled
                res["compile"].append(_stats(timer.run(compiled, max(job["warmup"], 3) if r == 0 else 1, n))
                                      ["median_ms"])
                res.setdefault("compile_round_s", []).append(round(_perf() - t_c, 3))  # round 0: the compile
            except BaseException as e:  # noqa: BLE001 - e.g. no C compiler for inductor
                res["compile"], res["compile_error"] = None, _one_line(e)
    return res


# ----------------------------------------------------------------------------- job kinds
def run_reference(job: dict, ch: Channel):
    """Full outputs for the trial seeds, sketches for the timing seeds (strict fp32), the state_dict, and
    optionally the baselines."""
    import torch
    device, t0 = job["device"], _perf()
    phase_s = {}  # seconds of each phase, from the job's start (torch import and CUDA init come before it)
    try:
        task = _load_task(job["task_path"])
        torch.manual_seed(job["init_seed"])
        init = task.get_init_inputs()
        model = task.Model(*init).to(device)
        phase_s["model"] = _perf() - t0
        if job.get("warm"):
            return ch.send(_warm_compile(task, model, job))
        sketches, kind = {}, None
        _set_precision(False)
        for seed in job["seeds"]:  # one message per seed: this process holds one output on the host at a time
            with torch.no_grad():
                kind, ys = _flatten(model(*_make_inputs(task, seed, device)))
            ch.send({"type": "ref_out", "seed": seed, "outs": ys})
            del ys
        phase_s["outputs"] = _perf() - t0
        for seed, keys in job.get("sketch_seeds", {}).items():
            with torch.no_grad():
                kind, ys = _flatten(model(*_make_inputs(task, int(seed), device)))
            sketches[int(seed)] = sketch(ys, keys)
        phase_s["sketches"] = _perf() - t0
    except (ValueError, TypeError) as e:
        return ch.send({"type": "result", "task_error": str(e)[:400]})
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "task_error": f"reference forward failed: {_one_line(e)}"})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    res = {"type": "result", "sketches": sketches, "out_kind": kind, "state_dict": sd,
           "device_name": name}
    if job.get("baselines"):
        res["baselines"] = _time_baselines(task, model, job)
        phase_s["baselines"] = _perf() - t0
    res["phase_s"] = {k: round(v, 3) for k, v in phase_s.items()}
    ch.send(res)


def _warm_compile(task, model, job: dict) -> dict:
    """Prewarm (sandbox.prewarm): one eager and one compiled forward under the baseline's precision and grad
    mode, so inductor's on-disk caches hold this graph when the baselines are timed. Nothing is timed."""
    import torch
    _set_precision(job["precision"] == "tf32")
    xs = _make_inputs(task, job["timing_seed"], job["device"])
    res = {"type": "result", "warmed": True, "compile_error": None}
    with torch.no_grad():
        model(*xs)
        try:
            torch.compile(model)(*xs)
        except BaseException as e:  # noqa: BLE001 - the timed run records the same error
            res["compile_error"] = _one_line(e)
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
            mod = _import_file(job["cand_path"], "model_new")
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


def _scrub(device: str, sync):
    """Before every candidate forward: freed CUDA memory is NaN, not a reference output or a previous result
    (Sakana), the L2 holds none of the inputs, and the harness's own queued work has ended, so a candidate
    on its own stream does not race it."""
    if device == "cuda":
        import torch
        torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(float("nan"))  # freed at once
    sync()


def _forward(model, xs, guard_cls, device, clocks, timed: bool):
    """One guarded forward: (output, ms or None, violation or None). Raises on candidate exceptions."""
    import torch
    perf, sync = clocks
    _scrub(device, sync)
    py_before = set(threading.enumerate())
    guard, ms = guard_cls(), None
    try:
        with torch.no_grad(), guard:
            t0 = perf()
            out = model(*xs)
            sync()
            ms = (perf() - t0) * 1e3 if timed else None
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
    _set_precision(job["precision"] == "tf32")
    task = _load_task(job["task_path"])
    torch.randn(1 << 20).mul_(2).sum()  # start torch's own intra-op thread pool before the thread checks
    guard_cls = _guard_cls()
    snapshot = _snapshot()
    ch.send({"type": "stage", "stage": "load"})  # torch imported, CUDA up (timestamped by the host)
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
        res["error"] = f"loading the candidate failed: {_one_line(e)}"
        return ch.send(res)
    _restore(snapshot)  # undo monkeypatches of this module made by the candidate's import
    res["violation"] = _inherits_reference(type(model), task)
    if res["violation"]:
        return ch.send(res)
    res["stage"] = "verify"
    ch.send({"type": "stage", "stage": "verify"})  # the host answers with the first request
    res.update(_serve(model, task, guard_cls, job, ch, clocks, snapshot))
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
        xs = _make_inputs(task, int(req["seed"]), device) if req["op"] in ("trial", "time") else last_xs
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
                return {"error": f"forward raised under the profiler: {_one_line(e)}"}
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
            return {"error": f"forward raised on a {'timed call' if req['op'] == 'time' else 'trial'}: {_one_line(e)}"}
        if viol:
            return {"violation": viol}
        try:
            kind, ys = _flatten(out)
        except TypeError as e:
            return {"error": str(e)}
        if threads0 is None:  # the first call: the output must not change after forward returned
            snap = [y.clone() for y in ys]
            _sleep(0.05)
            clocks[1]()
            if not all(_nan_equal(a, b) for a, b in zip(snap, ys)):
                return {"violation": "the output changed after forward returned (background writer)"}
            threads0 = _native_threads()
        if copies is not None:
            if not all(_nan_equal(x, c) for x, c in zip(xs, copies)):
                return {"violation": "forward modified its inputs"}
            ch.send({"type": "trial", "kind": kind, "outs": ys, "devices": [y.device.type for y in ys]},
                    slot=trials % 2)  # the host compares this half while the next trial fills the other
            trials += 1
            last_xs = xs
        else:
            ch.send({"type": "iter", "ms": ms, "kind": kind, "span_ms": (clocks[0]() - t_req) * 1e3})
            reply = ch.recv_control(spin_s=0.01)  # keys drawn by the host after the call, and the next request
            ch.send({"type": "sketch", "sketch": sketch(ys, reply["keys"])})
        del out, ys
        _restore(snapshot)  # ... and patches made by its forward
        req = reply["next"] if req["op"] == "time" else ch.recv_control()
    grown = _new_threads(threads0) if threads0 is not None else set()
    if grown:
        return {"violation": f"forward left {len(grown)} new native thread(s) running"}
    return {"stage": "done"}


def _nan_equal(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def run_build(job: dict, ch: Channel):
    """Import the solution and construct ModelNew once, so that load_inline builds into the shared build dir.
    No input, seed or reference exists in this process; errors are left to the candidate run to report."""
    import torch
    sandbox_inline.install(job["ext_dir"])
    try:
        task = _load_task(job["task_path"])
        sys.path.insert(0, job["cand_dir"])
        os.chdir(job["cand_dir"])
        mod = _import_file(job["cand_path"], "model_new")
        torch.manual_seed(job["init_seed"])
        mod.ModelNew(*task.get_init_inputs())
    except BaseException as e:  # noqa: BLE001 - SystemExit from candidate code included
        err = str(e) if "Error building extension" in str(e) else _one_line(e)
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
        return ch.send({"type": "result", "error": f"{job['fn']} raised {_one_line(e)}",
                        "traceback": traceback.format_exc()[-2000:]})
    ch.send({"type": "result", "value": result})


def _warm_up(device: str, warm_for: str = "candidate"):
    """A warm child's start-up, before its job exists: torch and CUDA up, and each of the harness's own checks
    (dispatch guard, profiler, sketch) run once on a throwaway tensor, so the first candidate call pays none
    of their one-time costs. A reference spare also imports torch.compile's machinery (dynamo, inductor)."""
    import torch
    if warm_for == "reference":
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    x = torch.ones(1 << 10, device=device)
    with torch.no_grad(), _guard_cls()():
        torch.empty_like(x)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.relu(x)
    sketch([x], [1] * SKETCH_KEYS)
    torch.randn(1 << 20).mul_(2).sum()  # torch's intra-op thread pool, started before any thread check
    _sync()


def main(jobfile: str) -> int:
    sys.modules.setdefault("sandbox_worker", sys.modules[__name__])  # model_new imports the helpers
    with open(jobfile) as f:
        job = json.load(f)
    ch = Channel(job["result_fd"], b"", job.get("control_fd"))
    ch.nonce = bytes.fromhex(ch.recv_control()["nonce"])  # first control line; never in a file
    ch.send({"type": "stage", "stage": "started"})  # before any task or candidate code: the host can tell a
    # child that never started (its own failure) from a candidate that crashed (a verdict)
    global _sync
    if job.get("device") == "cuda":
        import torch
        _sync = torch.cuda.synchronize  # bound before any candidate code runs (patched timers)
    if job["kind"] in ("reference", "candidate", "warm"):
        _bind_torch()
    if job["kind"] == "warm":  # a spare: everything that needs no job, then wait for the one job it serves
        _warm_up(job["device"], job.get("for", "candidate"))
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
