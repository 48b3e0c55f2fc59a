"""Host time of a launch-bound forward's Python path on each CPU core, one process migrating core to core.

A candidate's `forward` path (allocation, two data pointers, a C call through ctypes) and eager's (one torch op)
are timed pinned to each core in turn (os.sched_setaffinity), in several passes in shuffled core order: a
core slow in every pass is a slow core; every core slow in some passes and fast in others is a host whose
speed changes over time (docs/RESULTS.md §2 saw both).

    python3 scripts/bench_cores.py [--device cuda] [--passes 3] [--iters 2000]
"""
import argparse
import ctypes
import json
import os
import random
import statistics
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_cores.json"))
    a = p.parse_args()
    x = torch.randn(256, 256, device=a.device)
    libc = ctypes.CDLL(None)
    noop = libc.getpid  # a C call with no arguments: ctypes' own cost
    perf = time.perf_counter

    def cand():  # the workspace form's host path: allocate the output, marshal pointers, call C
        y = torch.empty_like(x)
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr())
        noop()
        return y

    def eager():
        return torch.neg(x)

    cores = sorted(os.sched_getaffinity(0))
    res = {c: {"cand": [], "eager": []} for c in cores}
    for _ in range(a.passes):
        for c in random.sample(cores, len(cores)):
            os.sched_setaffinity(0, {c})
            for name, fn in (("cand", cand), ("eager", eager)):
                for _ in range(200):
                    fn()
                ts = []
                for _ in range(a.iters):
                    t0 = perf()
                    fn()
                    ts.append(perf() - t0)
                res[c][name].append(statistics.median(ts) * 1e6)
    os.sched_setaffinity(0, set(cores))
    print("core | forward host us per pass: candidate path | eager")
    for c in cores:
        print(f"{c:4d} | {' '.join(f'{v:6.2f}' for v in res[c]['cand'])} | {' '.join(f'{v:6.2f}' for v in res[c]['eager'])}")
    with open(a.out, "w") as f:
        json.dump({"device": a.device, "us": res}, f)


if __name__ == "__main__":
    main()
