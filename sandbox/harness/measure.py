"""What sandbox children share: the task's module and its seeded inputs, output flattening, the precision
flags, and the statistic of timed calls (round medians). Runs INSIDE a child (bound beside
sandbox_worker.py); imports nothing of the project.
"""
from __future__ import annotations

import importlib.util
import sys

_sync = lambda: None  # noqa: E731 - torch.cuda.synchronize on a GPU, bound by bind_torch()


def bind_torch(device: str):
    """Bind the device-wide sync before any candidate code can rebind it; returns it."""
    global _sync
    import torch
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


def nan_equal(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


# ----------------------------------------------------------------------------- statistics of timed calls
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
