"""Checks a minute of the sandbox pool on Ray (sandbox.ray.RayPool) against its number of lanes, next to the local
pool (sandbox.SandboxPool) with as many slots, on the same candidates, and what Ray adds to each check.

Every row submits --checks checks of the ReLU workspace (tests/fixtures/sandbox: a form (b) workspace with a C++
kernel, so its bytes travel to the lane) at once, after as many untimed ones (drivers and caches warm), and
reports checks a minute. Ray's overhead per check is the host's time of the call minus the lane's own time of
the check (`timings["ray_overhead_ms"]`: packing, transfers, the actor call, unpacking), median over the row;
the serial rows run --serial checks one at a time on one lane and one local slot (wall time per check, both).
Without --address it starts a local cluster (ray.cluster_utils.Cluster, --nodes nodes sharing max(--lanes) CPU
lanes) and reports its start-up and each pool's. The local pool's children run with the lanes' OMP_NUM_THREADS
(--omp-threads; unset, each of them would use every core of this machine).

CPU: python scripts/bench_ray.py --device cpu --lanes 1 2 4 --checks 8 --serial 4
GPU: python scripts/bench_ray.py --device cuda --address auto --lanes 1 2 4 8 --checks 64   (a running cluster)
"""
import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sandbox  # noqa: E402
import sandbox.ray  # noqa: E402

TASK = pathlib.Path(ROOT, "tests", "fixtures", "sandbox", "relu_task.py")
WS = pathlib.Path(ROOT, "tests", "fixtures", "sandbox", "relu_ws")


def batch(pool, n: int) -> dict:
    """`n` untimed checks at once (drivers, caches and the pool's threads warm: the local pool's first batch ran
    ~1.5x slower than its second here), then `n` timed: wall time, checks a minute, Ray's overhead, lanes used."""
    for f in [pool.submit(TASK, WS) for _ in range(n)]:
        f.result()
    t = time.perf_counter()
    vs = [f.result() for f in [pool.submit(TASK, WS) for _ in range(n)]]
    wall = time.perf_counter() - t
    bad = [v.error or v.violation for v in vs if not v.correct]
    assert not bad, bad
    over = [v.timings["ray_overhead_ms"] for v in vs if "ray_overhead_ms" in v.timings]
    return {"checks": n, "wall_s": round(wall, 1), "checks_per_min": round(60 * n / wall, 1),
            "ray_overhead_ms_median": statistics.median(over) if over else None,
            "ray_overhead_ms_max": max(over) if over else None,
            "lanes_used": len({v.timings["lane"]["lane"] for v in vs if "lane" in v.timings}) or None}


def serial(pool, n: int) -> dict:
    """`n` checks one at a time (after one untimed): median wall time of a check."""
    pool.submit(TASK, WS).result()
    walls, over, inside = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        v = pool.submit(TASK, WS).result()
        walls.append(time.perf_counter() - t)
        over += [v.timings["ray_overhead_ms"]] if "ray_overhead_ms" in v.timings else []
        inside += [v.timings["lane"]["check_s"]] if "lane" in v.timings else []
    return {"checks": n, "check_s_median": round(statistics.median(walls), 3),
            "lane_check_s_median": statistics.median(inside) if inside else None,  # the check inside the lane
            "ray_overhead_ms_median": statistics.median(over) if over else None}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--address", default=None, help="a running Ray cluster (auto | HOST:PORT); default: start one")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the local cluster")
    p.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--checks", type=int, default=8)
    p.add_argument("--serial", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--omp-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the local pool's children: Ray sets a cpu lane's to its CPUs (1 here) and "
                        "a GPU lane's to 1, so the rows compare like with like; 0 leaves it unset")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    if args.omp_threads:  # the local pool's children inherit it (sandbox.child.PASS_ENV)
        os.environ["OMP_NUM_THREADS"] = str(args.omp_threads)
    import ray
    from ray.cluster_utils import Cluster
    cluster, rows, t0 = None, [], time.perf_counter()
    if args.address is None:
        per = -(-max(args.lanes) // args.nodes)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": per})
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=per)
        cluster.wait_for_nodes()
    address = args.address or cluster.address
    sandbox.ray.connect(address)
    start = {"cluster_and_connect_s": round(time.perf_counter() - t0, 1)}
    print(f"ray {ray.__version__}: {args.nodes if cluster else 'running'} node(s) up and connected in "
          f"{start['cluster_and_connect_s']} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
          flush=True)
    cfg = sandbox.SandboxConfig(device=args.device, cache_dir=os.path.join(tempfile.mkdtemp(), "cache"),
                                warmup=args.warmup, iters=args.iters, ray_address=address)
    local_cfg = dataclasses.replace(cfg, ray_address=None)
    sandbox.check(TASK, WS, local_cfg)  # the guard, bytecode, compile and baseline caches, once
    for n in args.lanes:
        gpus = list(range(n)) if args.device == "cuda" else None
        pool = sandbox.SandboxPool(local_cfg, gpus=gpus, cpu_slots=n)
        try:
            rows.append({"pool": "local", "lanes": n, **batch(pool, args.checks)})
            if n == 1 and args.serial:
                rows.append({"pool": "local", "lanes": 1, "serial": True, **serial(pool, args.serial)})
        finally:
            pool.close()
        print(json.dumps(rows[-1]), flush=True)
        t = time.perf_counter()
        pool = sandbox.ray.RayPool(cfg, max_lanes=n)
        up = round(time.perf_counter() - t, 1)
        try:
            rows.append({"pool": "ray", "lanes": len(pool.lanes), "pool_start_s": up, **batch(pool, args.checks)})
            if n == 1 and args.serial:
                rows.append({"pool": "ray", "lanes": 1, "serial": True, **serial(pool, args.serial)})
        finally:
            pool.close()
        print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    print("\n| pool | lanes | checks | wall s | checks/min | Ray overhead per check, ms (median / max) | pool start s |"
          "\n|---|---|---|---|---|---|---|")
    for r in (r for r in rows if not r.get("serial")):
        med, top = r["ray_overhead_ms_median"], r["ray_overhead_ms_max"]
        o = "-" if med is None else f"{med:.1f} / {top:.1f}"
        print(f"| {r['pool']} | {r['lanes']} | {r['checks']} | {r['wall_s']} | {r['checks_per_min']} | {o} | "
              f"{r.get('pool_start_s', '-')} |")
    ser = {r["pool"]: r for r in rows if r.get("serial")}
    if len(ser) == 2:
        loc, on_ray = ser["local"]["check_s_median"], ser["ray"]["check_s_median"]
        print(f"\none check at a time: local {loc:.3f} s, Ray {on_ray:.3f} s (difference {1e3 * (on_ray - loc):+.0f} "
              f"ms), of which inside the lane {ser['ray']['lane_check_s_median']:.3f} s and Ray's own overhead "
              f"{ser['ray']['ray_overhead_ms_median']:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"start": start, "rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
