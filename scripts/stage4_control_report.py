"""Stage 4 against its frozen-actor control (scripts/stage4_control.sh): per run the probe, correct episodes
per step, half counts and rewards, per-task halves, wall time; per seed the pairing checks (same probe, same
task order, where the paired episodes first differ), whether each actor moved from the stage-3 checkpoint,
and the statistics (difference of the half-to-half rises against its binomial sd; paired episodes that one
arm passed and the other failed, exact sign test).

  python scripts/stage4_control_report.py ROOT      (ROOT/sN/{base,trained,control}, N the seed)
"""
import json, glob, os, re, sys, math
import torch

root = sys.argv[1]
NAMES = {"aa0f1c45": "S", "96c6a4af": "M", "5db118b4": "E", "c3837eaa": "L"}

def rows(d, pat):
    out = []
    for f in sorted(glob.glob(f"{d}/rollouts/{pat}")):
        out.append([json.loads(l) for l in open(f)])
    return out

def wall(log):
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", open(log).read()) if os.path.exists(log) else None
    return m.group(1) if m else "?"

def run(d):
    steps = rows(d, "s4_*.jsonl")
    probe = rows(d, "probe_s4_*.jsonl")
    tasks = json.load(open(f"{d}/stage4_tasks.json")) if os.path.exists(f"{d}/stage4_tasks.json") else {}
    ok = [[bool((r.get("final_verdict") or {}).get("correct")) for r in s] for s in steps]
    rw = [[r["final_reward"] for r in s] for s in steps]
    names = [[NAMES.get(r["task"][:8], r["task"][:8]) for r in s] for s in steps]
    met = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    m4 = [m for m in met if m["stage"] == 4]
    return dict(ok=ok, rw=rw, names=names, probe=probe, tasks=tasks, m4=m4,
                ids=[[tuple(r["ids"]) for r in s] for s in steps])

def actor(d):
    ck = torch.load(f"{d}/checkpoint.pt", map_location="cpu", weights_only=False)
    return ck["stage"], ck["step"], ck["actor"]

res = {}
for sd in sorted(glob.glob(f"{root}/s*/")):
    seed = os.path.basename(sd.rstrip("/"))
    for arm in ("trained", "control"):
        d = os.path.join(sd, arm)
        if not os.path.exists(f"{d}/rollouts") or not glob.glob(f"{d}/rollouts/s4_*.jsonl"):
            continue
        r = run(d)
        r["wall"] = wall(os.path.join(sd, f"{arm}.log"))
        res[(seed, arm)] = r
        n = len(r["ok"]); h = n // 2
        c = [sum(s) for s in r["ok"]]
        a, b = sum(c[:h]), sum(c[h:])
        na, nb = sum(len(s) for s in r["ok"][:h]), sum(len(s) for s in r["ok"][h:])
        ra = sum(sum(s) for s in r["rw"][:h]) / max(na, 1); rb = sum(sum(s) for s in r["rw"][h:]) / max(nb, 1)
        pt = {}
        for i, (ss, oo) in enumerate(zip(r["names"], r["ok"])):
            for t, o in zip(ss, oo):
                x = pt.setdefault(t, [0, 0, 0, 0]); x[0 if i < h else 2] += o; x[1 if i < h else 3] += 1
        probe = r["tasks"].get("probe", {})
        chosen = set(r["tasks"].get("tasks", []))
        ps = " ".join(f"{NAMES.get(k[:8], k[:8])} {v[0]}{'*' if k in chosen else ''}" for k, v in probe.items())
        kl = [m.get("kl_ref") for m in r["m4"]]
        print(f"{seed} {arm:8s} steps={n} wall={r['wall']} probe[{ps}] correct/step={' '.join(map(str, c))} "
              f"halves {a}/{na} -> {b}/{nb}  reward {ra:+.2f} -> {rb:+.2f}  pass {sum(c)}/{na+nb}={sum(c)/max(na+nb,1):.2f} "
              f"reward/step={' '.join(f'{sum(x)/len(x):+.2f}' for x in r['rw'])} "
              f"per-task {', '.join(f'{t} {x[0]}/{x[1]}->{x[2]}/{x[3]}' for t, x in sorted(pt.items()))} "
              f"kl_ref max {max(k for k in kl if k is not None):.3f}")
    # pairing checks
    t, c = res.get((seed, "trained")), res.get((seed, "control"))
    if t and c:
        same_tasks = [a == b for a, b in zip(t["names"], c["names"])]
        same_ids = [sum(x == y for x, y in zip(a, b)) for a, b in zip(t["ids"], c["ids"])]
        print(f"   pairing {seed}: probe equal={t['tasks'].get('probe') == c['tasks'].get('probe')} "
              f"task order equal per step={all(same_tasks)} identical episodes (token ids) per step={same_ids}")
        # episode-level discordance, steps >= 1
        tc = sum(x and not y for a, b in zip(t["ok"], c["ok"]) for x, y in zip(a, b))
        ct = sum(y and not x for a, b in zip(t["ok"], c["ok"]) for x, y in zip(a, b))
        print(f"   discordant pairs {seed}: trained-only correct {tc}, control-only correct {ct}")
        TR = rows(os.path.join(sd, "trained"), "s4_*.jsonl"); CR = rows(os.path.join(sd, "control"), "s4_*.jsonl")
        pol = []
        for a, b in zip(TR, CR):
            k = 0
            for x, y in zip(a, b):
                n = next((i for i, (p, q) in enumerate(zip(x["ids"], y["ids"])) if p != q), None)
                k += n is not None and (x["mask"][n] == 1 or y["mask"][n] == 1)
            pol.append(k)
        print(f"   episodes whose first differing token is a sampled (policy) token, per step {seed}: {pol}")
    if os.path.exists(f"{sd}/base/checkpoint.pt"):
        s0, st0, a0 = actor(f"{sd}/base")
        for arm in ("trained", "control"):
            if os.path.exists(f"{sd}/{arm}/checkpoint.pt"):
                s1, st1, a1 = actor(f"{sd}/{arm}")
                diff = max((a1[k] - a0[k]).abs().max().item() for k in a0)
                print(f"   actor {seed} {arm}: checkpoint stage {s1} step {st1}, max |w - w_stage3| = {diff:.3g}")

# pooled statistics
from math import comb, sqrt
def sign_p(k, n):  # two-sided exact sign test
    if n == 0: return 1.0
    m = max(k, n - k)
    return min(1.0, 2 * sum(comb(n, i) for i in range(m, n + 1)) / 2 ** n)
seeds = sorted({s for s, _ in res if (s, "trained") in res and (s, "control") in res  # both arms, as many steps
                and len(res[(s, "trained")]["ok"]) == len(res[(s, "control")]["ok"])})
tot = dict(at=0, bt=0, ac=0, bc=0, n=0, tc=0, ct=0, tc2=0, ct2=0)
for s in seeds:
    t, c = res[(s, "trained")], res[(s, "control")]
    h = len(t["ok"]) // 2
    at, bt = sum(map(sum, t["ok"][:h])), sum(map(sum, t["ok"][h:]))
    ac, bc = sum(map(sum, c["ok"][:h])), sum(map(sum, c["ok"][h:]))
    n = sum(map(len, t["ok"][:h]))
    p = (at + bt + ac + bc) / (4 * n)
    sd = sqrt(4 * n * p * (1 - p))  # sd of (bt-at)-(bc-ac) with 4 independent Bin(n, p) halves
    tc = sum(x and not y for a, b in zip(t["ok"], c["ok"]) for x, y in zip(a, b))
    ct = sum(y and not x for a, b in zip(t["ok"], c["ok"]) for x, y in zip(a, b))
    tc2 = sum(x and not y for a, b in zip(t["ok"][h:], c["ok"][h:]) for x, y in zip(a, b))
    ct2 = sum(y and not x for a, b in zip(t["ok"][h:], c["ok"][h:]) for x, y in zip(a, b))
    print(f"{s}: trained {at}->{bt} ({bt-at:+d}), control {ac}->{bc} ({bc-ac:+d}), difference of rises {(bt-at)-(bc-ac):+d} "
          f"(binomial sd {sd:.1f}); trained vs control overall {at+bt} vs {ac+bc} of {2*n}; paired discordant "
          f"{tc}:{ct} (sign p={sign_p(tc, tc+ct):.2f}), second half {tc2}:{ct2}")
    for k, v in dict(at=at, bt=bt, ac=ac, bc=bc, n=n, tc=tc, ct=ct, tc2=tc2, ct2=ct2).items(): tot[k] += v
if seeds:
    n, p = tot["n"], (tot["at"] + tot["bt"] + tot["ac"] + tot["bc"]) / (4 * tot["n"])
    sd = sqrt(4 * n * p * (1 - p))
    print(f"pooled {len(seeds)} seeds: trained {tot['at']}->{tot['bt']} ({tot['bt']-tot['at']:+d}), control {tot['ac']}->{tot['bc']} "
          f"({tot['bc']-tot['ac']:+d}); difference of rises {(tot['bt']-tot['at'])-(tot['bc']-tot['ac']):+d} (binomial sd {sd:.1f}, "
          f"z={((tot['bt']-tot['at'])-(tot['bc']-tot['ac']))/sd:.2f}); paired discordant {tot['tc']}:{tot['ct']} "
          f"(sign p={sign_p(tot['tc'], tot['tc']+tot['ct']):.2f}), second half {tot['tc2']}:{tot['ct2']} "
          f"(sign p={sign_p(tot['tc2'], tot['tc2']+tot['ct2']):.2f})")
