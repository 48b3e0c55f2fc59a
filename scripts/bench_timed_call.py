"""One ReLU call of 4096x4096 fp32 timed the way a sandbox child times it (fresh input, NaN scrub, host clock
around forward + device-wide sync), outside any sandbox, to find what a candidate child's setting adds to it.
Eager `torch.relu` against the workspace form's float4 kernel (scripts/bench_sandbox.py) launched through
ctypes, interleaved in blocks, each condition in a fresh process:

  plain     the two as plain functions
  module    as nn.Module forwards under no_grad (as both children call them)
  profiler  module, after one CPU-only torch.profiler run in the process (a candidate child lists its
            aten ops under the profiler before its timed calls; the reference child does not)
  guard     module, the float4 calls inside the dispatch guard (as a candidate's calls are; eager's are not)
  guardlib  module, the guard's library loaded and sealed in the process but never switched on
  guardlib-noseal  the same without its fallthrough registrations
  sketch    module, each call followed by the output sketch (as in both children)
  loaded    module, while N processes start as warm spares do (import torch, CUDA up, a few small kernels)
  setup     module, in a process set up as a candidate child is before its forward runs (allocator memory
            fraction, precision flags, intra-op pool, guard, profiler, gc.freeze) and with the sketch
  bwrap:X   condition X in a process started inside bubblewrap as sandbox children are

GPU: python scripts/bench_timed_call.py --out $OUT/timed_call.json
"""
import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import sandbox  # noqa: E402
import sandbox.child  # noqa: E402
import sandbox.harness.measure  # noqa: E402
from sandbox.harness import sandbox_worker  # noqa: E402
from bench_sandbox import VEC_CU  # noqa: E402

CONDITIONS = ["plain", "module", "profiler", "guard", "sketch", "loaded", "profiler+guard+sketch"]
SPARE_LIKE = ("import torch, time\nx = torch.ones(1 << 10, device='cuda')\n"
              "for _ in range(20):\n    torch.relu(x).sum().item()\n    time.sleep(0.01)\n")


def build(d: str) -> str:
    src, so = os.path.join(d, "relu.cu"), os.path.join(d, "relu.so")
    with open(src, "w") as f:
        f.write(VEC_CU)
    subprocess.run(["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-o", so, src], check=True)
    return so


class Eager(nn.Module):
    def forward(self, x):
        return torch.relu(x)


class Float4(nn.Module):
    def __init__(self, so: str):
        super().__init__()
        self.lib = ctypes.CDLL(so)
        self.lib.relu_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]

    def forward(self, x):
        y = torch.empty_like(x)
        self.lib.relu_forward(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), x.numel(),
                              ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())))
        return y


def timed_calls(fn, n: int, guard=None, sketch: bool = False) -> list[float]:
    """ms per call as the children take them: fresh input, scrub, host clock over forward + sync."""
    sync, out = torch.cuda.synchronize, []
    for i in range(n):
        x = torch.randn(4096, 4096, device="cuda")
        sandbox.harness.measure.scrub("cuda", sync)
        with torch.no_grad():
            if guard is not None:
                guard.__enter__()
            t0 = time.perf_counter()
            y = fn(x)
            sync()
            out.append((time.perf_counter() - t0) * 1e3)
            if guard is not None:
                guard.__exit__(None, None, None)
        if sketch:
            sandbox.harness.measure.sketch([y], [i + 1, i + 2, i + 3])
        del y, x
    return out


def device_ms(fn, n: int, scrubbed: bool) -> float:
    """Median device time of one call (CUDA events around it): `n` back-to-back launches on one input, or, if
    `scrubbed`, each on a fresh input after the scrub as in a timed call (the host clock then not read)."""
    x, times = torch.randn(4096, 4096, device="cuda"), []
    with torch.no_grad():
        for _ in range(n):
            if scrubbed:
                x = torch.randn(4096, 4096, device="cuda")
                sandbox.harness.measure.scrub("cuda", torch.cuda.synchronize)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(x)
            b.record()
            times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def run_condition(cond: str, so: str, calls: int, load: int) -> dict:
    sandbox.harness.measure.bind_torch("cuda")
    mods = {"eager": Eager(), "float4": Float4(so)}
    if cond == "plain":
        mods = {"eager": torch.relu, "float4": mods["float4"].forward}
    guard = None
    if cond == "setup":  # what run_candidate / _serve do before and around a candidate's timed calls
        torch.cuda.set_per_process_memory_fraction(0.9)
        sandbox.harness.measure.set_precision(False)
        torch.randn(1 << 20).mul_(2).sum()
        gc.collect()
        gc.freeze()
        cond = "profiler+guard+sketch"
    if cond == "guardlib-noseal":
        ctypes.CDLL(os.environ["CUDA_AGENT_GUARD"])  # registers the boxed fallback only
    elif "guard" in cond:
        guard = sandbox_worker._guard_cls()()
        guard = None if cond == "guardlib" else guard
    if "profiler" in cond:
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            mods["float4"](torch.randn(4096, 4096, device="cuda"))
            torch.cuda.synchronize()
    guards = {"eager": None, "float4": guard}  # the reference's eager calls run unguarded
    for k, fn in mods.items():
        timed_calls(fn, 20, guards[k], "sketch" in cond)  # warm-up
    res = {"condition": cond}
    res.update({f"{k}_device_ms": device_ms(fn, 200, False) for k, fn in mods.items()})
    res.update({f"{k}_device_scrubbed_ms": device_ms(fn, 100, True) for k, fn in mods.items()})
    times, procs = {k: [] for k in mods}, []
    for block in range(6):
        if cond == "loaded":
            procs += [subprocess.Popen([sys.executable, "-c", SPARE_LIKE]) for _ in range(load // 6)]
        for k, fn in mods.items():
            times[k] += timed_calls(fn, calls // 6, guards[k], "sketch" in cond)
    for q in procs:
        q.wait()
    for k, ts in times.items():
        ts = sorted(ts)
        res[k] = {"median": statistics.median(ts), "p10": ts[len(ts) // 10], "p90": ts[9 * len(ts) // 10]}
    res["ratio"] = res["float4"]["median"] / res["eager"]["median"]
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="timed calls per kernel and condition")
    p.add_argument("--load", type=int, default=12, help="spare-like processes started in the `loaded` condition")
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one condition in this process
    p.add_argument("--so", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "timed_call.json"))
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_condition(args.one, args.so, args.calls, args.load)))
        return
    cfg = sandbox.SandboxConfig(device="cuda")
    env = {**os.environ, "CUDA_AGENT_GUARD": sandbox.guard_library(cfg)}
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory(dir=here) as d:  # not under /tmp: a bubblewrap child has its own /tmp
        so = build(d)
        for cond in args.conditions.split(","):
            cmd = [sys.executable, __file__, "--one", cond.removeprefix("bwrap:"), "--so", so, "--calls",
                   str(args.calls), "--load", str(args.load)]
            if cond.startswith("bwrap:"):
                cmd = sandbox.child.bwrap_argv(cmd, d, "cuda", [], [])
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode:
                print(cond, "failed:", r.stderr[-1500:], file=sys.stderr)
                continue
            rows.append({**json.loads(r.stdout.strip().splitlines()[-1]), "condition": cond})
            x = rows[-1]
            print(f"{cond:22s} eager {x['eager']['median']:.4f} ms  float4 {x['float4']['median']:.4f} ms  "
                  f"ratio {x['ratio']:.3f}  (p10-p90 eager {x['eager']['p10']:.4f}-{x['eager']['p90']:.4f}, "
                  f"float4 {x['float4']['p10']:.4f}-{x['float4']['p90']:.4f}); device ms back-to-back / "
                  f"scrubbed: eager {x['eager_device_ms']:.4f} / {x['eager_device_scrubbed_ms']:.4f}, float4 "
                  f"{x['float4_device_ms']:.4f} / {x['float4_device_scrubbed_ms']:.4f}", flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": args.calls, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
