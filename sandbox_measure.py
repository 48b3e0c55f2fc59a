"""What a sandbox child measures with, the same code in reference and candidate children: the task's module and
its seeded inputs, the scrub before every call, output sketches (a timed call's check) and the baseline timer.
Runs INSIDE a child (bound beside sandbox_worker.py); imports nothing of the project.
"""
from __future__ import annotations

import importlib.util
import sys
import time

# Bound at import, before any candidate code exists in the process: a candidate that monkeypatches
# time.perf_counter or torch.cuda.synchronize afterwards does not change what the harness measures with.
_perf = time.perf_counter
_sync = lambda: None  # noqa: E731 - torch.cuda.synchronize on a GPU, bound by bind_torch()
_T: dict = {}  # torch functions the harness's own checks use, bound by bind_torch() before candidate import


def bind_torch(device: str):
    """Bind the torch functions `sketch` uses (and, on a GPU, the device-wide sync) before any candidate code
    can rebind them; returns the sync."""
    global _sync
    import torch
    _T.update(reshape=torch.reshape, Generator=torch.Generator, to=torch.Tensor.to, isfinite=torch.isfinite,
              sum=torch.sum, where=torch.where, zeros_like=torch.zeros_like, dot=torch.dot, randn=torch.randn,
              zeros=torch.zeros)
    if device == "cuda":
        _sync = torch.cuda.synchronize
    return _sync


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


# ----------------------------------------------------------------------------- the task and its inputs
def import_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_task(path: str):
    """Import the task and check its three names; raises ValueError('one line') on a malformed task."""
    try:
        mod = import_file(path, "cuda_agent_task")
    except BaseException as e:  # noqa: BLE001 - any import failure is a task error
        raise ValueError(f"task import failed: {one_line(e)}") from None
    missing = [n for n in ("Model", "get_inputs", "get_init_inputs") if not hasattr(mod, n)]
    if missing:
        raise ValueError(f"task is missing {', '.join(missing)}")
    return mod


def make_inputs(task, seed: int, device: str) -> list:
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


def flatten(out):
    """(kind, [tensors]) for a Tensor or a tuple/list of plain Tensors; raises TypeError otherwise."""
    import torch
    if type(out) is torch.Tensor:
        return "tensor", [out]
    if type(out) in (tuple, list) and out and all(type(x) is torch.Tensor for x in out):
        return type(out).__name__, list(out)
    inner = ", ".join(type(x).__name__ for x in out) if isinstance(out, (tuple, list)) else ""
    raise TypeError(f"output must be exactly torch.Tensor (or a tuple/list of them), got "
                    f"{type(out).__name__}{'(' + inner + ')' if inner else ''}")


def set_precision(tf32: bool):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


def scrub(device: str, sync):
    """Before every candidate forward: freed CUDA memory is NaN, not a reference output or a previous result
    (Sakana), the L2 holds none of the inputs, and the harness's own queued work has ended, so a candidate
    on its own stream does not race it."""
    if device == "cuda":
        import torch
        torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(float("nan"))  # freed at once
    sync()


def nan_equal(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


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


# ----------------------------------------------------------------------------- baselines (trusted code)
class Timer:
    """Times forward calls of the trusted reference (eager and `torch.compile` baselines) exactly the way a
    candidate's timed calls are timed (`sandbox_worker._serve`): fresh inputs for every call, the NaN scrub, then
    forward + device-wide synchronize in the timed region, then a sketch of the output (untimed). A speedup
    then compares like with like: on an H200 the fresh inputs and the sketch between calls add ~15-25 us to
    a 50 us launch-bound call, to the baseline's and the candidate's alike (docs/RESULTS.md)."""

    def __init__(self, task, device: str, seed: int):
        self.task, self.device, self.seed = task, device, seed
        self.launch: list = []  # per timed call of the last run, ms until fn returned (the rest: the device)

    def run(self, fn, warmup: int, iters: int) -> list:
        import random
        times, rng, self.launch = [], random.Random(self.seed), []
        for i in range(warmup + iters):
            xs = make_inputs(self.task, (self.seed + 7919 * (i + 1)) % 2**31, self.device)
            scrub(self.device, _sync)
            t0 = _perf()
            out = fn(*xs)
            t1 = _perf()
            _sync()
            if i >= warmup:
                times.append((_perf() - t0) * 1e3)
                self.launch.append((t1 - t0) * 1e3)
            sketch(flatten(out)[1], [rng.getrandbits(62) for _ in range(SKETCH_KEYS)])
            del out, xs
        return times


def stats(times: list) -> dict:
    import statistics
    med = statistics.median(times)
    mean = statistics.fmean(times)
    cv = statistics.pstdev(times) / mean if mean > 0 else 0.0
    return {"median_ms": med, "mean_ms": mean, "cv": cv, "n_iters": len(times), "sum_ms": sum(times)}


BASELINE_ROUNDS = 3  # eager and compiled timed in interleaved rounds; the host keeps each round's median


def round_medians(times: list, rounds: int = BASELINE_ROUNDS) -> list:
    """Medians of `rounds` consecutive, equal slices of `times` (the last takes the remainder). A candidate's timed
    calls go through this so that its time is the baselines' statistic: the minimum of round medians."""
    import statistics
    n = max(1, len(times) // rounds)
    return [statistics.median(times[i * n:(i + 1) * n if i < rounds - 1 else len(times)])
            for i in range(min(rounds, len(times)))]


def time_baselines(task, model, job: dict, with_compile: bool = True) -> dict:
    """{"eager": [round medians], "compile": [round medians] | None, "eager_cv", "compile_error"}.

    Rounds alternate eager and compiled, so a burst of load on the machine inflates one round of each,
    not a whole baseline; the host takes the minimum over rounds (and over re-timings). with_compile=False times
    eager alone (a candidate child's own eager rounds, sandbox_worker._time_eager)."""
    import statistics

    import torch
    device, seed = job["device"], job["timing_seed"]
    set_precision(job["precision"] == "tf32")
    timer = Timer(task, device, seed)
    n = max(5, job["iters"] // BASELINE_ROUNDS)
    res = {"eager": [], "compile": [], "eager_cv": 0.0, "compile_error": None}
    compiled = None
    with torch.no_grad():
        for r in range(BASELINE_ROUNDS):
            st = stats(timer.run(model, job["warmup"] if r == 0 else 1, n))
            res["eager"].append(st["median_ms"])
            res.setdefault("eager_launch", []).append(statistics.median(timer.launch))
            res["eager_cv"] = max(res["eager_cv"], st["cv"])
            if not with_compile or res["compile_error"]:
                continue
            try:
                t_c = _perf()
                compiled = torch.compile(model) if compiled is None else compiled
                res["compile"].append(stats(timer.run(compiled, max(job["warmup"], 3) if r == 0 else 1, n))
                                      ["median_ms"])
                res.setdefault("compile_round_s", []).append(round(_perf() - t_c, 3))  # round 0: the compile
            except BaseException as e:  # noqa: BLE001 - e.g. no C compiler for inductor
                res["compile"], res["compile_error"] = None, one_line(e)
    if not with_compile:
        res["compile"] = None
    return res
