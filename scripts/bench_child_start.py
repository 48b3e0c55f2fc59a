"""Where a sandbox child's start-up goes: the interpreter alone, under bubblewrap, and a warm spare's stages
(started, torch imported, device up, warm), for one child alone and for N started at once.

GPU: python scripts/bench_child_start.py --device cuda --n 10
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402
from sandbox.child import Child, new_jobdir, phases  # noqa: E402


def wall(cmd: list[str], n: int = 5) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def spares(n: int, device: str, warm_for: str, timeout_s: float = 120) -> list[dict]:
    """Start n warm spares at once; each one's stage times (s from its start) once it reports `warm`."""
    cfg = sandbox.SandboxConfig(device=device)
    kids = [Child(new_jobdir(), device=device, mem_limit_mb=cfg.mem_limit_mb, gpu=0 if device == "cuda" else None,
                  warm_for=warm_for) for _ in range(n)]
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end and not all(any(m.get("stage") == "warm" for _, m in k.msgs) for k in kids):
        time.sleep(0.05)
    out = [phases(k.msgs, k.t_started) for k in kids]
    for k in kids:
        k.kill()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--n", type=int, default=10, help="spares started at once in the second round")
    a = p.parse_args()
    sandbox.guard_library(sandbox.SandboxConfig(device=a.device))
    py = sys.executable
    print(f"python -c pass: {wall([py, '-c', 'pass']):.3f} s; "
          f"python -S -c pass: {wall([py, '-S', '-c', 'pass']):.3f} s; "
          f"python -c 'import torch': {wall([py, '-c', 'import torch'], 3):.3f} s", flush=True)
    imp = subprocess.run([py, "-X", "importtime", "-c", "pass"], capture_output=True, text=True).stderr.splitlines()
    rows = sorted((int(r.split("|")[1]), r.split("|")[2].strip()) for r in imp if r.count("|") == 2 and
                  r.split("|")[1].strip().isdigit())
    print("slowest imports at interpreter start (cumulative us):", rows[-5:], flush=True)
    if sandbox.isolation() == "bwrap":
        bw = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--unshare-all",
              "--die-with-parent"]
        print(f"bwrap true: {wall(bw + ['true']):.3f} s; bwrap python -c pass: {wall(bw + [py, '-c', 'pass']):.3f} s",
              flush=True)
    for warm_for in ("candidate", "reference"):
        for n in (1, a.n):
            ph = spares(n, a.device, warm_for)
            keys = sorted({k for d in ph for k in d}, key=lambda k: statistics.median(d.get(k, 0) for d in ph))
            print(f"{warm_for} spares, {n} at once, median s from start: " +
                  ", ".join(f"{k[:-5]} {statistics.median(d[k] for d in ph if k in d):.2f}" for k in keys), flush=True)


if __name__ == "__main__":
    main()
