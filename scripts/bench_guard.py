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

`--interleaved` instead runs every variant once per round, in rotating order, under a check's conditions
(fresh inputs, scrub, guard, sketch, and with `--round-trip` a pipe round trip to another process between
calls, as a check's control channel does), and splits each call's host time at stamps taken inside
`forward`: eager and candidate then see the same machine state, call by call.
"""
import argparse
import contextlib
import ctypes
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import sandbox.harness.measure as m  # noqa: E402
from sandbox.harness import sandbox_worker as w  # noqa: E402
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


NOOP_C = 'extern "C" void relu_forward(const float* x, float* y, long n, void* s) {}\n'


class Stamped(torch.nn.Module):
    """The candidate's forward with host timestamps between its steps (empty_like, arguments, launch)."""

    def __init__(self, fn, stamps: list, helpers=(w.ptr, w.stream)):
        super().__init__()
        self.fn, self.stamps, self.helpers = fn, stamps, helpers

    def forward(self, x):
        s, perf, (ptr, stream) = self.stamps, time.perf_counter, self.helpers
        s.append(perf())
        y = torch.empty_like(x)
        s.append(perf())
        args = (ptr(x), ptr(y), x.numel(), stream())
        s.append(perf())
        self.fn(*args)
        s.append(perf())
        return y


def slow_ptr(t):  # the helpers as they were before (an import and a tuple per call; four calls for a stream)
    import torch
    assert type(t) in (torch.Tensor, torch.nn.Parameter)
    return ctypes.c_void_p(t.data_ptr())


def slow_stream():
    import torch
    if torch.cuda.is_initialized():
        return ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()))
    return None


class StampedEager(torch.nn.Module):
    def __init__(self, stamps: list):
        super().__init__()
        self.stamps = stamps

    def forward(self, x):
        self.stamps.append(time.perf_counter())
        y = torch.relu(x)
        self.stamps.append(time.perf_counter())
        return y


def interleaved(a, guard_cls, clocks, task):
    """Each round runs every variant once (rotating order) under a check's conditions; medians per variant."""
    def lib_of(cu=VEC_CU, **kw):
        lib = build(a.device, cu, **kw)
        return lib.relu_forward
    noop = ctypes.CDLL(_build_host(NOOP_C)).relu_forward
    noop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    stamps = {}

    def stamped(name, fn=None, **kw):
        stamps[name] = []
        return (name, StampedEager(stamps[name]) if fn is None else Stamped(fn, stamps[name], **kw))
    vec4 = lib_of()
    variants = [("eager nn.ReLU", torch.nn.ReLU()), stamped("eager, Python forward"),
                stamped("float4 (ctypes, static cudart)", vec4),
                stamped("float4, without the guard", vec4),
                stamped("float4, the earlier ptr()/stream()", vec4, helpers=(slow_ptr, slow_stream)),
                stamped("float4 (ctypes, shared cudart)", lib_of(flags=("-cudart", "shared"))),
                stamped("no-op C function (ctypes, no launch)", noop)]
    echo = subprocess.Popen([sys.executable, "-u", "-c",
                             "import os\nwhile True:\n    b = os.read(0, 1)\n    if not b: break\n    os.write(1, b)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0) if a.round_trip else None
    warm_mod, warm_x = torch.nn.Identity(), torch.empty(16, device=a.device)
    total = {n: [] for n, _ in variants}
    split = {n: [] for n, _ in variants}  # [until forward returns, sync after]
    inside = {n: [] for n in stamps}
    for r in range(a.iters + 5):
        k = r % len(variants)
        for name, fn in variants[k:] + variants[:k]:
            xs = m.make_inputs(task, r, a.device)
            m.scrub(a.device, clocks[1])
            if a.host_warm:  # the same harness-side warm-up before every variant's call (no candidate code)
                warm_mod(warm_x)
                torch.empty_like(warm_x)
            if name in stamps:
                stamps[name].clear()
            unguarded = name.startswith("eager") or "without the guard" in name  # baselines: unguarded
            g = contextlib.nullcontext() if unguarded else guard_cls()
            with torch.no_grad(), g:
                t0 = time.perf_counter()
                out = fn(*xs)
                t1 = time.perf_counter()
                clocks[1]()
                t2 = time.perf_counter()
            assert not getattr(g, "bad", None), g.bad
            if r >= 5:
                total[name].append((t2 - t0) * 1e3)
                split[name].append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
                if name in stamps:  # this call's stamps, in us from t0
                    inside[name].append([(t - t0) * 1e6 for t in stamps[name]])
            m.sketch([out], [r, r + 1, r + 2])
            if echo is not None:  # the control channel's round trip: write, then poll the answer awake
                echo.stdin.write(b"x")
                while not select.select([echo.stdout], [], [], 0)[0]:
                    pass
                echo.stdout.read(1)
    if echo is not None:
        echo.stdin.close()
        echo.wait()
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"\n| variant ({dev}, {a.numel} floats, {a.iters} rounds, round trip {a.round_trip}, "
          f"host warm-up {a.host_warm}) | ms per call "
          f"| until forward returns | sync | stamps in forward (us from t0, medians) |\n|---|---|---|---|---|")
    base = statistics.median(total["eager nn.ReLU"])
    for name, _ in variants:
        calls = inside.get(name, [])
        med = [statistics.median(c[i] for c in calls) for i in range(len(calls[0]))] if calls else []
        tm = statistics.median(total[name])
        print(f"| {name} | {tm:.4f} ({tm / base:.2f}x) | {statistics.median(s[0] for s in split[name]):.4f} "
              f"| {statistics.median(s[1] for s in split[name]):.4f} | {' / '.join(f'{m:.1f}' for m in med)} |")


def _build_host(src: str) -> str:
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "k.c"), "w") as f:
        f.write(src.replace('extern "C" ', ""))
    so = os.path.join(d, "k.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", so, os.path.join(d, "k.c")], check=True)
    return so


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--numel", type=int, default=4096 * 4096)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--interleaved", action="store_true", help="the rotating per-round comparison (see above)")
    p.add_argument("--round-trip", action="store_true", help="with --interleaved: a pipe round trip between calls")
    p.add_argument("--host-warm", action="store_true",
                   help="with --interleaved: a module call and an allocation on the host just before each call")
    a = p.parse_args()
    w._bind_torch(a.device)
    os.environ["CUDA_AGENT_GUARD"] = guard_library(SandboxConfig(device=a.device))  # as a sandbox child loads it
    model, guard_cls, clocks = Relu(build(a.device)), w._guard_cls(), (w._perf, w._sync)
    x = torch.randn(a.numel, device=a.device)
    task = type("T", (), {"get_inputs": staticmethod(lambda: [torch.randn(a.numel)])})
    if a.interleaved:
        return interleaved(a, guard_cls, clocks, task)

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
                xs = m.make_inputs(task, i, a.device)
            elif fresh == "copy":
                xs = [buf.copy_(m.make_inputs(task, i, a.device)[0])]
            else:
                xs = [x.mul_(1.0)]
            if scrub:
                m.scrub(a.device, clocks[1])
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
                m.sketch([out], [1, 2, 3])
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
    timer = m.Timer(task, a.device, 0)
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
    for tag, k in kernels:
        variant(f"plain{tag}", k, "", False, False, False)
        variant(f"+ scrub{tag}", k, "", True, False, False)
        variant(f"+ guard{tag}", k, "", True, True, False)
        variant(f"fresh + scrub + guard{tag}", k, "alloc", True, True, False)
        variant(f"checked{tag}", k, "alloc", True, True, True)
        variant(f"checked without guard{tag}", k, "alloc", True, False, True)
        variant(f"checked, in place{tag}", k, "copy", True, True, True)
        variant(f"checked, 3 ms gaps{tag}", k, "alloc", True, True, True, 0.003)
        variant(f"checked, 3 ms gaps spinning{tag}", k, "alloc", True, True, True, 0.003, spin=True)
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
