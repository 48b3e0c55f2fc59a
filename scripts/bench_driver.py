"""Where a check's time goes under the trusted driver (sandbox/harness/driver.py): the driver's primitives alone (the L2
reset, a device sync, stopping a CUDA process's tree), then honest checks of the ReLU workspace with the
driver's per-call breakdown from the verdict (host wall time of a call, its enqueue, the child's reply, the
stop, the comparison) and the time the driver's clock gives a small kernel and eager.

GPU: python3 scripts/bench_driver.py --device cuda --checks 2
CPU: python scripts/bench_driver.py --device cpu --checks 2
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import sandbox  # noqa: E402
from sandbox.harness.share import Freezer, GpuOps  # noqa: E402

KEYS = ("correct", "error", "violation", "candidate_ms", "eager_ms", "compile_ms")


def primitives(device: str) -> dict:
    import torch
    out = {}
    if device == "cuda":
        ops = GpuOps()
        for name, fn in (("reset_l2_ms", ops.reset_l2), ("sync_ms", torch.cuda.synchronize)):
            fn()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            out[name] = (time.perf_counter() - t) / 20 * 1e3
    up = f"import torch, time; torch.zeros(1, device='{device}'); print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", up], stdout=subprocess.PIPE, start_new_session=True)
    p.stdout.readline()
    f, ts = Freezer(p.pid), []
    for _ in range(20):
        t = time.perf_counter()
        assert f.stop()
        ts.append((time.perf_counter() - t) * 1e3)
        f.cont()
    out.update(freezer_stop_ms_median=sorted(ts)[len(ts) // 2], threads=len(os.listdir(f"/proc/{p.pid}/task")))
    p.kill()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--checks", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    print(json.dumps(primitives(args.device)), flush=True)
    import test_sandbox_gpu as tg  # the ReLU workspace of the GPU tests (a .cu kernel through ctypes)
    root = tempfile.mkdtemp()
    cfg = sandbox.SandboxConfig(device=args.device, cache_dir=os.path.join(root, "cache"), warmup=2,
                                iters=args.iters, n_trials=3, warm_spares=0)
    sol = tg.ws(pathlib.Path(root)) if args.device == "cuda" else pathlib.Path(tg.FIX, "relu_ws")
    for i in range(args.checks):
        t = time.perf_counter()
        v = sandbox.check(tg.RELU_TASK, sol, cfg)
        d = v.to_dict()
        print(f"check {i}: wall {time.perf_counter() - t:.1f} s", {k: d[k] for k in KEYS}, flush=True)
        print(json.dumps({k: x for k, x in v.timings.items() if k != "log"}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
