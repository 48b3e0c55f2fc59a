"""Benchmark task synthesis on a GPU: >= 200 composed candidates through the real filters (1-100 ms window on
CUDA), reporting the acceptance rate per filter and tasks per hour, as JSON and a markdown table.

Run on the H200 (from the repo root):
    python scripts/bench_synth.py --n-candidates 240 --workers 8 --out-dir runs/bench_synth
CPU smoke (tiny, wide window, fast compile backend):
    python scripts/bench_synth.py --device cpu --n-candidates 8 --workers 1 --compile-backend eager
Outputs: <out-dir>/bench_synth.json and <out-dir>/bench_synth.md (plus the synth JSONL and its manifest).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import synth  # noqa: E402
from synth_filters import FILTERS  # noqa: E402
from tasks import load_tasks  # noqa: E402


def summarize(man: dict, rows: list[dict], wall_s: float) -> dict:
    """Per-filter entered/rejected/pass rate, acceptance, throughput, runtime spread of accepted tasks."""
    rej, n = man["rejections"], man["n_candidates"]
    entered, left = {}, n - rej.get("compose", 0)
    for f in FILTERS:
        entered[f] = left
        left -= rej.get(f, 0)
    per_filter = [{"filter": f, "entered": entered[f], "rejected": rej.get(f, 0),
                   "pass_rate": round(1 - rej.get(f, 0) / entered[f], 4) if entered[f] else None}
                  for f in FILTERS]
    eager = [r["eager_ms"] for r in rows if r.get("eager_ms") is not None]
    speed = [r["eager_ms"] / r["compile_ms"] for r in rows if r.get("eager_ms") and r.get("compile_ms")]
    return {"n_candidates": n, "n_accepted": man["n_accepted"], "acceptance": round(man["n_accepted"] / max(n, 1), 4),
            "compose_failures": rej.get("compose", 0), "per_filter": per_filter, "wall_s": round(wall_s, 1),
            "candidates_per_hour": round(n / wall_s * 3600, 1),
            "tasks_per_hour": round(man["n_accepted"] / wall_s * 3600, 1),
            "accepted_by_source": man["counts"], "window_ms": man["window_ms"], "device": man["device"],
            "eager_ms_median": round(statistics.median(eager), 3) if eager else None,
            "eager_ms_min_max": [round(min(eager), 3), round(max(eager), 3)] if eager else None,
            "compile_speedup_median": round(statistics.median(speed), 3) if speed else None,
            "command": man["command"], "versions": man["versions"], "catalogue": {
                k: man["catalogue"][k] for k in ("mined", "mined_by_kind", "pointwise", "skipped")}}


def markdown(s: dict) -> str:
    lines = [f"### synth bench: {s['n_candidates']} candidates on {s['device']} (window {s['window_ms']} ms)", "",
             "| filter | entered | rejected | pass rate |", "|---|---:|---:|---:|"]
    for r in s["per_filter"]:
        rate = "-" if r["pass_rate"] is None else f"{100 * r['pass_rate']:.1f}%"
        lines.append(f"| {r['filter']} | {r['entered']} | {r['rejected']} | {rate} |")
    lines += ["", "| metric | value |", "|---|---|",
              f"| accepted | {s['n_accepted']} / {s['n_candidates']} ({100 * s['acceptance']:.1f}%) |",
              f"| wall time | {s['wall_s']} s |", f"| tasks per hour | {s['tasks_per_hour']} |",
              f"| candidates per hour | {s['candidates_per_hour']} |",
              f"| accepted by source | {s['accepted_by_source']} |",
              f"| eager ms of accepted (median, min-max) | {s['eager_ms_median']}, {s['eager_ms_min_max']} |",
              f"| eager/compile time (median) | {s['compile_speedup_median']} |",
              f"| command | `{s['command']}` |"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-candidates", type=int, default=240)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--kernelbench-dir", default=None)
    ap.add_argument("--out-dir", default="runs/bench_synth")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    cfg = synth.SynthConfig(out=os.path.join(a.out_dir, "tasks.jsonl"), n_candidates=a.n_candidates,
                            workers=a.workers, chunk=a.chunk, seed=a.seed, compile_backend=a.compile_backend,
                            kernelbench_dir=a.kernelbench_dir, resume=False, progress=True)
    cfg.sandbox = dataclasses.replace(cfg.sandbox, device=a.device)
    t0 = time.time()
    synth.main(cfg)
    wall = time.time() - t0
    man = json.load(open(cfg.out + ".manifest.json"))
    rows = [t.to_row() for t in load_tasks(cfg.out)] if os.path.getsize(cfg.out) else []
    s = summarize(man, rows, wall)
    with open(os.path.join(a.out_dir, "bench_synth.json"), "w") as f:
        json.dump(s, f, indent=1)
    md = markdown(s)
    with open(os.path.join(a.out_dir, "bench_synth.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
