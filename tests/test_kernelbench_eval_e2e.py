"""kernelbench_eval end to end through the REAL sandbox (sandbox.SandboxPool -> sandbox.check), on CPU.

The fixture tree (tests/fixtures/kernelbench) holds five tiny problems in KernelBench's layout, written for
these tests; its samples/ folder mixes honest single-file solutions (C++ kernels built with g++ at import and
called through ctypes) with hacked ones: a torch fallback, wrong math, a cached output, and a constant output
on a degenerate problem (correct, so it must be flagged). samples_rules/ holds two samples for the rule profiles:
one honest the way published KernelBench samples are (output from zeros_like, an unused get_inputs with
torch.randn), one that computes with torch in a helper its forward calls.
"""
import json
import os

import pytest

import env
import kernelbench_eval as kb
import sandbox
import sandbox.harness.rules
from policy import PolicyConfig

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kernelbench")


def cfg_for(tmp_path, profile=True, n_trials=5, max_turns=None, **kw):
    sb = sandbox.SandboxConfig(device="cpu", cache_dir=str(tmp_path / "cache"), mem_limit_mb=65536, profile=profile,
                               n_trials=n_trials)
    base = dict(kernelbench_dir=FIX, level=[1, 2], samples_dir=os.path.join(FIX, "samples"), out=str(tmp_path / "out"),
                sandbox=sb)
    if max_turns is not None:
        base["env"] = env.EnvConfig(max_turns=max_turns)
    return kb.EvalConfig(**{**base, **kw})


@pytest.mark.slow
def test_samples_mode_real_sandbox_then_resume(tmp_path, monkeypatch):
    """Correctness only (--no-profile keeps it fast): which samples pass is decided by the real checks."""
    cfg = cfg_for(tmp_path, profile=False)
    assert kb.main(cfg) == 0
    recs = kb.read_results(str(tmp_path / "out" / "results.jsonl"))
    got = {k: r["correct"] for k, r in recs.items()}
    assert got == {(1, 1): True, (1, 2): True, (1, 3): False, (2, 1): True, (2, 80): True}, \
        {k: [(os.path.basename(c["source"]), c["why"]) for c in r["candidates"]] for k, r in recs.items()}
    why = {os.path.basename(c["source"]): c["why"] or "" for r in recs.values() for c in r["candidates"]}
    assert "torch.relu" in why["level_1_problem_1_sample_1_kernel.py"]            # torch fallback: violation
    assert "incorrect" in why["level_1_problem_2_sample_1_kernel.py"]             # wrong math
    assert "incorrect" in why["level_1_problem_3_sample_0_kernel.py"]             # cached output
    assert recs[(1, 1)]["source"].endswith("sample_0_kernel.py")                  # best = the honest one
    assert all(r["verdict"]["precision"] == "fp32" and r["device"] == "cpu" for r in recs.values())
    s = json.load(open(tmp_path / "out" / "summary.json"))
    assert (s["n"], s["pass_rate"], s["per_level"][0]["pass_rate"]) == (5, 0.8, pytest.approx(2 / 3))
    assert s["faster_eager"] is None and s["geomean_compile"] is None             # untimed, not 0
    assert s["flagged"][0]["problem_id"] == 80 and s["excluding_flagged"][0]["pass_rate"] == 0.75
    # resume: everything is in results.jsonl, so no pool is even built
    monkeypatch.setattr(kb, "make_pool", lambda *a: pytest.fail("resume must not rescore finished problems"))
    assert kb.main(cfg) == 0


@pytest.mark.slow
def test_profiled_problem_real_sandbox(tmp_path):
    """One problem with timings: speedups come from the sandbox's baselines, and agree with its times."""
    assert kb.main(cfg_for(tmp_path, level=[1], problems=[2], n_trials=2)) == 0
    r = kb.read_results(str(tmp_path / "out" / "results.jsonl"))[(1, 2)]
    v = r["verdict"]
    assert r["correct"] and v["eager_ms"] > 0 and v["compile_ms"] > 0 and v["candidate_ms"] > 0
    assert r["speedup_eager"] == pytest.approx(v["eager_ms"] / v["candidate_ms"], rel=1e-6)
    assert r["speedup_compile"] == pytest.approx(v["compile_ms"] / v["candidate_ms"], rel=1e-6)
    s = json.load(open(tmp_path / "out" / "summary.json"))
    assert s["geomean_compile"] == pytest.approx(r["speedup_compile"])
    assert s["faster_compile"] == (1.0 if r["speedup_compile"] > 1 else 0.0)


@pytest.mark.slow
def test_samples_are_judged_by_kernelbench_rules(tmp_path):
    """Samples mode's default profile is KernelBench's: an honest sample passes although it allocates its output
    with zeros_like, casts without converting, and carries a get_inputs with torch.randn and a torch helper it
    never calls; torch compute in a helper that forward calls is refused. Every record names the profile."""
    rules_dir = os.path.join(FIX, "samples_rules")
    sb = sandbox.SandboxConfig(device="cpu", cache_dir=str(tmp_path / "cache"), mem_limit_mb=65536, profile=False,
                               n_trials=2, rules="auto")
    assert kb.main(cfg_for(tmp_path, level=[1], problems=[1], samples_dir=rules_dir, sandbox=sb)) == 0
    r = kb.read_results(str(tmp_path / "out" / "results.jsonl"))[(1, 1)]
    why = {os.path.basename(c["source"]): (c["why"] or "", c["rules"]) for c in r["candidates"]}
    assert r["correct"] and r["source"].endswith("sample_0_kernel.py") and r["rules"] == "kernelbench", why
    assert why["level_1_problem_1_sample_1_kernel.py"] == (
        "static scan: torch compute torch.clamp in _finish (line 32)", "kernelbench")
    assert json.load(open(tmp_path / "out" / "summary.json"))["rules"] == "kernelbench"
    # the paper's profile reads the honest sample's no-op cast as compute: the profile decides that verdict
    honest = open(os.path.join(rules_dir, "level_1_problem_1_sample_0_kernel.py")).read()
    assert ".float()" in sandbox.harness.rules.static_scan(honest, (), "cuda-agent")


@pytest.mark.slow
def test_load_inline_sample(tmp_path):
    """KernelBench's usual single-file form (load_inline) is scored too (~1 min C++ build with torch headers)."""
    cfg = cfg_for(tmp_path, level=[1], problems=[1], profile=False,
                  samples_dir=os.path.join(FIX, "samples_load_inline"))
    assert kb.main(cfg) == 0
    r = kb.read_results(str(tmp_path / "out" / "results.jsonl"))[(1, 1)]
    assert r["correct"], r["verdict"]["error"]


# agent mode: a scripted policy (the same script on every problem) writes a ReLU workspace and verifies it
KERNEL = '''extern "C" void relu_forward(const float* x, float* y, long n, void* stream) {
#pragma omp parallel for
    for (long i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
'''
MODEL_NEW = '''import ctypes

import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("relu")
lib.relu_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.relu_forward.restype = None


class ModelNew(nn.Module):
    def __init__(self, *args):
        super().__init__()

    def forward(self, x):
        y = torch.empty_like(x)
        lib.relu_forward(ptr(x), ptr(y), x.numel(), stream())
        return y
'''


@pytest.mark.slow
def test_agent_mode_replay_policy_real_env(tmp_path):
    script = [{"content": "write the kernel", "tool_calls": [
                  {"function": {"name": "write_file", "arguments": {"path": "kernels/relu.cpp", "content": KERNEL}}},
                  {"function": {"name": "write_file", "arguments": {"path": "model_new.py", "content": MODEL_NEW}}},
                  {"function": {"name": "verify", "arguments": {}}}]},
              {"content": "done", "tool_calls": [{"function": {"name": "finish", "arguments": {}}}]}]
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    cfg = cfg_for(tmp_path, samples_dir=None, level=[1], problems=[1, 3],
                  policy=PolicyConfig(kind="replay", script=str(path)), profile=False, max_turns=5)
    assert kb.main(cfg) == 0
    recs = kb.read_results(str(tmp_path / "out" / "results.jsonl"))
    assert recs[(1, 1)]["correct"] is True                      # ReLU solves the ReLU problem ...
    assert recs[(1, 3)]["correct"] is False                     # ... and not the row-sum problem
    assert recs[(1, 1)]["n_candidates"] == 1 and "stop=finish" in recs[(1, 1)]["source"]
    assert os.path.isfile(tmp_path / "out" / "best" / "level_1_problem_1" / "kernels" / "relu.cpp")
    trajs = [json.loads(line) for line in open(tmp_path / "out" / "trajectories.jsonl")]
    assert len(trajs) == 2 and all(t["stop_reason"] == "finish" for t in trajs)
