"""Stage 4 against its two controls (experiments/stage4_control.sh): "trained" (the defaults), "control" (a frozen
actor, --ppo.lr-actor 0) and "permuted" (--agent.permute-rewards: each step's rewards dealt out by a random
permutation over its trajectories).

Per run: the probe, correct episodes per step, half counts and rewards, per-task halves, wall time. Per seed and
control arm: the pairing checks (same probe, same task order, where the paired episodes first differ) and the
episodes one arm passed and the other failed (a description: episodes of one run are not independent draws);
whether each actor moved from the stage-3 checkpoint.

The statistic, one number per run: the pass-rate rise, pass rate in the second half of stage 4's steps minus in
the first. Per seed, trained rise - permuted rise and trained rise - frozen rise. Across seeds the seed is the
unit (its episodes share one actor's history, so they are not pooled as independent draws): the mean
difference, its standard error over seeds, t with n - 1 degrees of freedom, and the exact two-sided sign-flip
p (under "no learning from the reward" each seed's difference is as likely negative as positive; n seeds
cannot give a p below 2 / 2^n).

  python experiments/stage4_control_report.py ROOT      (ROOT/sN/{base,trained,control,permuted}, N the seed)
"""
from __future__ import annotations

import glob
import itertools
import json
import math
import os
import re
import sys

import torch

NAMES = {"aa0f1c45": "S", "96c6a4af": "M", "5db118b4": "E", "c3837eaa": "L"}  # the tiny preset's four tasks
ARMS = ("trained", "control", "permuted")
LABEL = {"trained": "trained", "control": "frozen", "permuted": "permuted"}


def rows(d: str, pat: str) -> list[list[dict]]:
    """One list of rollout records per file of d/rollouts matching pat, in step order."""
    out = []
    for f in sorted(glob.glob(f"{d}/rollouts/{pat}")):
        with open(f) as fh:
            out.append([json.loads(line) for line in fh])
    return out


def wall(log: str) -> str:
    text = open(log).read() if os.path.exists(log) else ""
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    return m.group(1) if m else "?"


def load_run(d: str) -> dict:
    """Stage 4 of one run directory: per step the correctness, reward, task letter and token ids of each episode."""
    steps = rows(d, "s4_*.jsonl")
    tasks = json.load(open(f"{d}/stage4_tasks.json")) if os.path.exists(f"{d}/stage4_tasks.json") else {}
    met = [json.loads(line) for line in open(f"{d}/metrics.jsonl")] if os.path.exists(f"{d}/metrics.jsonl") else []
    return dict(ok=[[bool((r.get("final_verdict") or {}).get("correct")) for r in s] for s in steps],
                rw=[[r["final_reward"] for r in s] for s in steps],
                names=[[NAMES.get(r["task"][:8], r["task"][:8]) for r in s] for s in steps],
                ids=[[r["ids"] for r in s] for s in steps], mask=[[r["mask"] for r in s] for s in steps],
                tasks=tasks, m4=[m for m in met if m.get("stage") == 4])


def halves(ok: list[list[bool]]) -> tuple[int, int, int, int]:
    """(correct, episodes) in the first half of the steps, then in the second (an odd step goes to the second)."""
    h = len(ok) // 2
    return (sum(map(sum, ok[:h])), sum(map(len, ok[:h])), sum(map(sum, ok[h:])), sum(map(len, ok[h:])))


def rise(ok: list[list[bool]]) -> float:
    """Pass rate in the second half of the steps minus in the first: one run's statistic."""
    a, na, b, nb = halves(ok)
    return b / max(nb, 1) - a / max(na, 1)


def sign_flip_p(xs: list[float]) -> float:
    """Exact two-sided sign-flip test of mean(xs) = 0: the share of the 2^n sign patterns whose |mean| is at least
    the observed one (each x is as likely negative as positive under the null)."""
    if not xs:
        return 1.0
    obs = abs(sum(xs)) - 1e-12
    flips = itertools.product((1, -1), repeat=len(xs))
    return sum(abs(sum(s * x for s, x in zip(signs, xs))) >= obs for signs in flips) / 2 ** len(xs)


def across_seeds(diffs: list[float]) -> dict:
    """Mean of the per-seed differences, sd and standard error over seeds, t (n - 1 df), sign-flip p."""
    n = len(diffs)
    mean = sum(diffs) / n if n else float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1)) if n > 1 else float("nan")
    se = sd / math.sqrt(n) if n > 1 else float("nan")
    t = mean / se if n > 1 and se > 0 else float("nan")
    return dict(n=n, mean=mean, sd=sd, se=se, t=t, df=n - 1, positive=sum(x > 0 for x in diffs), p=sign_flip_p(diffs),
                p_min=2 / 2 ** n if n else 1.0)


def describe(seed: str, arm: str, r: dict) -> str:
    """One line per run: what the old report printed for the trained and frozen arms."""
    c = [sum(s) for s in r["ok"]]
    a, na, b, nb = halves(r["ok"])
    h = len(r["ok"]) // 2
    ra = sum(map(sum, r["rw"][:h])) / max(na, 1)
    rb = sum(map(sum, r["rw"][h:])) / max(nb, 1)
    pt: dict[str, list[int]] = {}
    for i, (ss, oo) in enumerate(zip(r["names"], r["ok"])):
        for t, o in zip(ss, oo):
            x = pt.setdefault(t, [0, 0, 0, 0])
            x[0 if i < h else 2] += o
            x[1 if i < h else 3] += 1
    chosen = set(r["tasks"].get("tasks", []))
    probe = " ".join(f"{NAMES.get(k[:8], k[:8])} {v[0]}{'*' if k in chosen else ''}"
                     for k, v in r["tasks"].get("probe", {}).items())
    kl = [m["kl_ref"] for m in r["m4"] if m.get("kl_ref") is not None]
    return (f"{seed} {LABEL[arm]:8s} steps={len(c)} wall={r['wall']} probe[{probe}] "
            f"correct/step={' '.join(map(str, c))} halves {a}/{na} -> {b}/{nb} (rise {rise(r['ok']):+.3f})  "
            f"reward {ra:+.2f} -> {rb:+.2f}  "
            f"pass {sum(c)}/{na + nb}={sum(c) / max(na + nb, 1):.2f} "
            f"per-task {', '.join(f'{t} {x[0]}/{x[1]}->{x[2]}/{x[3]}' for t, x in sorted(pt.items()))}"
            + (f" kl_ref max {max(kl):.3f}" if kl else ""))


def pairing(seed: str, t: dict, c: dict, arm: str) -> None:
    """The paired episodes of trained and one control arm: same probe, same task order, where they part."""
    same_tasks = all(a == b for a, b in zip(t["names"], c["names"]))
    same_ids = [sum(x == y for x, y in zip(a, b)) for a, b in zip(t["ids"], c["ids"])]
    pol = []  # episodes whose first differing token is a sampled (policy) token, per step
    for ia, ib, ma, mb in zip(t["ids"], c["ids"], t["mask"], c["mask"]):
        k = 0
        for x, y, mx, my in zip(ia, ib, ma, mb):
            n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
            k += n is not None and (mx[n] == 1 or my[n] == 1)
        pol.append(k)
    tc = sum(x and not y for a, b in zip(t["ok"], c["ok"]) for x, y in zip(a, b))
    ct = sum(y and not x for a, b in zip(t["ok"], c["ok"]) for x, y in zip(a, b))
    print(f"   {seed} trained vs {LABEL[arm]}: probe equal={t['tasks'].get('probe') == c['tasks'].get('probe')} "
          f"task order equal={same_tasks} identical episodes per step={same_ids} first difference at a sampled "
          f"token per step={pol}; passed by trained only {tc}, by {LABEL[arm]} only {ct}")


def actor_moves(sd: str, seed: str) -> None:
    """max |w - w_stage3| of each arm's final actor against the stage-3 checkpoint (frozen: exactly 0)."""
    if not os.path.exists(f"{sd}/base/checkpoint.pt"):
        return
    a0 = torch.load(f"{sd}/base/checkpoint.pt", map_location="cpu", weights_only=False)["actor"]
    for arm in ARMS:
        if os.path.exists(f"{sd}/{arm}/checkpoint.pt"):
            ck = torch.load(f"{sd}/{arm}/checkpoint.pt", map_location="cpu", weights_only=False)
            diff = max((ck["actor"][k] - a0[k]).abs().max().item() for k in a0)
            print(f"   {seed} {LABEL[arm]}: checkpoint stage {ck['stage']} step {ck['step']}, max |w - w_stage3| = "
                  f"{diff:.3g}")


def main(root: str) -> dict:
    """Print the report; return {"seeds": {seed: {arm: rise, difference: ...}}, "trained-permuted": across_seeds,
    "trained-frozen": across_seeds}."""
    res: dict[tuple[str, str], dict] = {}
    for sd in sorted(glob.glob(f"{root}/s*/")):
        seed = os.path.basename(sd.rstrip("/"))
        for arm in ARMS:
            d = os.path.join(sd, arm)
            if glob.glob(f"{d}/rollouts/s4_*.jsonl"):
                res[(seed, arm)] = {**load_run(d), "wall": wall(os.path.join(sd, f"{arm}.log"))}
                print(describe(seed, arm, res[(seed, arm)]))
        for arm in ARMS[1:]:
            if (seed, "trained") in res and (seed, arm) in res:
                pairing(seed, res[(seed, "trained")], res[(seed, arm)], arm)
        actor_moves(sd, seed)

    # the statistic per run, then per seed the differences; a seed counts where both arms ran as many steps
    print("\nper seed: pass-rate rise (2nd half - 1st half of stage 4) of each arm, and the differences")
    out: dict = {"seeds": {}}
    diffs: dict[str, list[float]] = {"trained-permuted": [], "trained-frozen": []}
    for seed in sorted({s for s, _ in res}):
        rises = {LABEL[a]: rise(res[(seed, a)]["ok"]) for a in ARMS if (seed, a) in res}
        line = {**rises}
        t = res.get((seed, "trained"))
        for arm, key in (("permuted", "trained-permuted"), ("control", "trained-frozen")):
            c = res.get((seed, arm))
            if t and c and len(t["ok"]) == len(c["ok"]):
                line[key] = rises["trained"] - rises[LABEL[arm]]
                diffs[key].append(line[key])
        out["seeds"][seed] = line
        print(f"{seed}: " + ", ".join(f"{k} {v:+.3f}" for k, v in line.items()))
    print("\nacross seeds (the seed is the unit):")
    for key, xs in diffs.items():
        s = across_seeds(xs)
        out[key] = s
        if s["n"]:
            print(f"{key}: mean {s['mean']:+.3f} over {s['n']} seeds ({s['positive']} positive), sd {s['sd']:.3f}, "
                  f"se {s['se']:.3f}, t = {s['t']:.2f} ({s['df']} df), sign-flip p = {s['p']:.3f} (smallest "
                  f"possible with {s['n']} seeds: {s['p_min']:.3f})")
        else:
            print(f"{key}: no seed with both arms over the same steps")
    return out


if __name__ == "__main__":
    main(sys.argv[1])
