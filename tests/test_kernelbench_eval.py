"""kernelbench_eval: problem loading, metrics against hand computation, resume, crash handling, outputs.

These tests fix the sandbox's verdicts (a fake pool standing in for `sandbox.SandboxPool`, scoring nothing) so
every summary number can be checked against arithmetic done by hand. The end-to-end run through the real
sandbox is in tests/test_kernelbench_eval_e2e.py.
"""
import concurrent.futures as cf
import dataclasses
import json
import math
import os
import pathlib
import shutil
import sys
import types

import pytest

import env
import kernelbench_eval as kb
import sandbox
from policy import PolicyConfig
from tasks import Task

CPU = sandbox.SandboxConfig(device="cpu")

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kernelbench")


def V(correct=True, t=None, eager=None, compile_=None, violation=None, error=None, precision="tf32"):
    """A sandbox verdict dict (contract keys) with the given times in ms."""
    return {"compiled": True, "correct": correct, "violation": violation, "error": error,
            "eager_ms": eager, "compile_ms": compile_, "candidate_ms": t,
            "speedup_eager": eager / t if (t and eager) else None,
            "speedup_compile": compile_ / t if (t and compile_) else None,
            "reward": 0.0, "stage": "done", "precision": precision, "device": "FakeGPU",
            "compile_log": "", "trials": [], "timings": {}}


# Fixed verdicts per sample file. Problems: L1 {1, 2, 3}, L2 {1, 80 (flagged as degenerate)}.
FIXED = {
    "level_1_problem_1_sample_0_kernel.py": V(t=1.0, eager=2.0, compile_=0.5),   # 2.0x eager, 0.5x compile
    "level_1_problem_1_sample_1_kernel.py": V(t=0.8, eager=2.0, compile_=0.5),   # best: 2.5x, 0.625x
    "level_1_problem_2_sample_0_kernel.py": V(correct=False, t=0.1, eager=1.0, compile_=1.0, error="mismatch"),
    "level_1_problem_2_sample_1_kernel.py": V(t=0.1, eager=1.0, compile_=1.0, violation="torch op in forward"),
    "level_1_problem_3_sample_0_kernel.py": V(t=4.0, eager=2.0, compile_=8.0),   # 0.5x eager, 2.0x compile
    "level_2_problem_1_sample_0_kernel.py": V(t=1.0, eager=3.0, compile_=1.5),   # 3.0x, 1.5x
    "level_2_problem_80_sample_0_kernel.py": V(t=0.5, eager=1.0, compile_=1.0),  # 2.0x, 2.0x
}


class FakePool:
    """Stands in for sandbox.SandboxPool: returns the fixed verdict of each sample file; counts submits."""

    def __init__(self, fixed, crash=()):
        self.fixed, self.crash, self.submitted, self.closed = fixed, set(crash), [], False

    def prewarm(self, tasks, workers, on_done=None):  # the real one compiles baselines; nothing to do here
        self.prewarmed = len(tasks)
        return {}

    def submit(self, task, solution, cfg=None):
        assert isinstance(task, str) and "class Model" in task, "the task source is passed, not a path"
        assert isinstance(solution, pathlib.Path), "the sample file is passed as a path, not as source"
        name = os.path.basename(solution)
        self.submitted.append(name)
        f = cf.Future()
        if name in self.crash:
            f.set_exception(RuntimeError("worker died"))
        else:
            f.set_result(dict(self.fixed[name]))
        return f

    def close(self):
        self.closed = True


def samples_dir(tmp_path, names):
    d = tmp_path / "samples"
    d.mkdir(exist_ok=True)
    for n in names:
        (d / n).write_text("# placeholder: the fake pool never reads it\n")
    return str(d)


def run(tmp_path, monkeypatch, pool, **kw):
    monkeypatch.setattr(kb, "make_pool", lambda cfg, scfg: pool)
    monkeypatch.setattr(kb, "sandbox_config", lambda cfg: None)
    cfg = kb.EvalConfig(kernelbench_dir=FIX, level=[1, 2], sandbox=CPU, out=str(tmp_path / "out"),
                        samples_dir=samples_dir(tmp_path, FIXED), **kw)
    assert kb.main(cfg) == 0
    with open(tmp_path / "out" / "summary.json") as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def test_load_local_layout_and_filters():
    ps = kb.load_problems(kb.EvalConfig(kernelbench_dir=FIX, level=[1, 2]))
    assert [(p.level, p.problem_id) for p in ps] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 80)]
    assert ps[0].name == "Tiny_ReLU" and "class Model" in ps[0].code and ps[0].path.endswith("1_Tiny_ReLU.py")
    # the KernelBench folder itself works as --kernelbench-dir too
    ps2 = kb.load_problems(kb.EvalConfig(kernelbench_dir=os.path.join(FIX, "KernelBench"), level=[1],
                                         problems=[1, 3]))
    assert [p.problem_id for p in ps2] == [1, 3]
    # representative subset: KernelBench's level-1 list holds 1 and 3 but not 2
    rep = kb.load_problems(kb.EvalConfig(kernelbench_dir=FIX, level=[1], subset="representative"))
    assert [p.problem_id for p in rep] == [1, 3]
    assert kb.REPRESENTATIVE[1][:3] == [1, 3, 6] and len(kb.REPRESENTATIVE[2]) == 8


def _rows():
    """Rows in the HF dataset's schema (code, level, name, problem_id), built from the fixture tree."""
    rows = []
    for p in kb.load_problems(kb.EvalConfig(kernelbench_dir=FIX, level=[1, 2])):
        # KernelBench's make_hf_dataset.py: name = file name without ".py" ("19_ReLU")
        rows.append({"code": p.code, "level": p.level, "name": f"{p.problem_id}_{p.name}",
                     "problem_id": p.problem_id})
    return rows


def test_hf_schema_from_local_jsonl(tmp_path):
    path = tmp_path / "kernelbench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    local = kb.load_problems(kb.EvalConfig(kernelbench_dir=FIX, level=[1, 2]))
    hf = kb.load_problems(kb.EvalConfig(hf_dataset=str(path), level=[1, 2]))
    assert [(p.level, p.problem_id, p.name, p.code) for p in hf] == \
           [(p.level, p.problem_id, p.name, p.code) for p in local]
    assert [p.problem_id for p in kb.load_problems(kb.EvalConfig(hf_dataset=str(path), level=[2]))] == [1, 80]


def test_hf_hub_path_calls_datasets_with_split(monkeypatch):
    """The hub branch: datasets.load_dataset(name, split="level_N") (a stand-in module records the call)."""
    calls = []
    fake = types.ModuleType("datasets")
    fake.DatasetDict = dict
    fake.load_dataset = lambda name, split: calls.append((name, split)) or [r for r in _rows() if r["level"] == 2]
    fake.load_from_disk = lambda path: pytest.fail("not a folder")
    monkeypatch.setitem(sys.modules, "datasets", fake)
    ps = kb.load_problems(kb.EvalConfig(level=[2], problems=[80], hf_dataset="ScalingIntelligence/KernelBench"))
    assert calls == [("ScalingIntelligence/KernelBench", "level_2")]
    assert [(p.level, p.problem_id, p.name) for p in ps] == [(2, 80, "Tiny_Max_Subtract")]


def test_hf_save_to_disk_real_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _rows()
    dd = datasets.DatasetDict({f"level_{L}": datasets.Dataset.from_list([r for r in rows if r["level"] == L])
                               for L in (1, 2)})
    dd.save_to_disk(str(tmp_path / "kb"))
    ps = kb.load_problems(kb.EvalConfig(hf_dataset=str(tmp_path / "kb"), level=[1, 2]))
    assert [(p.level, p.problem_id) for p in ps] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 80)]


def test_samples_naming(tmp_path):
    d = samples_dir(tmp_path, ["level_1_problem_5_sample_1_kernel.py", "level_1_problem_5_sample_0_kernel.py",
                               "level_2_problem_5_sample_0_kernel.py", "level_1_problem_5_sample_0.py", "x.py"])
    found = kb.find_samples(d)
    assert sorted(found) == [(1, 5), (2, 5)]
    assert [s for s, _ in found[(1, 5)]] == [0, 1]


# --------------------------------------------------------------------------------------------------
# metrics: every number against a hand computation
# --------------------------------------------------------------------------------------------------


def test_summary_matches_hand_computation(tmp_path, monkeypatch):
    pool = FakePool(FIXED)
    s = run(tmp_path, monkeypatch, pool)
    assert pool.closed and sorted(pool.submitted) == sorted(FIXED)
    # best per problem: L1P1 sample 1 (2.5x eager, 0.625x compile); L1P2 fails (wrong output / violation);
    # L1P3 0.5x / 2.0x; L2P1 3.0x / 1.5x; L2P80 2.0x / 2.0x.
    L1, L2 = s["per_level"]
    assert (L1["level"], L1["n"], L2["level"], L2["n"], s["level"], s["n"]) == (1, 3, 2, 2, "overall", 5)
    approx = lambda x: pytest.approx(x, rel=1e-12)  # noqa: E731
    # level 1
    assert L1["pass_rate"] == approx(2 / 3)
    assert L1["faster_eager"] == approx(1 / 3)           # only P1 (2.5x)
    assert L1["faster_compile"] == approx(1 / 3)         # only P3 (2.0x)
    assert L1["geomean_eager"] == approx(math.sqrt(2.5 * 0.5))
    assert L1["geomean_compile"] == approx(math.sqrt(0.625 * 2.0))
    assert L1["fast_p"] == {"0": approx(2 / 3), "1": approx(1 / 3), "1.5": approx(1 / 3), "2": approx(1 / 3)}
    # level 2
    assert (L2["pass_rate"], L2["faster_eager"], L2["faster_compile"]) == (1.0, 1.0, 1.0)
    assert L2["geomean_eager"] == approx(math.sqrt(3.0 * 2.0))
    assert L2["geomean_compile"] == approx(math.sqrt(1.5 * 2.0))
    assert L2["fast_p"] == {"0": 1.0, "1": 1.0, "1.5": 1.0, "2": 0.5}   # 2.0x is not > 2
    # overall: pooled over the 5 problems (weighted by problem count, not the mean of the level rows)
    assert s["pass_rate"] == approx(4 / 5)
    assert s["faster_eager"] == approx(3 / 5) and s["faster_compile"] == approx(3 / 5)
    assert s["geomean_eager"] == approx((2.5 * 0.5 * 3.0 * 2.0) ** 0.25)
    assert s["geomean_compile"] == approx((0.625 * 2.0 * 1.5 * 2.0) ** 0.25)
    assert s["fast_p"] == {"0": approx(4 / 5), "1": approx(3 / 5), "1.5": approx(3 / 5), "2": approx(2 / 5)}
    assert s["fast_p_compile"]["1"] == approx(3 / 5)      # 2.0, 1.5, 2.0 > 1; 0.625 not
    assert (s["device"], s["precision"]) == ("FakeGPU", "tf32")
    # flagged: L2 80 scored above, and every metric again without it
    assert s["flagged"] == [{"level": 2, "problem_id": 80, "reason": kb.DEGENERATE[(2, 80)]}]
    ex = s["excluding_flagged"][0]
    assert (ex["n"], ex["pass_rate"], ex["faster_compile"]) == (4, approx(3 / 4), approx(2 / 4))
    assert ex["geomean_compile"] == approx((0.625 * 2.0 * 1.5) ** (1 / 3))
    for k in ("level", "n", "pass_rate", "faster_eager", "faster_compile", "geomean_eager", "geomean_compile",
              "fast_p", "device", "precision"):
        assert k in s and all(k in row for row in s["per_level"])


def test_records_outputs_and_tiers(tmp_path, monkeypatch):
    run(tmp_path, monkeypatch, FakePool(FIXED))
    out = tmp_path / "out"
    recs = [json.loads(line) for line in open(out / "results.jsonl")]
    assert len(recs) == 5
    by = {(r["level"], r["problem_id"]): r for r in recs}
    assert by[(1, 1)]["source"].endswith("level_1_problem_1_sample_1_kernel.py") and by[(1, 1)]["n_candidates"] == 2
    assert by[(1, 1)]["tier"] == 2.0         # Eq. 1: 0.8 < 0.95 * 2.0 (eager) but not < 0.95 * 0.5 (compile)
    assert by[(2, 1)]["tier"] == 3.0 and by[(1, 2)]["tier"] == -1.0
    assert by[(1, 2)]["correct"] is False and by[(1, 2)]["speedup_eager"] is None
    assert all(r["verdict"]["precision"] == "tf32" for r in recs)
    report = (out / "report.md").read_text()
    assert "| overall | 5 | 80.0% | 60.0% | 60.0% |" in report and "Flagged" in report
    assert (out / "speedup_distribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_flag_degenerate(tmp_path, monkeypatch):
    s = run(tmp_path, monkeypatch, FakePool(FIXED), flag_degenerate=False)
    assert s["flagged"] == [] and s["excluding_flagged"][0]["n"] == 5
    assert "Flagged" not in (tmp_path / "out" / "report.md").read_text()


def test_best_verdict_prefers_correct_then_fastest():
    vs = [V(t=0.5, correct=False), V(t=2.0, eager=1.0), V(t=1.0, eager=1.0), V(t=0.1, violation="x")]
    assert kb.best_verdict(vs) == 2
    assert kb.best_verdict([V(correct=False), V(correct=False)]) == 0


# --------------------------------------------------------------------------------------------------
# long runs: resume, crashes
# --------------------------------------------------------------------------------------------------


def test_resume_skips_finished_problems(tmp_path, monkeypatch):
    run(tmp_path, monkeypatch, FakePool(FIXED))
    pool2 = FakePool(FIXED)
    s = run(tmp_path, monkeypatch, pool2)
    assert pool2.submitted == [] and s["n"] == 5 and s["pass_rate"] == pytest.approx(0.8)
    # drop L1P3 from results.jsonl: only its sample is scored again
    path = tmp_path / "out" / "results.jsonl"
    keep = [line for line in open(path) if json.loads(line)["problem_id"] != 3]
    path.write_text("".join(keep) + '{"torn line')
    pool3 = FakePool(FIXED)
    monkeypatch.setattr(kb, "compact_results", lambda *a: pytest.fail("killed"))  # die before the compaction
    with pytest.raises(pytest.fail.Exception):
        run(tmp_path, monkeypatch, pool3)
    assert pool3.submitted == ["level_1_problem_3_sample_0_kernel.py"]
    assert (1, 3) in kb.read_results(str(path))          # the record appended after the torn line is readable
    monkeypatch.undo()
    pool4 = FakePool(FIXED)
    run(tmp_path, monkeypatch, pool4, resume=False)
    assert sorted(pool4.submitted) == sorted(FIXED)


@pytest.mark.slow
def test_crash_on_one_problem_never_ends_the_run(tmp_path, monkeypatch):
    pool = FakePool(FIXED, crash={"level_1_problem_3_sample_0_kernel.py"})
    s = run(tmp_path, monkeypatch, pool)
    assert s["n"] == 5 and s["harness_errors"] == 1 and s["pass_rate"] == pytest.approx(3 / 5)
    recs = kb.read_results(str(tmp_path / "out" / "results.jsonl"))
    assert "worker died" in recs[(1, 3)]["harness_error"]
    # a crash on one sample while another sample passes: the problem is scored, no harness error
    fixed = dict(FIXED)
    pool2 = FakePool(fixed, crash={"level_1_problem_1_sample_0_kernel.py"})
    shutil.rmtree(tmp_path / "out")
    run(tmp_path, monkeypatch, pool2)
    recs = kb.read_results(str(tmp_path / "out" / "results.jsonl"))
    assert recs[(1, 1)]["correct"] and recs[(1, 1)]["harness_error"] is None
    # two samples, one wrong and one crashed: nothing passed, so the crash marks the problem for a retry
    shutil.rmtree(tmp_path / "out")
    run(tmp_path, monkeypatch, FakePool(FIXED, crash={"level_1_problem_2_sample_1_kernel.py"}))
    recs = kb.read_results(str(tmp_path / "out" / "results.jsonl"))
    assert recs[(1, 2)]["correct"] is False and "worker died" in recs[(1, 2)]["harness_error"]
    # resume retries the harness crash (not the candidate failures)
    shutil.rmtree(tmp_path / "out")
    run(tmp_path, monkeypatch, FakePool(FIXED, crash={"level_1_problem_3_sample_0_kernel.py"}))
    pool3 = FakePool(FIXED)
    s = run(tmp_path, monkeypatch, pool3)
    assert pool3.submitted == ["level_1_problem_3_sample_0_kernel.py"] and s["harness_errors"] == 0
    lines = [json.loads(x) for x in open(tmp_path / "out" / "results.jsonl")]   # compacted: one per problem
    assert [(r["level"], r["problem_id"]) for r in lines] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 80)]


def test_missing_sample_is_a_failure_not_a_crash(tmp_path, monkeypatch):
    fixed = {k: v for k, v in FIXED.items() if "problem_80" not in k}
    monkeypatch.setattr(kb, "make_pool", lambda cfg, scfg: FakePool(fixed))
    monkeypatch.setattr(kb, "sandbox_config", lambda cfg: None)
    cfg = kb.EvalConfig(kernelbench_dir=FIX, level=[2], sandbox=CPU, out=str(tmp_path / "o"),
                        samples_dir=samples_dir(tmp_path, fixed))
    assert kb.main(cfg) == 0
    rec = kb.read_results(str(tmp_path / "o" / "results.jsonl"))[(2, 80)]
    assert rec["correct"] is False and "no sample" in rec["verdict"]["error"]


def test_cli_flags():
    tyro = pytest.importorskip("tyro")
    c = tyro.cli(kb.EvalConfig, args=["--level", "2", "--problems", "1", "5", "9", "--subset", "representative",
                                      "--no-flag-degenerate", "--gpus", "0", "1", "--samples-dir", "s"])
    assert (c.level, c.problems, c.subset, c.flag_degenerate, c.gpus, c.samples_dir, c.env.max_turns) == \
           ([2], [1, 5, 9], "representative", False, [0, 1], "s", env.sized_env(max_turns_gpu=200).max_turns)


def test_untimed_and_mixed_precision_metrics():
    """--no-profile: speed metrics are None (unknown), not 0; mixed precisions are reported, not hidden."""
    p = Task(code="class Model: pass", name="x", level=1, problem_id=1)
    recs = [kb.make_record(p, V(t=None, precision="fp32"), "", 1, True),
            kb.make_record(p, V(correct=False, precision="tf32"), "", 1, True)]
    m = kb.metrics(recs, 1)
    assert (m["pass_rate"], m["faster_eager"], m["faster_compile"], m["geomean_eager"]) == (0.5, None, None, None)
    assert m["fast_p"] == {"0": 0.5, "1": None, "1.5": None, "2": None}
    assert m["precision"] == "fp32,tf32"
    assert kb.metrics([], 1)["pass_rate"] is None


def test_agent_batch_crash_is_recorded_and_retried(tmp_path, monkeypatch):
    """A crash of env.run_episodes on one batch records harness errors for that batch and goes on."""
    import env
    calls = []

    def fake_run_episodes(policy, tasks, pool, cfg, id_offset=0):
        calls.append([t.name for t in tasks])
        raise RuntimeError("policy server went away")
    monkeypatch.setattr(env, "run_episodes", fake_run_episodes)
    monkeypatch.setattr(kb, "_policy", lambda cfg: object())
    monkeypatch.setattr(kb, "make_pool", lambda cfg, scfg: FakePool(FIXED))
    monkeypatch.setattr(kb, "sandbox_config", lambda cfg: None)
    script = tmp_path / "script.json"
    script.write_text("[]")
    cfg = kb.EvalConfig(kernelbench_dir=FIX, level=[1], sandbox=CPU, out=str(tmp_path / "o"), batch=2,
                        policy=PolicyConfig(script=str(script)))
    assert kb.main(cfg) == 0
    assert len(calls) == 2 and calls[0][0].startswith("level_1_problem_1_")      # batches of 2, then 1
    s = json.load(open(tmp_path / "o" / "summary.json"))
    assert s["n"] == 3 and s["harness_errors"] == 3 and s["pass_rate"] == 0.0
    assert kb.main(cfg) == 0 and len(calls) == 4                                  # retried on resume


def test_samples_only_keeps_problems_with_samples(tmp_path, monkeypatch):
    fixed = {k: v for k, v in FIXED.items() if k.startswith("level_1_problem_1_")}
    monkeypatch.setattr(kb, "make_pool", lambda cfg, scfg: FakePool(fixed))
    monkeypatch.setattr(kb, "sandbox_config", lambda cfg: None)
    cfg = kb.EvalConfig(kernelbench_dir=FIX, level=[1, 2], sandbox=CPU, out=str(tmp_path / "o"),
                        samples_dir=samples_dir(tmp_path, fixed), samples_only=True)
    assert kb.main(cfg) == 0
    s = json.load(open(tmp_path / "o" / "summary.json"))
    assert s["n"] == 1 and s["pass_rate"] == 1.0 and [r["level"] for r in s["per_level"]] == [1]


def test_baseline_bench_ratios_and_outliers(tmp_path):
    """scripts/bench_kernelbench_baselines.py: like-with-like precision, ratios and outlier causes (synthetic
    timings in the published H100 files' schema)."""
    sys.path.insert(0, os.path.join(os.path.dirname(FIX), "..", "..", "scripts"))
    import bench_kernelbench_baselines as bb
    h = {"level1": {"1_Mm.py": {"mean": 2.0}, "2_Mm2.py": {"mean": 2.0}, "12_Diag.py": {"mean": 1.0},
                    "3_Mm3.py": {"mean": 1.0}, "4_Mm4.py": {"mean": 1.0},
                    "54_conv3d.py": {"mean": 4.0}, "19_Relu.py": {"mean": 0.02}}}
    names = {1: "Mm", 2: "Mm2", 3: "Mm3", 4: "Mm4", 12: "Diag", 54: "conv3d", 19: "Relu"}
    fp32 = {1: 1.6, 2: 1.7, 3: 0.8, 4: 0.85, 12: 3.0, 54: 12.0, 19: 0.05}   # ours, ms; conv 3x slower w/o TF32
    tf32 = {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5, 12: 1.0, 54: 3.2, 19: 0.05}

    def rows_for(precs):
        t = {"fp32": fp32, "tf32": tf32}
        return [bb.make_row(Task(code="class Model: pass", name=names[i], level=1, problem_id=i),
                            {p: {"eager_ms": t[p][i], "compile_ms": t[p][i]} for p in precs}, h, h) for i in names]
    rows = rows_for(["fp32", "tf32"])
    assert [r["like_with_like"] for r in rows] == ["fp32"] * 5 + ["tf32", "fp32"]   # conv -> tf32
    assert [r["ratio_eager"] for r in rows] == pytest.approx([0.8, 0.85, 0.8, 0.85, 3.0, 0.8, 2.5])
    bb.flag_outliers(rows, factor=1.5)                                                # median ratio 0.85
    out = {r["problem_id"]: r.get("outliers") for r in rows}
    assert all(out[i] is None for i in (1, 2, 3, 4, 54))
    assert out[12][0].startswith("eager: 3.00x vs median 0.85x") and "edited after" in out[12][0]
    assert "sub-0.05 ms" in out[19][0]
    rows = rows_for(["fp32"])                                   # fp32 only: the conv becomes an explained outlier
    bb.flag_outliers(rows, factor=1.5)
    assert "without cuDNN TF32" in rows[5]["outliers"][0]
    md = bb.markdown(rows_for(["fp32", "tf32"]), ["fp32", "tf32"], "FakeGPU")
    assert "| L1 54 conv3d | tf32 |" in md and "Geomean ratio" in md


def test_rules_follow_the_mode_and_every_record_names_them(tmp_path, monkeypatch):
    """Samples are judged by KernelBench's rules unless --sandbox.rules says otherwise, agent mode by the paper's;
    the profile reaches the pool's config, each record and candidate line, the summary and the run's key."""
    tyro = pytest.importorskip("tyro")
    auto = tyro.cli(kb.EvalConfig, args=["--samples-dir", "s"]).sandbox
    assert auto.rules == "auto" and tyro.cli(kb.EvalConfig, args=["--sandbox.rules", "cuda-agent"]).sandbox.rules == \
        "cuda-agent"
    script = tmp_path / "script.json"
    script.write_text("[]")
    auto = sandbox.SandboxConfig(device="cpu", rules="auto")
    agent = kb.prepare(kb.EvalConfig(kernelbench_dir=FIX, sandbox=auto, policy=PolicyConfig(script=str(script))))
    assert agent.sandbox.rules == "cuda-agent"
    with pytest.raises(env.UsageError, match="--sandbox.rules 'strict'"):
        kb.prepare(kb.EvalConfig(kernelbench_dir=FIX, sandbox=sandbox.SandboxConfig(device="cpu", rules="strict"),
                                 samples_dir=str(tmp_path)))

    class RulesPool(FakePool):  # a verdict says the profile it was judged by, as sandbox.check's do
        def submit(self, task, solution, cfg=None):
            f = super().submit(task, solution, cfg)
            f.result()["timings"] = {"rules": cfg.rules}
            return f
    monkeypatch.setattr(kb, "make_pool", lambda cfg, scfg: RulesPool(FIXED))
    cfg = kb.EvalConfig(kernelbench_dir=FIX, level=[1, 2], sandbox=auto, out=str(tmp_path / "o"),
                        samples_dir=samples_dir(tmp_path, FIXED))
    assert kb.main(cfg) == 0
    recs = kb.read_results(str(tmp_path / "o" / "results.jsonl"))
    assert {r["rules"] for r in recs.values()} == {"kernelbench"}
    assert {c["rules"] for r in recs.values() for c in r["candidates"]} == {"kernelbench"}
    s = json.load(open(tmp_path / "o" / "summary.json"))
    assert s["rules"] == "kernelbench" and {m["rules"] for m in s["per_level"]} == {"kernelbench"}
    assert json.load(open(tmp_path / "o" / "config.json"))["run"]["rules"] == "kernelbench"
    assert "Rules: `kernelbench`" in open(tmp_path / "o" / "report.md").read()
    # the same results judged by the other profile are another run: never mixed on resume
    other = dataclasses.replace(cfg, sandbox=dataclasses.replace(auto, rules="cuda-agent"))
    assert kb.main(other) == 2
