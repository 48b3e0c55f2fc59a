"""Agreement with KernelBench's own eval: every sample is judged twice, by KernelBench's `eval_kernel_against_ref`
(imported from a KernelBench checkout, one subprocess per sample with a timeout, as KernelBench's own
scripts/eval_from_generations.py does) and by our sandbox (`sandbox.check` through a SandboxPool,
`--sandbox.rules kernelbench`, on cuda, as `kernelbench_eval.py --samples-dir` scores samples); then the
confusion table: both correct / both refuse / we refuse but they accept / they refuse but we accept, with the
reason for every disagreement.

GPU (repo root; a KernelBench checkout and samples named level_{L}_problem_{P}_sample_{S}_kernel.py):
  python3 scripts/kb_agreement.py --kernelbench .carry/kb/KernelBench --samples-dir .carry/kb/samples \
      --jobs 16 --limit 20 --overlap --eval-jobs 2 --budget-s 540 --out $OUT/kb_agree.json
CPU (no eval: the sample -> problem mapping and the plan only; then our side alone on the CPU fixtures):
  python3 scripts/kb_agreement.py --kernelbench .carry/kb/KernelBench --samples-dir .carry/kb/samples --dry-run
  python3 scripts/kb_agreement.py --kernelbench tests/fixtures/kernelbench --samples-dir tests/fixtures/kernelbench/samples \
      --side ours --device cpu --no-profile --limit 2 --out runs/kb_agree_cpu.json

What runs, in order (--overlap: 1-2 beside 3; each phase is timed and printed; --budget-s stops starting new work and writes
the table of what finished):
  1. theirs, compile: KernelBench's `build_compile_cache` for every sample, --jobs at a time, on CPU (the GPU
     hidden), each into its own build dir (many samples reuse one load_inline name), as KernelBench's
     compile.py precompiles before its eval; a failure here is not a verdict (step 2 compiles again).
  2. theirs, eval: `eval_kernel_against_ref` one sample at a time (--eval-jobs), same build dir, so
     load_inline finds the build; KernelBench's script defaults: 5 correctness trials, fp32 (tolerance
     1e-4 at this KernelBench version), measure_performance with 100 timed trials (cuda_event), the
     excessive-speedup flag on; a timeout or a crash of the subprocess is a refusal, as in KernelBench.
  3. ours: a SandboxPool (one GPU; --jobs compile slots) judges every sample; torch.compile baselines are
     prewarmed first (sandbox.prewarm) unless --no-profile. "Correct" is kernelbench_eval.passed (compiled,
     correct, no violation), the samples-mode score.

KernelBench's package imports API clients at import time (kernelbench/__init__ -> utils: dotenv, openai,
litellm; eval.py: pydantic). The eval subprocess stubs those that are not installed in sys.modules before the
import (an inert module; pydantic's BaseModel as a plain class with copied defaults): the eval path calls
none of them.

Time (H100, 16 cores): KernelBench's load_inline build is ~40-60 s per sample and our sandbox builds each
sample once more: with --jobs 16 the builds of N samples take ~2 x N/16 x 60 s of the cores; then each of
their evals is a fresh process (~8-15 s: torch import, CUDA start, 5 trials, 2 x 100 timed runs) and each of
our checks ~5-10 s, after ~1-2 min of torch.compile prewarm. One after the other, ~12 samples fit a 10-minute
call; with --overlap (both sides at once) and --eval-jobs 2, ~20-25. --out is rewritten after every sample and
read back on a rerun (--no-resume: start afresh), so a larger set can be split over calls (--side theirs /
--side ours); --budget-s ends a call in time with the table of what finished.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import hashlib
import importlib
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402

# Modules KernelBench imports at top level that its eval path never calls (API clients, config loaders).
STUB_MODULES = ("dotenv", "openai", "litellm", "together", "anthropic", "google.generativeai", "modal", "pydra",
                "datasets", "archon")
CATEGORIES = ("both correct", "both refuse", "we refuse, they accept", "they refuse, we accept")
ERROR_KEYS = ("compilation_error", "runtime_error", "correctness_issue", "cuda_error", "other_error",
              "error_during_performance")


# --------------------------------------------------------------------------------------------------
# samples and their problems
# --------------------------------------------------------------------------------------------------

def sample_jobs(kernelbench: str, samples_dir: str, limit: int = 0) -> tuple[list[dict], list[str]]:
    """([job, ...], [problem-less file, ...]) for the samples in samples_dir (tasks.find_samples, the naming
    kernelbench_eval's samples mode reads), each job with its problem from the KernelBench checkout
    (tasks.load_kernelbench). limit > 0 keeps that many (spread)."""
    found = tasks.find_samples(samples_dir)
    levels = sorted({lv for lv, _ in found})
    problems = {(t.level, t.problem_id): t for t in tasks.load_kernelbench(kernelbench, levels)} if levels else {}
    jobs, orphans = [], []
    for (lv, pid), samples in sorted(found.items()):
        for sid, path in samples:
            t = problems.get((lv, pid))
            if t is None:
                orphans.append(os.path.basename(path))
                continue
            src = open(path).read()
            jobs.append({"file": os.path.basename(path), "path": path, "level": lv, "problem_id": pid,
                         "sample_id": sid, "problem": t.name, "problem_path": t.path,
                         "sha": hashlib.sha256((t.code + "\0" + src).encode()).hexdigest()[:16]})
    if 0 < limit < len(jobs):
        jobs = spread(jobs, limit)
    return jobs, orphans


def spread(jobs: list[dict], limit: int) -> list[dict]:
    """`limit` jobs: each level gets its share (at least one while limit allows), evenly spaced within it."""
    by = {}
    for j in jobs:
        by.setdefault(j["level"], []).append(j)
    quota = {lv: max(1, limit * len(js) // len(jobs)) for lv, js in by.items()}
    for lv in sorted(by, key=lambda lv: -len(by[lv])):   # hand out the rounding remainder, largest levels first
        if sum(quota.values()) >= limit:
            break
        quota[lv] += 1
    while sum(quota.values()) > limit:                    # more levels than limit: drop the smallest shares
        quota[min(quota, key=lambda lv: (quota[lv], len(by[lv])))] -= 1
    out = [js[i * len(js) // quota[lv]] for lv, js in by.items() for i in range(min(quota[lv], len(js)))]
    return sorted(out, key=lambda j: (j["level"], j["problem_id"], j["sample_id"]))


# --------------------------------------------------------------------------------------------------
# KernelBench's side: a child process per sample
# --------------------------------------------------------------------------------------------------

class _Inert(types.ModuleType):
    """A stand-in module: any attribute is an inert callable class (from openai import OpenAI; load_dotenv())."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None,
                               "__getattr__": lambda self, n: None})


class _BaseModel:
    """pydantic.BaseModel as KernelBench's result class uses it: annotated fields with defaults (copied per
    instance), keyword construction, attribute writes, model_dump / dict."""

    def __init__(self, **kw):
        for k in self._fields():
            setattr(self, k, copy.deepcopy(getattr(type(self), k, None)))
        for k, v in kw.items():
            setattr(self, k, v)

    @classmethod
    def _fields(cls) -> list[str]:
        out = []
        for c in reversed(cls.__mro__):
            out += [k for k in getattr(c, "__annotations__", {}) if k not in out]
        return out

    def model_dump(self) -> dict:
        return {k: getattr(self, k) for k in self._fields()}

    dict = model_dump

    def __repr__(self):
        return f"{type(self).__name__}({self.model_dump()})"


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent package is missing
        return True


def stub_missing_modules(names=STUB_MODULES) -> list[str]:
    """Put an inert module in sys.modules for each of `names` that is not installed (pydantic: a minimal
    BaseModel); returns the names stubbed."""
    stubbed = []
    for name in names:
        if name in sys.modules or not _missing(name):
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules:
                sys.modules[sub] = _Inert(sub)
                if i > 1:
                    setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], sys.modules[sub])
        stubbed.append(name)
    if "pydantic" not in sys.modules and _missing("pydantic"):
        mod = types.ModuleType("pydantic")
        mod.BaseModel = _BaseModel
        sys.modules["pydantic"] = mod
        stubbed.append("pydantic")
    return stubbed


def import_kernelbench_eval(kernelbench: str):
    """KernelBench's eval module from a checkout: src/kernelbench/eval.py (the package layout) or src/eval.py
    (older versions)."""
    root = os.path.abspath(kernelbench)
    if os.path.exists(os.path.join(root, "src", "kernelbench", "eval.py")):
        sys.path.insert(0, os.path.join(root, "src"))
        return importlib.import_module("kernelbench.eval")
    if os.path.exists(os.path.join(root, "src", "eval.py")):
        sys.path.insert(0, root)
        return importlib.import_module("src.eval")
    raise FileNotFoundError(f"--kernelbench {kernelbench}: no src/kernelbench/eval.py nor src/eval.py")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def their_error(meta: dict) -> str | None:
    """The first failure KernelBench's metadata records, one line (with the max difference of a mismatch)."""
    for k in ERROR_KEYS:
        if meta.get(k):
            msg = str(meta[k]).strip().splitlines()
            msg = f"{k}: {msg[0] if msg else ''}"[:300]
            if k == "correctness_issue" and meta.get("max_difference"):
                msg += f" (max_difference {meta['max_difference']}, trials {meta.get('correctness_trials', '?')})"
            return msg
    return None


def child_main(spec: dict) -> dict:
    """One subprocess's work: "compile" (build_compile_cache into build_dir) or "eval" (eval_kernel_against_ref)."""
    stubbed = stub_missing_modules()
    if spec.get("gpu_arch"):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", spec["gpu_arch"])
    kb_eval = import_kernelbench_eval(spec["kernelbench"])
    if spec["mode"] == "import":
        return {"ok": callable(getattr(kb_eval, "eval_kernel_against_ref", None)), "stubbed": stubbed,
                "module": kb_eval.__file__}
    src = open(spec["sample"]).read()
    if spec["mode"] == "compile":
        ok, _out, err = kb_eval.build_compile_cache(src, verbose=False, build_dir=spec["build_dir"])
        return {"ok": bool(ok), "error": (str(err).splitlines() or [""])[0][:300] if err else None, "stubbed": stubbed}
    ref = open(spec["ref"]).read()
    kw = dict(original_model_src=ref, custom_model_src=src, seed_num=spec.get("seed", 42),
              num_correct_trials=spec["num_correct_trials"], num_perf_trials=spec["num_perf_trials"],
              measure_performance=spec["measure_performance"], build_dir=spec["build_dir"], device=0)
    if "precision" in kb_eval.eval_kernel_against_ref.__code__.co_varnames:
        kw["precision"] = kb_eval.get_torch_dtype_from_string("fp32")
    try:
        r = kb_eval.eval_kernel_against_ref(**kw)
    except Exception as e:  # noqa: BLE001 - as eval_from_generations' last-level catch: a crash is a failure
        kind = "cuda_error" if "CUDA error" in str(e) else "other_error"
        return {"compiled": False, "correctness": False, "runtime": -1.0, "ref_runtime": -1.0,
                "metadata": {kind: f"{type(e).__name__}: {e}"[:500]}, "error": f"{kind}: {str(e)[:300]}",
                "stubbed": stubbed}
    if r is None:  # KernelBench's answer to a lock-file error during compile: retry
        return {"retry": True, "error": "lock file error during compile (KernelBench returns None: retry)",
                "stubbed": stubbed}
    meta = _jsonable(dict(r.metadata))
    return {"compiled": bool(r.compiled), "correctness": bool(r.correctness), "runtime": r.runtime,
            "ref_runtime": getattr(r, "ref_runtime", -1.0), "metadata": meta,
            "excessive_speedup": bool(meta.get("excessive_speedup")),
            "error": None if r.correctness else their_error(meta), "stubbed": stubbed}


def run_child(spec: dict, timeout_s: float, env: dict | None = None, python: str = sys.executable) -> dict:
    """Run child_main(spec) as the leader of its own process group (setsid) with a timeout (the whole group
    is killed on timeout); returns its result dict, or {"error": "timeout ..." | "crash ..."} for a process that gave none."""
    with tempfile.TemporaryDirectory(prefix="kb_agree_") as d:
        spec_path, res_path = os.path.join(d, "spec.json"), os.path.join(d, "result.json")
        with open(spec_path, "w") as f:
            json.dump(dict(spec, result=res_path), f)
        t0 = time.time()
        p = subprocess.Popen([python, os.path.abspath(__file__), "--child", spec_path], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            return {"error": f"timeout after {timeout_s:.0f} s", "timed_out": True, "wall_s": round(time.time() - t0, 1),
                    "log_tail": out.decode(errors="replace")[-1500:]}
        wall = round(time.time() - t0, 1)
        if os.path.exists(res_path):
            with open(res_path) as f:
                return dict(json.load(f), wall_s=wall)
        tail = out.decode(errors="replace")[-1500:]
        last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
        return {"error": f"crash (exit {p.returncode}): {last[:300]}", "wall_s": wall, "log_tail": tail}


def theirs_accepts(r: dict | None) -> bool | None:
    """KernelBench's verdict: compiled and correct (None: not run)."""
    if not r:
        return None
    return bool(r.get("compiled") and r.get("correctness"))


# --------------------------------------------------------------------------------------------------
# our side
# --------------------------------------------------------------------------------------------------

def our_record(v: dict, passed: bool) -> dict:
    """The fields of a sandbox verdict the table uses."""
    trials = v.get("trials") or []
    bad = next((t for t in trials if not t.get("ok")), None)
    return {"correct": passed, "compiled": v.get("compiled"), "reason": v.get("violation") or v.get("error"),
            "violation": v.get("violation"), "stage": v.get("stage"), "form": v.get("form"),
            "rules": (v.get("timings") or {}).get("rules"), "speedup": v.get("speedup_eager"),
            "speedup_compile": v.get("speedup_compile"), "candidate_ms": v.get("candidate_ms"),
            "eager_ms": v.get("eager_ms"), "precision": v.get("precision"), "device": v.get("device"),
            "max_abs_err": max((t.get("max_abs_err") or 0.0 for t in trials), default=None),
            "failed_trial": bad and {k: bad.get(k) for k in ("trial", "reason", "variant")}}


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------

def category(theirs: bool | None, ours: bool | None) -> str | None:
    if theirs is None or ours is None:
        return None
    return {(True, True): CATEGORIES[0], (False, False): CATEGORIES[1], (True, False): CATEGORIES[2],
            (False, True): CATEGORIES[3]}[(theirs, ours)]


def disagreement_reason(rec: dict) -> str:
    """Why the two verdicts differ, from the refusing side's own words (and the accepting side's flags)."""
    th, ou = rec.get("theirs") or {}, rec.get("ours") or {}
    if rec["category"] == CATEGORIES[2]:
        why = f"ours: {ou.get('reason') or 'incorrect'}"
        if ou.get("stage"):
            why += f" [stage {ou['stage']}]"
        flags = [f"their static checker: {'; '.join(th['static_errors'])[:200]}"] if th.get("static_errors") else []
        if th.get("excessive_speedup"):
            flags.append("their excessive-speedup flag")
        return why + (f"; they accept ({', '.join(flags)})" if flags else "; they accept")
    why = f"theirs: {th.get('error') or 'incorrect'}"
    if ou.get("max_abs_err") is not None:
        why += f"; ours passes (max abs err {ou['max_abs_err']:.3g}, precision {ou.get('precision')})"
    return why


def build_table(records: list[dict]) -> dict:
    """Counts per category (all and per level), and the disagreements with their reasons; records gain
    "category" (None while a side is missing)."""
    counts = {c: 0 for c in CATEGORIES} | {"incomplete": 0}
    per_level: dict[int, dict] = {}
    dis = []
    for rec in records:
        c = category(theirs_accepts(rec.get("theirs")), (rec.get("ours") or {}).get("correct"))
        rec["category"] = c
        key = c or "incomplete"
        counts[key] += 1
        per_level.setdefault(rec["level"], {k: 0 for k in counts})[key] += 1
        if c in CATEGORIES[2:]:
            rec["reason"] = disagreement_reason(rec)
            dis.append({"file": rec["file"], "level": rec["level"], "problem_id": rec["problem_id"],
                        "problem": rec.get("problem"), "category": c, "reason": rec["reason"]})
    n = sum(counts[c] for c in CATEGORIES)
    return {"counts": counts, "per_level": {str(k): v for k, v in sorted(per_level.items())},
            "agreement": (counts[CATEGORIES[0]] + counts[CATEGORIES[1]]) / n if n else None,
            "disagreements": dis}


def markdown(table: dict) -> str:
    def row(name, c):
        return f"| {name} | " + " | ".join(str(c[k]) for k in (*CATEGORIES, "incomplete")) + " |"
    lines = ["| samples | " + " | ".join((*CATEGORIES, "incomplete")) + " |", "|---" * 6 + "|"]
    lines += [row(f"level {lv}", c) for lv, c in table["per_level"].items()]
    lines.append(row("all", table["counts"]))
    if table["agreement"] is not None:
        lines.append(f"\nagreement: {table['agreement']:.1%} of the samples both sides judged")
    if table["disagreements"]:
        lines += ["", "| sample | problem | disagreement | reason |", "|---|---|---|---|"]
        for d in table["disagreements"]:
            reason = d["reason"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {d['file']} | L{d['level']} {d['problem_id']} {d.get('problem') or ''} | "
                         f"{d['category']} | {reason} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------

class Run:
    def __init__(self, args, jobs: list[dict], orphans: list[str]):
        self.args, self.jobs, self.t0, self.lock = args, jobs, time.time(), threading.Lock()
        old = {}
        if args.resume and os.path.exists(args.out):
            with open(args.out) as f:
                old = {(r["file"], r["sha"]): r for r in json.load(f).get("samples", [])}
        self.records = []
        for j in jobs:
            prev = old.get((j["file"], j["sha"]), {})
            self.records.append(dict({k: v for k, v in j.items() if k != "path"},
                                     theirs=prev.get("theirs"), ours=prev.get("ours")))
        self.meta = {"kernelbench": os.path.abspath(args.kernelbench), "samples_dir": os.path.abspath(args.samples_dir),
                     "orphans": orphans, "phases": {}, "config": {k: v for k, v in vars(args).items() if k != "child"}}
        src = os.path.join(os.path.dirname(os.path.abspath(args.samples_dir)), "SOURCES.json")
        if os.path.exists(src):
            with open(src) as f:
                self.meta["sources"] = json.load(f)

    def left_s(self) -> float:
        return self.args.budget_s - (time.time() - self.t0) if self.args.budget_s else float("inf")

    def save(self) -> dict:
        with self.lock:   # both sides save (at once with --overlap)
            return self._save()

    def _save(self) -> dict:
        table = build_table(self.records)
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out + ".tmp", "w") as f:
            json.dump(dict(self.meta, table=table, samples=self.records), f, indent=1, default=str)
        os.replace(self.args.out + ".tmp", self.args.out)
        return table

    def phase(self, name: str, t0: float, n: int) -> None:
        self.meta["phases"][name] = {"seconds": round(time.time() - t0, 1), "samples": n}
        print(f"[{name}] {n} samples in {time.time() - t0:.0f} s", flush=True)

    # ---- theirs
    def _spec(self, rec: dict, mode: str) -> dict:
        a = self.args
        return {"mode": mode, "kernelbench": os.path.abspath(a.kernelbench), "sample": os.path.join(a.samples_dir, rec["file"]),
                "ref": rec["problem_path"], "gpu_arch": a.gpu_arch,
                "build_dir": os.path.join(a.build_dir, f"level_{rec['level']}", str(rec["problem_id"]), str(rec["sample_id"])),
                "num_correct_trials": a.num_correct_trials, "num_perf_trials": a.num_perf_trials,
                "measure_performance": a.measure_performance}

    def theirs(self) -> None:
        a = self.args
        todo = [r for r in self.records if r["theirs"] is None]
        if not todo:
            return
        pre = run_child({"mode": "import", "kernelbench": os.path.abspath(a.kernelbench)}, 300)
        if not pre.get("ok"):  # the harness, not a sample: no verdict is recorded
            print(f"error: KernelBench's eval does not import from {a.kernelbench}: {pre.get('error')}\n"
                  f"{pre.get('log_tail', '')[-800:]}", file=sys.stderr, flush=True)
            self.meta["theirs_import_error"] = pre.get("error")
            return
        self.meta["theirs_import"] = {"module": pre.get("module"), "stubbed": pre.get("stubbed")}
        print(f"KernelBench eval: {pre.get('module')} (stubbed imports: {pre.get('stubbed')})", flush=True)
        static = _their_static_checker(a.kernelbench)
        t0 = time.time()
        cpu_env = dict(os.environ, CUDA_VISIBLE_DEVICES="")   # KernelBench precompiles on CPU
        compiled = {}
        with cf.ThreadPoolExecutor(a.jobs) as ex:
            futs = {ex.submit(run_child, self._spec(r, "compile"), a.compile_timeout_s, cpu_env): r["file"]
                    for r in todo}
            for fut in cf.as_completed(futs):
                compiled[futs[fut]] = fut.result()
        self.phase("theirs_compile", t0, len(todo))
        t0 = time.time()

        def one(rec):
            for _ in range(2):  # a second time only after KernelBench's lock-file answer
                t = min(a.timeout_s, self.left_s() - 15)   # the budget may cut an eval short: then it is not run
                if t < 20:
                    return rec, None
                res = run_child(self._spec(rec, "eval"), t)
                if res.get("timed_out") and t < a.timeout_s:
                    return rec, None
                if not res.get("retry"):
                    break
            return rec, res
        with cf.ThreadPoolExecutor(a.eval_jobs) as ex:
            for rec, res in ex.map(one, todo):
                if res is None:
                    continue
                res["precompile"] = compiled.get(rec["file"])
                if static:
                    ok, errs, warns = static(open(os.path.join(a.samples_dir, rec["file"])).read(), backend="cuda",
                                             precision="fp32")
                    res.update(static_ok=ok, static_errors=errs, static_warnings=warns)
                rec["theirs"] = res
                print(f"  theirs {rec['file']}: {'accept' if theirs_accepts(res) else 'refuse'} "
                      f"{res.get('error') or ''} ({res.get('wall_s')} s)", flush=True)
                self.save()
        self.phase("theirs_eval", t0, sum(r["theirs"] is not None for r in todo))

    # ---- ours
    def ours(self) -> None:
        a = self.args
        todo = [r for r in self.records if r["ours"] is None]
        if not todo or self.left_s() < 60:
            return
        import dataclasses

        import kernelbench_eval
        import sandbox
        scfg = dataclasses.replace(kernelbench_eval.EvalConfig().sandbox, device=a.device, rules="kernelbench",
                                   profile=not a.no_profile, seed=0)
        codes = {r["problem_path"]: open(r["problem_path"]).read() for r in todo}
        pool = sandbox.SandboxPool(scfg, gpus=[0] if a.device == "cuda" else None, compile_workers=a.jobs)
        t0, futs = time.time(), {}
        try:
            if scfg.profile and a.prewarm_workers > 0:
                t0 = time.time()
                pool.prewarm(sorted(set(codes.values())), a.prewarm_workers)
                self.phase("ours_prewarm", t0, len(codes))
            t0 = time.time()
            futs = {pool.submit(codes[r["problem_path"]], pathlib.Path(os.path.abspath(a.samples_dir), r["file"])): r
                    for r in todo}   # the sample's path, as kernelbench_eval's samples mode submits it
            for fut in cf.as_completed(futs, timeout=max(self.left_s(), 1) if a.budget_s else None):
                rec = futs[fut]
                try:
                    v = fut.result()
                    v = v.to_dict() if hasattr(v, "to_dict") else dict(v)
                    rec["ours"] = our_record(v, kernelbench_eval.passed(v))
                except Exception as e:  # noqa: BLE001 - a harness crash is recorded, never ends the run
                    rec["ours"] = {"correct": False, "reason": f"harness crash: {type(e).__name__}: {e}"[:300],
                                   "harness_error": True}
                print(f"  ours {rec['file']}: {'accept' if rec['ours']['correct'] else 'refuse'} "
                      f"{rec['ours'].get('reason') or ''}", flush=True)
                self.save()
        except cf.TimeoutError:
            print("budget reached: samples left unjudged by ours", flush=True)
            for f in futs:
                f.cancel()
        finally:
            self.phase("ours_check", t0, sum(r["ours"] is not None for r in todo))
            pool.close()


def _their_static_checker(kernelbench: str):
    """KernelBench's static checker (validate_kernel_static) where the checkout has one: reported beside each
    verdict, not part of it (eval_kernel_against_ref does not call it)."""
    path = os.path.join(kernelbench, "src", "kernelbench", "kernel_static_checker.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("kb_static_checker", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.validate_kernel_static


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernelbench", help="a KernelBench checkout (src/kernelbench/eval.py or src/eval.py, and "
                   "KernelBench/level{N}/)")
    p.add_argument("--samples-dir", help="sample files level_{L}_problem_{P}_sample_{S}_kernel.py (a SOURCES.json "
                   "beside the folder is copied into --out)")
    p.add_argument("--out", default="runs/kb_agreement.json", help="per-sample results and the table (JSON)")
    p.add_argument("--limit", type=int, default=0, help="judge this many samples, spread evenly (0: all)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="parallel compiles (KernelBench's precompile, then the sandbox's compile slots)")
    p.add_argument("--eval-jobs", type=int, default=1,
                   help="KernelBench evals at a time on the GPU (1 as KernelBench on one GPU; more shares the GPU "
                   "and skews their runtimes, not their verdicts)")
    p.add_argument("--side", choices=("both", "theirs", "ours"), default="both")
    p.add_argument("--overlap", action="store_true",
                   help="run the two sides at once (their builds and evals beside our pool): about half the wall "
                   "time; verdicts are unaffected, timings on both sides are skewed by the shared GPU and cores")
    p.add_argument("--timeout-s", type=float, default=180, help="per KernelBench eval (eval_from_generations' 180 s)")
    p.add_argument("--compile-timeout-s", type=float, default=600, help="per KernelBench precompile")
    p.add_argument("--num-correct-trials", type=int, default=5, help="KernelBench's script default")
    p.add_argument("--num-perf-trials", type=int, default=100, help="KernelBench's script default")
    p.add_argument("--no-measure-performance", dest="measure_performance", action="store_false",
                   help="KernelBench: correctness only (no runtime, no excessive-speedup flag)")
    p.add_argument("--gpu-arch", default="Hopper", help="TORCH_CUDA_ARCH_LIST for KernelBench's builds (its names: "
                   "Ampere, Ada, Hopper, ...)")
    p.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "kb_agree_build"),
                   help="KernelBench's build dirs, one per sample (kept: a rerun finds the builds)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="ours: where the sandbox runs samples (cpu: a smoke of this side alone, with --side ours)")
    p.add_argument("--no-profile", action="store_true", help="ours: correctness only (no timing, no speedup)")
    p.add_argument("--prewarm-workers", type=int, default=8, help="ours: torch.compile baselines compiled at a time")
    p.add_argument("--budget-s", type=float, default=0,
                   help="start no new eval after this many seconds; the table of what finished is still written")
    p.add_argument("--no-resume", dest="resume", action="store_false", help="ignore results already in --out")
    p.add_argument("--dry-run", action="store_true", help="map samples to problems and print the plan; no eval")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child and not (args.kernelbench and args.samples_dir):
        p.error("--kernelbench and --samples-dir are required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        with open(args.child) as f:
            spec = json.load(f)
        res = child_main(spec)
        with open(spec["result"], "w") as f:
            json.dump(res, f, default=str)
        return 0
    jobs, orphans = sample_jobs(args.kernelbench, args.samples_dir, args.limit)
    levels = sorted({j["level"] for j in jobs})
    print(f"kb_agreement: {len(jobs)} samples (levels {levels}, {len({(j['level'], j['problem_id']) for j in jobs})} "
          f"problems) from {args.samples_dir}; KernelBench {args.kernelbench}")
    if orphans:
        print(f"warning: {len(orphans)} samples have no problem in the checkout: {orphans[:10]}", file=sys.stderr)
    if args.dry_run:
        for j in jobs:
            print(f"  {j['file']} -> {os.path.relpath(j['problem_path'])}")
        return 1 if orphans else 0
    run = Run(args, jobs, orphans)
    if args.side == "both" and args.overlap:
        with cf.ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(run.theirs), ex.submit(run.ours)]:
                f.result()
    else:
        if args.side in ("both", "theirs"):
            run.theirs()
        if args.side in ("both", "ours"):
            run.ours()
    table = run.save()
    print(markdown(table))
    print(f"wrote {args.out} ({time.time() - run.t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
