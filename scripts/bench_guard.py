"""What a checked timed call costs an honest kernel: one ReLU launch timed the way the sandbox times it.

Variants, each the median of --iters calls of the same compiled kernel in this process:
  plain     inputs refilled in place, no guard (how baselines are timed);
  guard     the same, under the dispatch guard;
  fresh     fresh inputs every call (the sandbox's timed calls), no guard;
  fresh + sketch  and the output's sketch after each call;
  checked   what the sandbox does: fresh inputs, scrub, guard, then a sketch of the output.

GPU: python scripts/bench_guard.py --device cuda
CPU: python scripts/bench_guard.py --device cpu --numel 1048576
"""
import argparse
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
from bench_sandbox import CPP, CU  # noqa: E402  (the same ReLU kernel)

class Relu(torch.nn.Module):
    def __init__(self, lib):
        super().__init__()
        self.lib = lib

    def forward(self, x):
        y = torch.empty_like(x)
        self.lib.relu_forward(w.ptr(x), w.ptr(y), x.numel(), w.stream())
        return y


def build(device: str) -> ctypes.CDLL:
    d = tempfile.mkdtemp()
    src, so = os.path.join(d, "k.cu" if device == "cuda" else "k.cpp"), os.path.join(d, "k.so")
    with open(src, "w") as f:
        f.write(CU if device == "cuda" else CPP)
    cmd = ["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90", "-o", so, src] if device == "cuda" else \
        ["g++", "-O3", "-shared", "-fPIC", "-fopenmp", "-o", so, src]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(so)
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
    model, guard_cls, clocks = Relu(build(a.device)), w._guard_cls(), (w._perf, w._sync)
    x = torch.randn(a.numel, device=a.device)
    task = type("T", (), {"get_inputs": staticmethod(lambda: [torch.randn(a.numel)])})

    def run(fresh: bool, guarded: bool, sketched: bool) -> float:
        times = []
        for i in range(a.iters + 10):
            xs = w._make_inputs(task, i, a.device) if fresh else [x.mul_(1.0)]
            if guarded:
                out, ms, viol = w._forward(model, xs, guard_cls, a.device, clocks, timed=True)
                assert viol is None, viol
            else:
                w._scrub(a.device, clocks[1])
                t0 = time.perf_counter()
                out = model(*xs)
                clocks[1]()
                ms = (time.perf_counter() - t0) * 1e3
            if sketched:
                w.sketch([out], [1, 2, 3])
            times.append(ms)
        return statistics.median(times[10:])
    rows = [("plain", False, False, False), ("guard", False, True, False), ("fresh", True, False, False),
            ("fresh + sketch", True, False, True), ("checked", True, True, True)]
    res = {name: run(f, g, s) for name, f, g, s in rows}
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"\n| variant ({dev}, {a.numel} floats, median of {a.iters}) | ms per call |\n|---|---|")
    for name, ms in res.items():
        print(f"| {name} | {ms:.4f} |")


if __name__ == "__main__":
    main()
