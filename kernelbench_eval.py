"""KernelBench evaluation (paper §4.1, Table 1): pass rate, faster-than-eager / -compile rates, geomean speedups
(over correct solutions) and KernelBench's fast_p, per level and pooled, for a policy (agent mode) or for
pre-generated kernels (samples mode). Every candidate is judged by the trainer's sandbox pool and reward.py,
so evaluation and training cannot drift; one record per problem keeps its best solution (§4.1). Problems
come from tasks.load_kernelbench (a checkout, a .jsonl in the HF schema, a save_to_disk folder, the hub).

Departures from the paper / KernelBench
  1. Timings, tolerances and precision are the sandbox's (atol = rtol = 1e-2 as the paper, TF32 for baselines
     and candidate alike when precision="auto"), not KernelBench's harness; summary.json records precision.
  2. Known-degenerate problems (L2 23/80/83, L1 94/96/100) are scored but flagged, and report.md gives every
     metric again without them (`--no-flag-degenerate`: off).
  3. A harness crash is a failure with `harness_error`, retried on resume; a candidate's failure is not.
  4. A best solution that was only verified is profiled once more, so its speedups are measured.
  5. The sandbox's memory cap is 64 GB per child here (KernelBench L1 tensors reach 8 GB).
  6. Samples mode judges samples by KernelBench's own rules (`--sandbox.rules kernelbench`: no torch compute,
     outputs may be allocated with torch, e.g. `torch::zeros_like`), the rules they were written for; agent
     mode by the paper's (`cuda-agent`), the rules the policy was trained under. Records and summary.json say
     which profile each verdict used (sandbox/harness/rules.py states both).

Problems: --kernelbench-dir, else --hf-dataset, else $KERNELBENCH_DIR, else ./KernelBench (a clone of
github.com/ScalingIntelligence/KernelBench); the hub only when named. Exit codes: 0 the run finished and
wrote its report (whatever the pass rate), 2 bad arguments or an infrastructure error, before any scoring.

Smoke (CPU, fixtures, samples mode):
  python kernelbench_eval.py --kernelbench-dir tests/fixtures/kernelbench --level 1 2 \
      --samples-dir tests/fixtures/kernelbench/samples --sandbox.device cpu --sandbox.no-profile --out runs/kb_smoke
Full (GPU node, agent mode, the paper's Table 1 set: L1-L3 with a trained adapter, 200 turns; train's
OUT/adapter names its base model, so --policy.adapter is enough):
  python kernelbench_eval.py --level 1 2 3 --policy.adapter runs/paper/adapter --gpus 0 1 2 3 --out runs/kb_eval
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import matplotlib.ticker
import torch
from tqdm import tqdm

import env
import policy
import reward
import sandbox
import tasks
import tools
from tasks import SAMPLE_RE, Task, find_samples  # noqa: F401 - samples mode reads KernelBench's file naming

# KernelBench's own representative subsets (src/kernelbench/dataset.py, LEVEL{N}_REPRESENTATIVE_IDS).
REPRESENTATIVE = {
    1: [1, 3, 6, 18, 23, 26, 33, 36, 40, 42, 48, 54, 57, 65, 77, 82, 86, 87],
    2: [1, 2, 8, 18, 23, 28, 33, 43],
    3: [1, 5, 8, 11, 20, 21, 33, 38, 43],
}
# Problems whose score says little about kernel skill (hacks seen in public harnesses).
DEGENERATE = {
    (2, 23): "constant output: mean over a GroupNorm output is ~the mean of its bias",
    (2, 80): "constant output: max over dim 1 (keepdim) minus its own mean is 0, GELU(0) = 0",
    (2, 83): "constant output: min(x, 0) then clamp(0, 1) is 0 everywhere",
    (1, 94): "loss with an analytic shortcut (MSE of uniform inputs)",
    (1, 96): "loss with an analytic shortcut (Huber/smooth-L1 of uniform inputs)",
    (1, 100): "loss with an analytic shortcut (hinge loss of uniform inputs)",
}
P_VALUES = (0.0, 1.0, 1.5, 2.0)


@dataclass
class EvalConfig:
    level: list[int] = field(default_factory=lambda: [1])
    """KernelBench levels to evaluate (1..4)"""
    kernelbench_dir: str | None = None
    """local KernelBench checkout: a folder holding KernelBench/level{N}/{id}_{Name}.py (or level{N}/ itself);
    unset: $KERNELBENCH_DIR, else ./KernelBench"""
    hf_dataset: str | None = None
    """instead of a checkout: a .jsonl in the HF schema, a save_to_disk folder, or a hub id such as
    ScalingIntelligence/KernelBench (needs `pip install datasets` and the hub)"""
    problems: list[int] = field(default_factory=list)
    """problem ids to keep (empty: all problems of each level)"""
    subset: str = "all"
    """"all" or "representative" (KernelBench's small representative subset of levels 1-3)"""
    samples_dir: str | None = None
    """samples mode: score files level_{L}_problem_{P}_sample_{S}_kernel.py here (unset: agent mode)"""
    samples_only: bool = False
    """samples mode: keep only problems with a sample file (default: a missing sample counts as a failure)"""
    batch: int = 8
    """agent mode: problems whose episodes run together (one batched policy call per turn)"""
    out: str = "runs/kernelbench"
    """output folder: config.json, summary.json, results.jsonl, report.md, speedup_distribution.png; it holds
    one run: another mode, policy, sample set, level or device there is refused"""
    gpus: list[int] = field(default_factory=list)
    """GPU ids for the sandbox pool (empty: all visible GPUs / none on cpu)"""
    prewarm_workers: int = 8
    """compile the torch.compile baselines of uncached problems this many at a time before anything is timed
    (sandbox.prewarm; 0 = off, each problem then compiles inside its timed reference run)"""
    flag_degenerate: bool = True
    """flag known-degenerate problems (L2 23/80/83, L1 94/96/100) in the report"""
    resume: bool = True
    """skip problems already in OUT/results.jsonl (--no-resume starts the file afresh)"""
    seed: int = 0
    """the one seed: the sandbox's correctness inputs and the policy's sampling"""
    policy: policy.PolicyConfig = field(default_factory=policy.sized_policy)
    """agent mode: who acts (--policy.kind replay | hf | openai, --policy.model, --policy.adapter);
    --policy.max-new-tokens 4096 with a GPU, 1024 without one"""
    env: env.EnvConfig = field(default_factory=lambda: env.sized_env(max_turns_gpu=200))
    """agent mode: the episode (the paper's 200 evaluation turns with a GPU; 20 turns, 32k tokens without
    one); its work_dir is OUT/workspaces and its final check follows --sandbox.profile"""
    sandbox: sandbox.SandboxConfig = field(default_factory=lambda: sandbox.SandboxConfig(
        device="auto", mem_limit_mb=65536, rules="auto"))
    """how candidates are judged: --sandbox.device auto | cuda | cpu (cpu for smoke tests only), --sandbox.atol,
    --sandbox.no-profile (correctness only), --sandbox.mem-limit-mb (KernelBench L1 inputs reach 8 GB),
    --sandbox.rules auto (kernelbench in samples mode, cuda-agent in agent mode) | kernelbench | cuda-agent"""


# --------------------------------------------------------------------------------------------------
# arguments and the run folder: checked before any model, task or sandbox is loaded
# --------------------------------------------------------------------------------------------------

def prepare(cfg: EvalConfig) -> EvalConfig:
    """cfg with its device and problem source resolved; env.UsageError (one line naming the flag) if it
    cannot run. Cheap: no model, task or sandbox is touched."""
    source = tasks.find_kernelbench(cfg.kernelbench_dir, cfg.hf_dataset)   # first: what a new user lacks first
    dev = env.resolve_device(cfg.sandbox.device)
    if dev == "cuda" and not cfg.sandbox.ray_address:  # with it, the GPUs are the Ray cluster's
        n = torch.cuda.device_count()
        if not n:
            raise env.UsageError("--sandbox.device cuda, but torch sees no GPU: use --sandbox.device cpu (smoke) or auto")
        if any(not 0 <= g < n for g in cfg.gpus):
            raise env.UsageError(f"--gpus {cfg.gpus}: this machine has GPUs 0..{n - 1}")
    bad = [lv for lv in cfg.level if lv not in (1, 2, 3, 4)]
    if bad or not cfg.level:
        raise env.UsageError(f"--level {cfg.level}: levels are 1 2 3 4")
    if cfg.subset not in ("all", "representative"):
        raise env.UsageError(f"--subset must be all | representative, got {cfg.subset!r}")
    if cfg.samples_dir is not None and not os.path.isdir(cfg.samples_dir):
        raise env.UsageError(f"--samples-dir: no such directory {cfg.samples_dir}")
    if cfg.samples_dir is None and (why := policy.policy_problem(cfg.policy)):
        raise env.UsageError(f"{why}; or pass --samples-dir DIR to score pre-generated kernels")
    rules = cfg.sandbox.rules if cfg.sandbox.rules != "auto" else "kernelbench" if cfg.samples_dir else "cuda-agent"
    if rules not in sandbox.RULES:
        raise env.UsageError(f"--sandbox.rules {cfg.sandbox.rules!r}: use auto, {', '.join(sandbox.RULES)}")
    return dataclasses.replace(cfg, kernelbench_dir=source, hf_dataset=None, policy=policy.resolve_policy(cfg.policy),
                               sandbox=dataclasses.replace(cfg.sandbox, device=dev, rules=rules))


def run_key(cfg: EvalConfig) -> dict:
    """What results in OUT belong to: a run with another key never resumes from them (records would mix)."""
    return {"mode": "samples" if cfg.samples_dir else "agent", "level": sorted(cfg.level),
            "samples_dir": os.path.abspath(cfg.samples_dir) if cfg.samples_dir else None,
            "policy": None if cfg.samples_dir else [cfg.policy.kind, cfg.policy.model, cfg.policy.adapter,
                                                    cfg.policy.script],
            "device": cfg.sandbox.device, "rules": cfg.sandbox.rules}


def claim_out(cfg: EvalConfig, res_path: str) -> None:
    """Refuse to resume another run's results (env.UsageError); else record this run's key in OUT/config.json.
    --no-resume moves old results aside first."""
    cfg_path, key = os.path.join(cfg.out, "config.json"), run_key(cfg)
    if cfg.resume and os.path.exists(res_path):
        old = json.load(open(cfg_path)).get("run") if os.path.exists(cfg_path) else None
        if old != key:
            diff = ", ".join(f"{k} {old[k]} -> {key[k]}" for k in key if old.get(k) != key[k]) if old else \
                "results.jsonl without config.json"
            raise env.UsageError(f"{cfg.out} holds another run ({diff}): pass --out NEW_DIR, or --no-resume to "
                                 "start afresh there (old results kept as results.jsonl.*.bak)")
    if not cfg.resume and os.path.exists(res_path):
        os.replace(res_path, res_path + f".{int(time.time())}.bak")
    os.makedirs(cfg.out, exist_ok=True)
    with open(cfg_path + ".tmp", "w") as f:
        json.dump({"run": key, "config": dataclasses.asdict(cfg)}, f, indent=2, default=str)
    os.replace(cfg_path + ".tmp", cfg_path)


# --------------------------------------------------------------------------------------------------
# problems
# --------------------------------------------------------------------------------------------------


def load_problems(cfg: EvalConfig) -> list[Task]:
    """All problems of the chosen levels, filtered by --problems and --subset, sorted by (level, id)."""
    out = []
    for level in cfg.level:
        probs = tasks.load_kernelbench(cfg.kernelbench_dir or cfg.hf_dataset, [level])
        ids = {p.problem_id for p in probs}
        if cfg.problems:
            probs = [p for p in probs if p.problem_id in set(cfg.problems)]
        if cfg.subset == "representative":
            assert level in REPRESENTATIVE, f"KernelBench has no representative subset for level {level}"
            probs = [p for p in probs if p.problem_id in set(REPRESENTATIVE[level])]
        missing = sorted(set(cfg.problems) - ids)
        if missing:
            print(f"warning: level {level}: problems {missing} not found", file=sys.stderr)
        out += probs
    return sorted(out, key=lambda p: (p.level, p.problem_id))


# --------------------------------------------------------------------------------------------------
# one record per problem
# --------------------------------------------------------------------------------------------------


def passed(v: dict) -> bool:
    """Correct in the reward's sense (Eq. 1 tier > -1): compiled, correct, no violation."""
    return reward.reward_from_verdict(v, "milestone") > 0


def _speedup(v: dict, base_key: str, ratio_key: str) -> float | None:
    """Verdict's speedup, or base_ms / candidate_ms when only the times are there."""
    s = v.get(ratio_key)
    if s is None and v.get(base_key) and v.get("candidate_ms"):
        s = v[base_key] / v["candidate_ms"]
    return float(s) if s is not None and math.isfinite(s) and s > 0 else None


def best_verdict(verdicts: list[dict]) -> int:
    """Index of the best verdict: correct first, then the fastest candidate (the baselines are shared)."""
    def key(i):
        v = verdicts[i]
        t = v.get("candidate_ms")
        return (passed(v), -(t if t is not None else math.inf), -i)
    return max(range(len(verdicts)), key=key)


def error_verdict(msg: str, stage: str = "load") -> dict:
    """A failing verdict for a problem the harness could not score (no candidate, or a harness crash)."""
    return {"compiled": False, "correct": False, "violation": None, "error": msg, "eager_ms": None,
            "compile_ms": None, "candidate_ms": None, "speedup_eager": None, "speedup_compile": None,
            "stage": stage, "precision": None, "device": None, "compile_log": "",
            "trials": [], "timings": {}}


def candidate_line(v: dict, source: str) -> dict:
    """One line per scored candidate (kept in the record so every sample's fate is visible)."""
    return {"source": source, "correct": passed(v), "candidate_ms": v.get("candidate_ms"),
            "why": v.get("violation") or v.get("error"), "rules": rules_of(v)}


def rules_of(v: dict) -> str | None:
    """The rule profile a verdict was judged by (None: it failed before the static scan, or never ran)."""
    return (v.get("timings") or {}).get("rules")


def make_record(p: Task, v: dict, source: str, n_candidates: int, flag: bool,
                harness_error: str | None = None, candidates: list[dict] | None = None) -> dict:
    ok = passed(v)
    se, sc = _speedup(v, "eager_ms", "speedup_eager"), _speedup(v, "compile_ms", "speedup_compile")
    v = dict(v, compile_log=(v.get("compile_log") or "")[-2000:])
    return {"level": p.level, "problem_id": p.problem_id, "name": p.name, "correct": ok,
            "speedup_eager": se if ok else None, "speedup_compile": sc if ok else None,
            "tier": reward.reward_from_verdict(v, "milestone"),  # Eq. 1 with the 5% margin, for reference
            "precision": v.get("precision"), "device": v.get("device"), "rules": rules_of(v),
            "degenerate": DEGENERATE.get((p.level, p.problem_id)) if flag else None,
            "source": source, "n_candidates": n_candidates, "harness_error": harness_error, "verdict": v,
            "candidates": candidates or []}


# --------------------------------------------------------------------------------------------------
# metrics (paper Table 1 + KernelBench fast_p)
# --------------------------------------------------------------------------------------------------


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _joined(values) -> str | None:
    vals = sorted({str(x) for x in values if x is not None})
    return ",".join(vals) if vals else None


def metrics(records: list[dict], level) -> dict:
    """One row of Table 1 over `records` (rates are over all n problems; geomeans over correct ones)."""
    n = len(records)
    ok = [r for r in records if r["correct"]]
    se = [r["speedup_eager"] for r in ok if r["speedup_eager"] is not None]
    sc = [r["speedup_compile"] for r in ok if r["speedup_compile"] is not None]
    rate = (lambda k: k / n) if n else (lambda k: None)
    # correct solutions exist but none was timed (--no-profile): speed metrics are unknown, not 0
    untimed = bool(ok) and not se and not sc
    trate = (lambda k: None) if untimed else rate

    def fast(p, key):  # KernelBench fast_p: correct and speedup > p, over all n; p = 0 is the pass rate
        return (rate if p == 0 else trate)(sum(1 for r in ok if p == 0 or (r[key] is not None and r[key] > p)))

    return {"level": level, "n": n, "n_correct": len(ok), "n_timed": len(se),
            "pass_rate": rate(len(ok)),
            "faster_eager": trate(sum(1 for x in se if x > 1.0)),
            "faster_compile": trate(sum(1 for x in sc if x > 1.0)),
            "geomean_eager": _geomean(se), "geomean_compile": _geomean(sc),
            "fast_p": {f"{p:g}": fast(p, "speedup_eager") for p in P_VALUES},
            "fast_p_compile": {f"{p:g}": fast(p, "speedup_compile") for p in P_VALUES},
            "device": _joined(r["device"] for r in records),
            "precision": _joined(r["precision"] for r in records),
            "rules": _joined(r.get("rules") for r in records)}


def summarize(records: list[dict]) -> dict:
    """Overall row (pooled over problems, i.e. weighted by problem count) + one row per level, each also
    without the flagged (degenerate) problems."""
    levels = sorted({r["level"] for r in records})
    clean = [r for r in records if not r["degenerate"]]
    summary = metrics(records, "overall")
    summary["per_level"] = [metrics([r for r in records if r["level"] == L], L) for L in levels]
    summary["flagged"] = [{"level": r["level"], "problem_id": r["problem_id"], "reason": r["degenerate"]}
                          for r in records if r["degenerate"]]
    summary["excluding_flagged"] = [metrics(clean, "overall")] + [
        metrics([r for r in clean if r["level"] == L], L) for L in levels]
    summary["harness_errors"] = sum(1 for r in records if r.get("harness_error"))
    return summary


# --------------------------------------------------------------------------------------------------
# outputs: results.jsonl (resume), summary.json, report.md, plot, terminal table
# --------------------------------------------------------------------------------------------------


def read_results(path: str) -> dict[tuple[int, int], dict]:
    """Latest record per (level, problem_id); a torn last line (killed run) is skipped."""
    out: dict[tuple[int, int], dict] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[(r["level"], r["problem_id"])] = r
    return out


def compact_results(path: str, done: dict) -> None:
    """Rewrite results.jsonl atomically with one line per problem (retried problems replaced), sorted."""
    with open(path + ".tmp", "w") as f:
        for k in sorted(done):
            f.write(json.dumps(done[k], default=str) + "\n")
    os.replace(path + ".tmp", path)


def _fmt(x, kind: str) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if kind == "pct" else f"{x:.2f}x"


COLUMNS = [("n", "n", None), ("pass", "pass_rate", "pct"), ("faster eager", "faster_eager", "pct"),
           ("faster compile", "faster_compile", "pct"), ("geomean eager", "geomean_eager", "x"),
           ("geomean compile", "geomean_compile", "x")]


def table_rows(rows: list[dict]) -> list[list[str]]:
    head = ["level"] + [c[0] for c in COLUMNS] + [f"fast_{p:g}" for p in P_VALUES] + ["precision", "device"]
    out = [head]
    for r in rows:
        out.append([f"L{r['level']}" if isinstance(r["level"], int) else str(r["level"])]
                   + [str(r[k]) if kind is None else _fmt(r[k], kind) for _, k, kind in COLUMNS]
                   + [_fmt(r["fast_p"][f"{p:g}"], "pct") for p in P_VALUES]
                   + [r["precision"] or "-", r["device"] or "-"])
    return out


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def text_table(rows: list[list[str]]) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)


def write_report(path: str, summary: dict, records: list[dict], cfg: EvalConfig) -> None:
    mode = f"samples from `{cfg.samples_dir}`" if cfg.samples_dir else f"agent, policy `{cfg.policy}`"
    parts = [f"# KernelBench evaluation ({mode})", "",
             f"Rules: `{cfg.sandbox.rules}` (--sandbox.rules; sandbox/harness/rules.py states what each profile "
             "allows).", "",
             "Metrics as paper Table 1: rates over all problems; faster = correct and plainly faster "
             "(no 5% margin); geomeans over correct solutions; fast_p (KernelBench) = correct and speedup over "
             "eager > p. Overall is pooled over problems (weighted by problem count).", "",
             markdown_table(table_rows(summary["per_level"] + [summary]))]
    if summary["flagged"]:
        parts += ["", "## Flagged (known-degenerate) problems", "",
                  "Scored above like every other problem; their verdicts say little about kernel skill.", "",
                  "| level | problem | correct | speedup vs compile | reason |", "|---|---|---|---|---|"]
        for r in records:
            if r["degenerate"]:
                parts.append(f"| {r['level']} | {r['problem_id']} {r['name']} | {r['correct']} | "
                             f"{_fmt(r['speedup_compile'], 'x')} | {r['degenerate']} |")
        parts += ["", "### Without the flagged problems", "",
                  markdown_table(table_rows(summary["excluding_flagged"][1:] + summary["excluding_flagged"][:1]))]
    parts += ["", "## Per problem", "",
              "| level | problem | correct | vs eager | vs compile | tier (Eq. 1) | candidates | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in records:
        v = r["verdict"]
        note = r.get("harness_error") or v.get("violation") or v.get("error") or ""
        note = ("FLAGGED (degenerate); " if r["degenerate"] else "") + note.replace("|", "/").replace("\n", " ")[:120]
        parts.append(f"| {r['level']} | {r['problem_id']} {r['name']} | {r['correct']} | "
                     f"{_fmt(r['speedup_eager'], 'x')} | {_fmt(r['speedup_compile'], 'x')} | {r['tier']:+.0f} | "
                     f"{r['n_candidates']} | {note} |")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def plot_speedups(path: str, records: list[dict]) -> None:
    """speedup_distribution.png, labelled like train's curves.png: one panel per level, the histogram of the
    speedups of the correct solutions (x: t_baseline / t_candidate on a log scale, y: problems per bin), one
    line per baseline (eager, torch.compile) and a dotted line at 1x; the title counts the correct problems."""
    levels = sorted({r["level"] for r in records}) or [0]
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4), squeeze=False)
    for ax, L in zip(axes[0], levels):
        rows = [r for r in records if r["level"] == L]
        for key, label in (("speedup_eager", "vs eager"), ("speedup_compile", "vs torch.compile")):
            xs = [r[key] for r in rows if r["correct"] and r[key]]
            if xs:
                lo, hi = min(min(xs), 0.5), max(max(xs), 2.0)
                bins = [lo * (hi / lo) ** (i / 30) for i in range(31)]
                ax.hist(xs, bins=bins, histtype="step", linewidth=1.5, label=f"{label} (n={len(xs)})")
        ax.axvline(1.0, color="k", linestyle=":", linewidth=1, label="1x: as fast as the baseline")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.get_major_locator().set_params(integer=True)
        n_ok = sum(bool(r["correct"]) for r in rows)
        ax.set_title(f"KernelBench level {L}: {n_ok}/{len(rows)} problems correct", pad=10)
        ax.set_xlabel("speedup = t_baseline / t_candidate (log scale; > 1x is faster)")
        ax.set_ylabel("correct problems per bin")
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle("speedup of each correct solution over eager PyTorch and torch.compile "
                 "(wrong solutions are not drawn: see the title's count)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# the two modes; each calls emit(record) once per finished problem
# --------------------------------------------------------------------------------------------------


def make_pool(cfg: EvalConfig, scfg):
    """The trainer's sandbox pool (compiles on CPU cores, verify/profile one job per GPU; with
    --sandbox.ray-address one per GPU of the Ray cluster, and --gpus does not apply)."""
    gpus = None
    if cfg.sandbox.device == "cuda" and not cfg.sandbox.ray_address:  # prepare() checked that torch lists them
        gpus = cfg.gpus or list(range(torch.cuda.device_count()))
    return sandbox.make_pool(scfg, gpus=gpus)


def _result(fut) -> tuple[dict, str | None]:
    """A future's verdict as a dict, or a failing verdict + the harness error if scoring itself crashed."""
    try:
        v = fut.result()
        return (v.to_dict() if hasattr(v, "to_dict") else dict(v)), None
    except Exception as e:  # noqa: BLE001 - a crash on one problem never ends the run
        msg = f"harness crash: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return error_verdict(msg, stage="harness"), msg


def run_samples(todo: list[Task], pool, cfg: EvalConfig, scfg, emit) -> None:
    """Samples mode: every sample of every problem goes to the pool at once; a problem is recorded when its
    last sample is scored, keeping its best sample (the paper's "best solution of each trajectory")."""
    found = find_samples(cfg.samples_dir)
    futs, slots = {}, {}
    for p in todo:
        samples = found.get((p.level, p.problem_id), [])
        if not samples:
            emit(make_record(p, error_verdict("no sample file for this problem"), "", 0, cfg.flag_degenerate))
            continue
        slots[(p.level, p.problem_id)] = [None] * len(samples)
        for i, (_, path) in enumerate(samples):
            try:
                futs[pool.submit(p.code, pathlib.Path(path), scfg)] = (p, i, samples)
            except Exception as e:  # noqa: BLE001
                f = cf.Future()
                f.set_exception(e)
                futs[f] = (p, i, samples)
    try:
        _collect(futs, slots, cfg, emit)
    except BaseException:  # Ctrl-C / fatal: drop the queued checks so the pool can close promptly
        for f in futs:
            f.cancel()
        raise


def _collect(futs: dict, slots: dict, cfg: EvalConfig, emit) -> None:
    for fut in cf.as_completed(futs):
        p, i, samples = futs[fut]
        slot = slots[(p.level, p.problem_id)]
        slot[i] = _result(fut)
        if any(s is None for s in slot):
            continue
        b = best_verdict([v for v, _ in slot])
        # a problem is retried on resume only if nothing passed and the harness (not a candidate) crashed
        err = next((e for _, e in slot if e), None) if not any(passed(v) for v, _ in slot) else None
        cands = [candidate_line(v, path) | {"harness_error": e} for (v, e), (_, path) in zip(slot, samples)]
        emit(make_record(p, slot[b][0], samples[b][1], len(samples), cfg.flag_degenerate, err, cands))


def _policy(cfg: EvalConfig):
    return policy.make_policy(cfg.policy, device=cfg.sandbox.device, seed=cfg.seed)


def _best_of_trajectory(p: Task, t, pool, cfg: EvalConfig, scfg) -> dict:
    """The trajectory's best verdict (the env keeps it: highest Eq. 1 tier, then fastest); if that solution
    was only verified, never profiled, profile its snapshot once so its speedups are measured."""
    v = t.best_verdict
    if v is None:
        return error_verdict("the episode produced no verified solution", stage="load")
    ws = tools.restore_best(os.path.join(cfg.out, "best", f"level_{p.level}_problem_{p.problem_id}"), p.code,
                            cfg.sandbox.device, t.best_files, layout=cfg.env.workspace)
    if cfg.sandbox.profile and passed(v) and v.get("candidate_ms") is None:
        v = pool.submit(p.code, pathlib.Path(ws), scfg).result().to_dict()
    return v


def run_agent(todo: list[Task], pool, cfg: EvalConfig, scfg, emit) -> None:
    """Agent mode: env.run_episodes runs the policy on `cfg.batch` problems at a time (one policy.act per
    turn over all active episodes, up to cfg.env.max_turns turns); every check goes through the same pool.
    Trajectories are appended to OUT/trajectories.jsonl, best solutions kept in OUT/best/."""
    pol = _policy(cfg)
    ecfg = dataclasses.replace(cfg.env, work_dir=os.path.join(cfg.out, "workspaces"), final_check=cfg.sandbox.profile)
    for i in range(0, len(todo), cfg.batch):
        chunk = todo[i:i + cfg.batch]
        named = [dataclasses.replace(p, name=f"level_{p.level}_problem_{p.problem_id}_{p.name}") for p in chunk]
        try:
            trajs = env.run_episodes(pol, named, pool, ecfg, id_offset=i)
            tasks.save_trajectories(os.path.join(cfg.out, "trajectories.jsonl"), trajs, append=True)
        except Exception as e:  # noqa: BLE001 - one failing batch never ends the run
            msg = f"harness crash: {type(e).__name__}: {e}"[:400]
            for p in chunk:
                emit(make_record(p, error_verdict(msg, "harness"), "agent", 0, cfg.flag_degenerate, msg))
            continue
        for p, t in zip(chunk, trajs):
            try:
                v, err = _best_of_trajectory(p, t, pool, cfg, scfg), None
            except Exception as e:  # noqa: BLE001
                err = f"harness crash: {type(e).__name__}: {e}"[:400]
                v = error_verdict(err, "harness")
            n_checks = sum(1 for turn in t.turns for c in turn.get("calls", []) if c.get("verdict"))
            emit(make_record(p, v, f"agent:{cfg.policy.kind} stop={t.stop_reason} turns={len(t.turns)}", n_checks,
                             cfg.flag_degenerate, err))


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------


def sandbox_config(cfg: EvalConfig):
    return dataclasses.replace(cfg.sandbox, seed=cfg.seed)


def main(cfg: EvalConfig) -> int:
    """Score, then write the report. 0: the run finished (whatever the pass rate); 2: bad arguments or an
    infrastructure error (one line on stderr, no traceback)."""
    res_path = os.path.join(cfg.out, "results.jsonl")
    # torch.compile's cache goes under the sandbox cache, not $TMPDIR/torchinductor_$USER
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser(cfg.sandbox.cache_dir), "inductor"))
    try:
        cfg = prepare(cfg)
        problems = load_problems(cfg)
        if cfg.samples_dir and cfg.samples_only:
            found = find_samples(cfg.samples_dir)
            problems = [p for p in problems if (p.level, p.problem_id) in found]
        if not problems:
            raise env.UsageError(f"no problems selected (levels {cfg.level}, --problems {cfg.problems}, "
                                 f"--subset {cfg.subset})")
        claim_out(cfg, res_path)
    except (env.UsageError, sandbox.TaskError, OSError, RuntimeError) as e:  # OSError: also the hub's ConnectionError
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    try:
        return _run(cfg, problems, res_path)
    except sandbox.SandboxError as e:   # the sandbox's own failure (a child that cannot start): not a verdict
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


def _run(cfg: EvalConfig, problems: list[Task], res_path: str) -> int:
    done = read_results(res_path)
    todo = [p for p in problems if (p.level, p.problem_id) not in done
            or done[(p.level, p.problem_id)].get("harness_error")]
    print(f"kernelbench_eval: {len(problems)} problems (levels {cfg.level}), {len(problems) - len(todo)} "
          f"already in {res_path}, {len(todo)} to score ({'samples' if cfg.samples_dir else 'agent'} mode, "
          f"rules {cfg.sandbox.rules})")
    keys = {(p.level, p.problem_id) for p in problems}

    if todo:
        scfg = sandbox_config(cfg)
        pool = make_pool(cfg, scfg)
        if cfg.prewarm_workers > 0 and cfg.sandbox.profile:  # phase 1: compile in parallel; phase 2 times one per GPU
            t0 = time.time()
            wb = tqdm(desc="prewarm torch.compile (uncached problems)", dynamic_ncols=True)
            warmed = pool.prewarm([p.code for p in todo], cfg.prewarm_workers, on_done=lambda h, err: wb.update(1))
            wb.close()
            print(f"prewarm: {len(warmed)} problems compiled in {time.time() - t0:.0f} s")
        bar = tqdm(total=len(todo), desc="kernelbench", dynamic_ncols=True)
        with open(res_path, "a") as fout:
            if fout.tell() > 0:   # a run killed mid-line left a torn last line: start on a fresh line
                with open(res_path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        fout.write("\n")

            def emit(rec: dict) -> None:
                fout.write(json.dumps(rec, default=str) + "\n")
                fout.flush()
                done[(rec["level"], rec["problem_id"])] = rec
                cur = [r for k, r in done.items() if k in keys]
                m = metrics(cur, "running")
                bar.set_postfix({"pass": _fmt(m["pass_rate"], "pct"), "faster_eager": _fmt(m["faster_eager"], "pct"),
                                 "faster_compile": _fmt(m["faster_compile"], "pct")})
                bar.update(1)
            try:
                (run_samples if cfg.samples_dir else run_agent)(todo, pool, cfg, scfg, emit)
            finally:
                bar.close()
                pool.close()

    compact_results(res_path, done)
    records = [done[(p.level, p.problem_id)] for p in problems if (p.level, p.problem_id) in done]
    for r in records:  # the flag follows this run's setting, also for records from an earlier run
        r["degenerate"] = DEGENERATE.get((r["level"], r["problem_id"])) if cfg.flag_degenerate else None
    summary = summarize(records)
    summary["rules"] = cfg.sandbox.rules   # this run's profile; each record says the one its verdict used
    summary["config"] = dataclasses.asdict(cfg)
    with open(os.path.join(cfg.out, "summary.json.tmp"), "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(os.path.join(cfg.out, "summary.json.tmp"), os.path.join(cfg.out, "summary.json"))
    write_report(os.path.join(cfg.out, "report.md"), summary, records, cfg)
    plot_speedups(os.path.join(cfg.out, "speedup_distribution.png"), records)
    print(text_table(table_rows(summary["per_level"] + [summary])))
    if summary["flagged"]:
        print(f"flagged (degenerate, scored): {[(f['level'], f['problem_id']) for f in summary['flagged']]}")
    if summary["harness_errors"]:
        print(f"warning: {summary['harness_errors']} problems hit a harness error (retried on --resume)")
    print(f"wrote {cfg.out}/summary.json, results.jsonl, report.md, speedup_distribution.png")
    return 0


if __name__ == "__main__":
    import tyro   # the command line only: library users of this module do not need it

    import train_config
    hidden = {env.EnvConfig: ("work_dir", "final_check")}  # set by the run: OUT/workspaces, --sandbox.profile
    cfg = tyro.cli(EvalConfig, registry=train_config.cli_registry(hidden), description="KernelBench evaluation: paper Table 1 metrics + fast_p. "
                   "Problems from --kernelbench-dir, --hf-dataset, $KERNELBENCH_DIR or ./KernelBench. "
                   "Exit codes: 0 the run finished (whatever the pass rate), 2 bad arguments or an "
                   "infrastructure error, 130 interrupted (Ctrl-C; the results so far are kept and resumed).")
    sys.exit(sandbox.interruptible(lambda: main(cfg)))
