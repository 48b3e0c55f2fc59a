"""What a checked timed call costs an honest kernel: one ReLU launch timed the way the sandbox times it.

Variants, each the median of --iters calls in this process (the same compiled kernel, or eager torch.relu):
  eager (Timer)        torch.relu timed as the baselines are (inputs refilled in place, L2 flushed);
  eager (checked)      torch.relu under the candidate's conditions (fresh inputs, scrub, sketch after);
  plain                the kernel, inputs refilled in place, no scrub, no guard;
  + scrub              and the NaN scrub before each call;
  + guard              and the dispatch guard around the call;
  fresh + scrub + guard        fresh inputs every call;
  checked              what the sandbox does: fresh inputs, scrub, guard, then a sketch of the output;
  checked, in place    the same with fresh values copied into one input buffer;
  checked, 3 ms gaps   `checked` with the GPU idle 3 ms between calls (a check's pipe round trips leave gaps),
                       the process asleep or spinning;
  ..., float4 kernel   the same kernel with 16-byte loads (bench_sandbox --kernel relu_vec);
  ..., shared cudart   built with `nvcc -cudart shared` (the runtime torch has loaded, not a static copy).

GPU: python scripts/bench_guard.py --device cuda
CPU: python scripts/bench_guard.py --device cpu --numel 1048576
"""
import argparse
import contextlib
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import sandbox_worker as w  # noqa: E402
from sandbox import SandboxConfig, guard_library  # noqa: E402
from bench_sandbox import CPP, CU, VEC_CU  # noqa: E402  (the same ReLU kernels)

class Relu(torch.nn.Module):
    def __init__(self, lib):
        super().__init__()
        self.lib = lib

    def forward(self, x):
        y = torch.empty_like(x)
        self.lib.relu_forward(w.ptr(x), w.ptr(y), x.numel(), w.stream())
        return y


def build(device: str, cu: str = CU, loader=ctypes.CDLL, flags: tuple = ()) -> ctypes.CDLL:
    d = tempfile.mkdtemp()
    src, so = os.path.join(d, "k.cu" if device == "cuda" else "k.cpp"), os.path.join(d, "k.so")
    with open(src, "w") as f:
        f.write(cu if device == "cuda" else CPP)
    cmd = ["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90", *flags, "-o", so, src] if device == "cuda" else \
        ["g++", "-O3", "-shared", "-fPIC", "-fopenmp", "-o", so, src]
    subprocess.run(cmd, check=True)
    lib = loader(so)
    lib.relu_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    return lib


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--numel", type=int, default=4096 * 4096)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args()
    if a.device == "cuda":
        w._sync = torch.cuda.synchronize
    w._bind_torch()
    os.environ["CUDA_AGENT_GUARD"] = guard_library(SandboxConfig(device=a.device))  # as a sandbox child loads it
    model, guard_cls, clocks = Relu(build(a.device)), w._guard_cls(), (w._perf, w._sync)
    x = torch.randn(a.numel, device=a.device)
    task = type("T", (), {"get_inputs": staticmethod(lambda: [torch.randn(a.numel)])})

    buf = torch.empty(a.numel, device=a.device)
    eager = torch.nn.ReLU()

    def run(fn, fresh: str, scrub: bool, guarded: bool, sketched: bool, gap_s: float = 0.0, spin: bool = False,
            split: dict | None = None) -> float:
        """Median host ms of the timed span (forward + device-wide sync), as the sandbox measures it. `split`
        also gets the medians of the span's two parts (until forward returns: the host's launch path; then
        the sync) and of the GPU's own time between CUDA events around the forward."""
        times, launch, gpu = [], [], []
        for i in range(a.iters + 10):
            if fresh == "alloc":
                xs = w._make_inputs(task, i, a.device)
            elif fresh == "copy":
                xs = [buf.copy_(w._make_inputs(task, i, a.device)[0])]
            else:
                xs = [x.mul_(1.0)]
            if scrub:
                w._scrub(a.device, clocks[1])
            else:
                clocks[1]()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if a.device == "cuda" else None
            guard = guard_cls() if guarded else contextlib.nullcontext()
            with torch.no_grad(), guard:
                if ev:
                    ev[0].record()
                t0 = time.perf_counter()
                out = fn(*xs)
                t1 = time.perf_counter()
                if ev:
                    ev[1].record()
                clocks[1]()
                ms = (time.perf_counter() - t0) * 1e3
            if guarded:
                assert not guard.bad, guard.bad
            if sketched:
                w.sketch([out], [1, 2, 3])
            if gap_s:
                clocks[1]()
                if spin:
                    t_end = time.perf_counter() + gap_s
                    while time.perf_counter() < t_end:
                        pass
                else:
                    time.sleep(gap_s)
            times.append(ms)
            launch.append((t1 - t0) * 1e3)
            if ev:
                gpu.append(ev[0].elapsed_time(ev[1]))
        if split is not None:
            split["launch"] = statistics.median(launch[10:])
            split["gpu"] = statistics.median(gpu[10:]) if gpu else float("nan")
        return statistics.median(times[10:])
    timer = w.Timer(task, a.device, 0)
    res, splits = {"eager (Timer)": statistics.median(timer.run(eager, 10, a.iters))}, {}

    def variant(name, *args, **kw):
        splits[name] = {}
        res[name] = run(*args, split=splits[name], **kw)
    variant("eager (checked)", eager, "alloc", True, False, True)
    variant("eager (checked), 3 ms gaps", eager, "alloc", True, False, True, 0.003)
    kernels = [("", model)]
    if a.device == "cuda":
        vec = Relu(build(a.device, VEC_CU))
        kernels.append((", float4 kernel", vec))
    for tag, m in kernels:
        variant(f"plain{tag}", m, "", False, False, False)
        variant(f"+ scrub{tag}", m, "", True, False, False)
        variant(f"+ guard{tag}", m, "", True, True, False)
        variant(f"fresh + scrub + guard{tag}", m, "alloc", True, True, False)
        variant(f"checked{tag}", m, "alloc", True, True, True)
        variant(f"checked without guard{tag}", m, "alloc", True, False, True)
        variant(f"checked, in place{tag}", m, "copy", True, True, True)
        variant(f"checked, 3 ms gaps{tag}", m, "alloc", True, True, True, 0.003)
        variant(f"checked, 3 ms gaps spinning{tag}", m, "alloc", True, True, True, 0.003, spin=True)
    if a.device == "cuda":  # the same call with the GIL held (ctypes.PyDLL): no release/re-acquire around it
        held = Relu(build(a.device, VEC_CU, loader=ctypes.PyDLL))
        variant("checked, float4 kernel, GIL held", held, "alloc", True, True, True)
        # nvcc links its runtime statically by default: the kernel's launches then go through a second CUDA
        # runtime beside torch's; with -cudart shared they use the one torch has loaded
        shared = Relu(build(a.device, VEC_CU, flags=("-cudart", "shared")))
        variant("checked, float4 kernel, shared cudart", shared, "alloc", True, True, True)
        variant("checked, float4 kernel, static cudart (again)", vec, "alloc", True, True, True)
    if a.device == "cuda":  # the kernels' own GPU time (events on the stream), without any host overhead
        for name, fn in (("kernel alone (events)", lambda: model.lib.relu_forward(w.ptr(x), w.ptr(y), x.numel(),
                                                                                  w.stream())),
                         ("float4 kernel alone (events)", lambda: vec.lib.relu_forward(w.ptr(x), w.ptr(y), x.numel(),
                                                                                        w.stream())),
                         ("eager relu alone (events)", lambda: torch.clamp_min(x, 0.0, out=y))):
            y, ev = torch.empty_like(x), []
            for _ in range(a.iters):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                ev.append((e0, e1))
            torch.cuda.synchronize()
            res[name] = statistics.median(e0.elapsed_time(e1) for e0, e1 in ev)
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"\n| variant ({dev}, {a.numel} floats, median of {a.iters}) | ms per call | until forward returns"
          f" | GPU (events) |\n|---|---|---|---|")
    for name, ms in res.items():
        sp = splits.get(name, {})
        print(f"| {name} | {ms:.4f} | {sp.get('launch', float('nan')):.4f} | {sp.get('gpu', float('nan')):.4f} |")
    print(f"checked / eager (Timer) = {res['checked'] / res['eager (Timer)']:.2f}")


if __name__ == "__main__":
    main()
