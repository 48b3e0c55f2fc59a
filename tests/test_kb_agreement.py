"""scripts/kb_agreement.py on CPU: the sample -> problem mapping (tasks.find_samples over the fixture
checkout), the confusion table and its reasons, the stand-ins for KernelBench's API-client imports, and the
per-sample subprocess (result, refusal, crash, timeout) with a fake KernelBench eval written here; no GPU, no
KernelBench code."""
import importlib.util
import json
import os
import shutil
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "kernelbench")
_spec = importlib.util.spec_from_file_location("kb_agreement", os.path.join(HERE, "..", "scripts", "kb_agreement.py"))
kba = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kba)

FAKE_INIT = "from . import utils\n"
FAKE_UTILS = "from openai import OpenAI\nfrom litellm import completion\nfrom together import Together\n"
FAKE_EVAL = textwrap.dedent('''
    import os, time
    from . import utils

    class KernelExecResult:
        def __init__(self, compiled=False, correctness=False, metadata=None, runtime=-1.0):
            self.compiled, self.correctness, self.metadata, self.runtime = compiled, correctness, metadata or {}, runtime
            self.ref_runtime = -1.0

    def build_compile_cache(custom_model_src, verbose=False, build_dir=None):
        os.makedirs(build_dir, exist_ok=True)
        open(os.path.join(build_dir, "built"), "w").write(custom_model_src)
        return True, "", None

    def eval_kernel_against_ref(original_model_src, custom_model_src, seed_num=42, num_correct_trials=1,
                                num_perf_trials=10, measure_performance=False, build_dir=None, device=None):
        assert os.path.exists(os.path.join(build_dir, "built")) == ("NEEDS_BUILD" in custom_model_src)
        if "SLEEP" in custom_model_src:
            time.sleep(60)
        if "CRASH" in custom_model_src:
            os._exit(3)
        if "RAISE" in custom_model_src:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if "WRONG" in custom_model_src:
            return KernelExecResult(compiled=True, metadata={"correctness_issue": "Output mismatch",
                                    "max_difference": ["0.5"], "correctness_trials": "(0 / 5)"})
        return KernelExecResult(compiled=True, correctness=True, runtime=1.5,
                                metadata={"correctness_trials": f"({num_correct_trials} / {num_correct_trials})"})
''')


def fake_checkout(root):
    pkg = os.path.join(root, "src", "kernelbench")
    os.makedirs(pkg)
    for name, text in (("__init__.py", FAKE_INIT), ("utils.py", FAKE_UTILS), ("eval.py", FAKE_EVAL)):
        with open(os.path.join(pkg, name), "w") as f:
            f.write(text)
    shutil.copytree(os.path.join(FIX, "KernelBench"), os.path.join(root, "KernelBench"))
    return str(root)


# --------------------------------------------------------------------------------------------------
# mapping
# --------------------------------------------------------------------------------------------------

def test_every_fixture_sample_finds_its_problem():
    jobs, orphans = kba.sample_jobs(FIX, os.path.join(FIX, "samples"))
    assert orphans == []
    assert [(j["level"], j["problem_id"], j["sample_id"]) for j in jobs] == [
        (1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1), (1, 3, 0), (2, 1, 0), (2, 80, 0)]
    for j in jobs:
        assert os.path.exists(j["problem_path"])
        assert os.path.basename(j["problem_path"]).startswith(f"{j['problem_id']}_")
        assert f"level{j['level']}" in j["problem_path"]
    assert jobs[0]["problem"] == "Tiny_ReLU"


def test_orphans_and_limit_spread(tmp_path):
    d = tmp_path / "s"
    shutil.copytree(os.path.join(FIX, "samples"), d)
    (d / "level_1_problem_99_sample_0_kernel.py").write_text("x = 1\n")
    (d / "notes.txt").write_text("ignored\n")
    jobs, orphans = kba.sample_jobs(FIX, str(d))
    assert orphans == ["level_1_problem_99_sample_0_kernel.py"] and len(jobs) == 7
    few, _ = kba.sample_jobs(FIX, str(d), limit=3)
    assert len(few) == 3 and {j["level"] for j in few} == {1, 2}   # spread, not the first three
    assert kba.main(["--kernelbench", FIX, "--samples-dir", str(d), "--dry-run"]) == 1  # an orphan fails it


def test_help_and_required_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        kba.parse_args(["--help"])
    assert e.value.code == 0 and "--samples-dir" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        kba.parse_args(["--samples-dir", "x"])


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------

def rec(file, level, theirs, ours):
    return {"file": file, "level": level, "problem_id": 1, "problem": "P", "theirs": theirs, "ours": ours}


def test_table_counts_and_reasons():
    ok_th = {"compiled": True, "correctness": True}
    records = [
        rec("a", 1, ok_th, {"correct": True}),
        rec("b", 1, {"compiled": False, "correctness": False, "error": "compilation_error: x"},
            {"correct": False, "reason": "compile failed"}),
        rec("c", 2, dict(ok_th, static_errors=["uses torch.nn.functional"], excessive_speedup=True),
            {"correct": False, "reason": "torch compute in forward: F.conv2d", "stage": "verify"}),
        rec("d", 2, {"compiled": True, "correctness": False,
                     "error": "correctness_issue: Output mismatch (max_difference ['0.001'])"},
            {"correct": True, "max_abs_err": 1e-3, "precision": "tf32"}),
        rec("e", 2, None, {"correct": True}),
    ]
    t = kba.build_table(records)
    assert t["counts"] == {"both correct": 1, "both refuse": 1, "we refuse, they accept": 1,
                           "they refuse, we accept": 1, "incomplete": 1}
    assert t["per_level"]["1"]["both correct"] == 1 and t["per_level"]["2"]["incomplete"] == 1
    assert t["agreement"] == 0.5
    by = {d["file"]: d for d in t["disagreements"]}
    assert set(by) == {"c", "d"}
    assert "torch compute in forward" in by["c"]["reason"] and "stage verify" in by["c"]["reason"]
    assert "their static checker" in by["c"]["reason"] and "excessive-speedup" in by["c"]["reason"]
    assert "Output mismatch" in by["d"]["reason"] and "max abs err 0.001" in by["d"]["reason"]
    md = kba.markdown(t)
    assert "| all | 1 | 1 | 1 | 1 | 1 |" in md and "| c | L2 1 P | we refuse, they accept |" in md


def test_our_record_takes_the_verdict_fields():
    v = {"compiled": True, "correct": False, "violation": None, "error": "wrong output", "stage": "verify",
         "form": "one file (form a)", "timings": {"rules": "kernelbench"}, "speedup_eager": None,
         "trials": [{"trial": 0, "ok": True, "max_abs_err": 0.001},
                    {"trial": 1, "ok": False, "reason": "mismatch", "variant": "scaled", "max_abs_err": 2.0}]}
    r = kba.our_record(v, passed=False)
    assert r["reason"] == "wrong output" and r["rules"] == "kernelbench" and r["max_abs_err"] == 2.0
    assert r["failed_trial"] == {"trial": 1, "reason": "mismatch", "variant": "scaled"}


# --------------------------------------------------------------------------------------------------
# KernelBench's side: stand-ins and the subprocess
# --------------------------------------------------------------------------------------------------

def test_base_model_stand_in_copies_defaults():
    class R(kba._BaseModel):
        compiled: bool = False
        metadata: dict = {}
        runtime: float = -1.0
    a, b = R(compiled=True), R()
    a.metadata["x"] = 1
    assert b.metadata == {} and a.compiled and not b.compiled
    assert a.model_dump() == {"compiled": True, "metadata": {"x": 1}, "runtime": -1.0}


def test_child_verdicts_crash_and_timeout(tmp_path):
    kb = fake_checkout(tmp_path / "kb")
    ref = os.path.join(kb, "KernelBench", "level1", "1_Tiny_ReLU.py")

    def spec(name, body, mode="eval"):
        path = tmp_path / f"{name}.py"
        path.write_text(body)
        return {"mode": mode, "kernelbench": kb, "sample": str(path), "ref": ref, "gpu_arch": "Hopper",
                "build_dir": str(tmp_path / "build" / name), "num_correct_trials": 5, "num_perf_trials": 10,
                "measure_performance": False}

    built = kba.run_child(spec("nb", "# NEEDS_BUILD", "compile"), 30)
    assert built["ok"] is True and {"openai", "litellm", "together"} <= set(built["stubbed"])
    import concurrent.futures as cf
    cases = {"ok": ("# NEEDS_BUILD", 30), "wrong": ("# WRONG", 30), "raise": ("# RAISE", 30),
             "crash": ("# CRASH", 30), "slow": ("# SLOW SLEEP", 1.5)}
    with cf.ThreadPoolExecutor(len(cases)) as ex:
        futs = {k: ex.submit(kba.run_child, spec("nb" if k == "ok" else k, body), t) for k, (body, t) in cases.items()}
        res = {k: f.result() for k, f in futs.items()}
    assert kba.theirs_accepts(res["ok"]) and res["ok"]["metadata"]["correctness_trials"] == "(5 / 5)"
    assert not kba.theirs_accepts(res["wrong"]) and "max_difference ['0.5']" in res["wrong"]["error"]
    assert res["raise"]["compiled"] is False and res["raise"]["error"].startswith("cuda_error")
    assert not kba.theirs_accepts(res["crash"]) and "exit 3" in res["crash"]["error"]
    assert res["slow"]["timed_out"] and not kba.theirs_accepts(res["slow"])


def test_theirs_phase_writes_and_resumes(tmp_path, monkeypatch):
    kb = fake_checkout(tmp_path / "kb")
    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "level_1_problem_1_sample_0_kernel.py").write_text("# NEEDS_BUILD\n")
    (samples / "level_2_problem_1_sample_0_kernel.py").write_text("# NEEDS_BUILD WRONG\n")
    (tmp_path / "SOURCES.json").write_text(json.dumps([{"file": "x", "repo": "r"}]))
    out = str(tmp_path / "agree.json")
    argv = ["--kernelbench", kb, "--samples-dir", str(samples), "--out", out, "--side", "theirs", "--jobs", "2",
            "--build-dir", str(tmp_path / "build")]
    assert kba.main(argv) == 0
    data = json.load(open(out))
    assert data["sources"] == [{"file": "x", "repo": "r"}]
    got = {s["file"]: kba.theirs_accepts(s["theirs"]) for s in data["samples"]}
    assert got == {"level_1_problem_1_sample_0_kernel.py": True, "level_2_problem_1_sample_0_kernel.py": False}
    assert data["table"]["counts"]["incomplete"] == 2                 # ours not run
    monkeypatch.setattr(kba, "run_child", lambda *a, **k: pytest.fail("resumed samples are not run again"))
    assert kba.main(argv) == 0


def test_a_checkout_without_eval_records_no_verdict(tmp_path, capsys):
    out = str(tmp_path / "agree.json")
    assert kba.main(["--kernelbench", FIX, "--samples-dir", os.path.join(FIX, "samples"), "--out", out,
                     "--side", "theirs", "--limit", "1"]) == 0
    data = json.load(open(out))
    assert "no src/kernelbench/eval.py" in data["theirs_import_error"]
    assert data["samples"][0]["theirs"] is None and data["table"]["counts"]["incomplete"] == 1
    assert "does not import" in capsys.readouterr().err
