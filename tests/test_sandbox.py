"""Adversarial tests of the sandbox: one hack per test, each next to an honest control.

CPU tests run in CI; `@pytest.mark.gpu` ones run on the H200 (tests/test_sandbox_gpu.py). Honest
candidates here are form (a) files whose "kernel" is numpy (not torch, so the guard allows it), or the
OpenMP C++ workspace in tests/fixtures/sandbox/relu_ws (form b).
Run: python -m pytest tests/test_sandbox.py -q -x
"""
import dataclasses
import os
import pathlib
import shutil
import socket
import textwrap
import threading

import pytest

import reward
import sandbox
import sandbox.child
import sandbox.harness.rules
from sandbox import SandboxConfig, TaskError, check, compare, load_task, static_scan

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sandbox")
RELU_TASK = pathlib.Path(FIX, "relu_task.py")
RELU_WS = pathlib.Path(FIX, "relu_ws")
SOFTMAX_TASK = textwrap.dedent("""
    import torch
    import torch.nn as nn
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
        def forward(self, x):
            return torch.softmax(x, dim=1)
    def get_inputs():
        return [torch.rand(16, 4096)]
    def get_init_inputs():
        return []
""")
HONEST = "return torch.from_numpy(np.maximum(x.numpy(), 0))"


def reward_of(v) -> float:
    """Eq. 1 of a verdict: reward.py is the one place a verdict becomes a reward."""
    return reward.reward_from_verdict(v.to_dict())


STANDIN_IMPORTS = "numpy,sys,threading,time"


def sol(body: str = HONEST, head: str = "", init: str = "pass", bases: str = "nn.Module") -> str:
    """A form (a) solution: numpy relu by default; `head` runs at import, `body` is forward's body."""
    return (f"import ctypes, os, sys, threading, time\nimport numpy as np\nimport torch\nimport torch.nn as nn\n"
            f"{textwrap.dedent(head)}\n"
            f"class ModelNew({bases}):\n    def __init__(self):\n        super().__init__()\n"
            f"        {init}\n    def forward(self, x):\n" + textwrap.indent(textwrap.dedent(body), " " * 8))


@pytest.fixture(scope="session")
def cfg(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("sbx_cache"))
    # numpy stands in for a compiled kernel in most tests (fast), so widen the import allow-list;
    # test_other_compute_libraries_are_a_violation checks the strict default.
    return SandboxConfig(cache_dir=cache, warmup=2, iters=10, run_timeout_s=120, profile=False,
                         allow_imports=STANDIN_IMPORTS)


@pytest.fixture(scope="session")
def pcfg(cfg):  # with profiling (the relu baselines are computed once, then cached)
    import dataclasses
    return dataclasses.replace(cfg, profile=True)


def run(solution, cfg, task=RELU_TASK):
    return check(task, solution, cfg)


def dynamic_only(cfg):
    """The config with the static layer off: the test then proves a dynamic layer catches the hack alone
    (with it on, the static scan refuses these sources first: imports of socket/json/model, introspection)."""
    return dataclasses.replace(cfg, static_scan=False)


# ----------------------------------------------------------------------------- honest controls
@pytest.mark.slow
def test_honest_workspace_openmp_reward(pcfg):
    v = run(RELU_WS, pcfg)
    assert v.compiled and v.correct and v.violation is None and v.error is None, v.to_dict()
    assert reward_of(v) >= 1 and v.stage == "done" and v.precision == "fp32" and v.device == "cpu"
    assert v.candidate_ms > 0 and v.eager_ms > 0 and len(v.trials) == pcfg.n_trials
    assert v.timings["checked_calls"] == pcfg.warmup + pcfg.iters, "every timed call is checked"
    assert v.timings["isolation"] in ("bwrap", "unshare", "rlimits")
    d = v.to_dict()
    for k in ("compiled", "correct", "violation", "error", "eager_ms", "compile_ms", "candidate_ms",
              "speedup_eager", "speedup_compile"):
        assert k in d
    assert "reward" not in d, "the verdict carries no reward: reward.py turns it into one"


@pytest.mark.slow
def test_honest_form_a_numpy(cfg):
    v = run(sol(), cfg)
    assert v.correct and reward_of(v) == 1.0, v.to_dict()


@pytest.mark.slow
def test_honest_thread_joined_before_return(cfg):  # twin of the thread hacks
    v = run(sol("""
        y = torch.empty_like(x)
        t = threading.Thread(target=lambda: np.maximum(x.numpy(), 0, out=y.numpy())); t.start(); t.join()
        return y"""), cfg)
    assert v.correct, v.to_dict()


# ----------------------------------------------------------------------------- malformed tasks
BAD_TASKS = {
    "missing": "import torch\nclass Model(torch.nn.Module):\n    pass\ndef get_init_inputs():\n    return []\n",
    "import": "import no_such_module_xyz\n" + SOFTMAX_TASK,
    "syntax": "def broken(:\n",
    "nontensor": SOFTMAX_TASK.replace("return [torch.rand(16, 4096)]", "return [3, 'x']"),
    "raises": SOFTMAX_TASK.replace("return torch.softmax(x, dim=1)", "raise ValueError('boom')"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BAD_TASKS))
def test_malformed_task(kind):
    with pytest.raises(TaskError) as e:
        load_task(BAD_TASKS[kind])
    msg = str(e.value)
    assert msg and "\n" not in msg and "Traceback" not in msg
    assert {"missing": "get_inputs", "import": "no_such_module", "syntax": "SyntaxError",
            "nontensor": "non-tensor", "raises": "boom"}[kind] in msg


def test_bad_input_files_answer_on_the_host_in_milliseconds(cfg, tmp_path):
    """Binary, directory, missing and unparsable inputs are refused on the host, naming the file (and line),
    before any child starts."""
    import time
    binary = tmp_path / "task.py"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    for task, why in [(binary, "not UTF-8"), (tmp_path, "is a directory"), (tmp_path / "nope.py", "not found"),
                      (SOFTMAX_TASK.replace("def get_inputs", "def get_inp"), "defines no get_inputs")]:
        with pytest.raises(TaskError, match=why):
            check(task, sol(), cfg)
    t0 = time.perf_counter()
    v = run(sol(HONEST).replace("return torch", "return (torch"), cfg)  # unbalanced parenthesis
    assert not v.compiled and "line" in v.error and "SyntaxError" in v.error, v.to_dict()
    assert time.perf_counter() - t0 < 2.0, "no sandbox child for a syntax error"
    assert "not found" in run(tmp_path / "missing_solution.py", cfg).error
    txt = tmp_path / "solution.txt"  # any text file holds a form (a) solution
    txt.write_text(sol())
    assert run(txt, cfg).correct


def test_str_is_source_and_path_is_location(cfg, tmp_path):
    """The argument's type says what it is, never its text: a str that reads like a path is source (and fails
    as source, on the host), a Path is a location (a missing one is a one-line refusal)."""
    (tmp_path / "x.py").write_text(sol())  # an honest solution at the path the str names: not read
    for text, why in [("model_new.py", "solution defines no ModelNew"), (str(tmp_path / "x.py"), "SyntaxError"),
                      ("/tmp/x.py", "SyntaxError")]:
        v = run(text, cfg)
        assert v.form == sandbox.core.FORMS["a"] and not v.compiled and why in v.error, v.to_dict()
    missing = tmp_path / "missing" / "model_new.py"
    v = run(missing, cfg)
    assert v.form == sandbox.core.FORMS["refused"] and v.error == f"solution not found: {missing}", v.to_dict()
    assert not v.correct and reward_of(v) == -1
    with pytest.raises(TaskError, match="task defines no Model"):
        check("relu_task.py", sol(), cfg)
    with pytest.raises(TaskError, match="task file not found"):
        check(tmp_path / "relu_task.py", sol(), cfg)


def test_a_child_that_cannot_start_is_an_error_not_a_verdict(cfg, monkeypatch):
    """The sandbox's own failures (here: the worker script is gone) raise SandboxError with one line; they
    never become a verdict with reward -1 that training would learn from."""
    monkeypatch.setattr(sandbox.child, "WORKER", "/nonexistent/sandbox_worker.py")
    with pytest.raises(sandbox.SandboxError, match="did not start") as e:
        run(sol(), dataclasses.replace(cfg, seed=12345))  # a seed of its own: no cached reference pool
    assert "\n" not in str(e.value)


@pytest.mark.skipif(sandbox.child.gpus_listed() > 0, reason="a GPU is visible here")
def test_cuda_without_a_gpu_is_an_error_not_a_bad_task(cfg):
    with pytest.raises(sandbox.SandboxError, match="no GPU is visible"):
        run(sol(), dataclasses.replace(cfg, device="cuda"))


def test_isolation_probe_is_race_free(monkeypatch):
    """Threads asking for the isolation level while the first probe runs get the probe's answer, never the
    fallback: a 2-GPU run labelled two of its first concurrent checks "rlimits" before this lock."""
    import subprocess
    import time

    def slow_probe(cmd, **kw):  # a probe that succeeds, slowly (bwrap can take a second on a loaded host)
        time.sleep(0.3)
        return subprocess.CompletedProcess(cmd, 0, stdout=b"sandbox_worker ok\n")
    monkeypatch.setattr(sandbox.child, "_ISOLATION", None)
    monkeypatch.delenv("CUDA_AGENT_ISOLATION", raising=False)
    monkeypatch.setattr(sandbox.child.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(sandbox.child.subprocess, "run", slow_probe)
    seen, go = [], threading.Barrier(8)

    def ask():
        go.wait()
        seen.append(sandbox.isolation())
    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["bwrap"] * 8, seen


def test_good_task_loads():
    assert "class Model" in load_task(RELU_TASK)


# ----------------------------------------------------------------------------- no torch compute in forward
def test_static_scan_unit():
    ok = open(os.path.join(RELU_WS, "model_new.py")).read()
    assert static_scan(ok) is None and static_scan(sol(), tuple(STANDIN_IMPORTS.split(","))) is None
    assert "not allowed" in static_scan(sol())   # the strict default refuses the numpy stand-in
    for bad in ("return torch.relu(x)", "return F.relu(x)", "return x.clamp(min=0)", "return x.sum()",
                "return torch.nn.functional.relu(x)", "return getattr(torch, 'relu')(x)"):
        src = sol(bad).replace("import torch.nn as nn", "import torch.nn as nn\nimport torch.nn.functional as F")
        assert static_scan(src), bad
    cpp = 'src = """#include <torch/extension.h>\\ntorch::Tensor f(torch::Tensor x){ return at::relu(x); }"""'
    assert "at::relu" in static_scan(cpp)
    assert static_scan('s = """#include <x>\\nauto y = torch::empty_like(x);"""') is None


def test_static_layer_rejects_torch_fallback(cfg):
    v = run(sol("try:\n    raise RuntimeError('kernel failed')\nexcept RuntimeError:\n    return torch.relu(x)"), cfg)
    assert not v.correct and v.violation and "static scan" in v.violation and reward_of(v) == -1


@pytest.mark.slow
def test_dispatch_guard_catches_hidden_torch_call(cfg):  # the static scan refuses vars(); the guard alone:
    v = run(sol("return vars(torch)['re' + 'lu'](x)"), dynamic_only(cfg))
    assert v.violation and "dispatch guard" in v.violation and "relu" in v.violation, v.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("call, op", [("x.t().contiguous().t()", "clone"), ("x.to(torch.float64)", "_to_copy")])
def test_dispatch_guard_sees_ops_inside_allowed_ops(cfg, call, op):  # allowed ops skip the guard's key;
    v = run(sol(f"return {call}"), dynamic_only(cfg))                 # what they call in turn must not
    assert v.violation and "dispatch guard" in v.violation and op in v.violation, v.to_dict()


@pytest.mark.slow
def test_rebinding_worker_allow_list_changes_nothing(cfg):
    head = "import sandbox_worker\nsandbox_worker.ALLOWED_OPS = frozenset(list(sandbox_worker.ALLOWED_OPS) + ['relu'])"
    v = run(sol("return vars(torch)['re' + 'lu'](x)", head=head), dynamic_only(cfg))
    assert v.violation and "relu" in v.violation, v.to_dict()


@pytest.mark.slow
def test_dispatch_guard_outlives_disabled_python_modes(cfg):  # a Python dispatch mode could be popped
    v = run(sol("""
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            return vars(torch)['re' + 'lu'](x)"""), dynamic_only(cfg))
    assert v.violation and "dispatch guard" in v.violation and "relu" in v.violation, v.to_dict()


@pytest.mark.slow
def test_profiler_layer_catches_disabled_guard(cfg):  # the guard's key excluded on this thread
    v = run(sol("""
        with vars(torch._C)['_ExcludeDispatchKeyGuard'](vars(torch._C)['_dispatch_tls_local_include_set']()):
            return vars(torch)['re' + 'lu'](x)"""), dynamic_only(cfg))
    assert v.violation and "profiler" in v.violation, v.to_dict()
    assert "_dispatch_tls" in static_scan(sol("with torch._C._dispatch_tls_local_include_set(): pass"))


def test_inheriting_reference_model(cfg, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(RELU_WS, ws)
    (ws / "model_new.py").write_text("from model import Model\n\nclass ModelNew(Model):\n    pass\n")
    v = run(ws, dynamic_only(cfg))
    assert v.violation and "inherits" in v.violation, v.to_dict()


@pytest.mark.slow
def test_dispatch_guard_sees_cpp_extension_aten_call(cfg):
    cpp = ('#include <torch/extension.h>\\n#define CALL at::relu\\n'
           'torch::Tensor f(torch::Tensor x) { return CALL(x); }')
    head = ("from torch.utils.cpp_extension import load_inline\n"
            f"ext = load_inline(name='sbx_hidden_relu', cpp_sources=\"{cpp}\", functions=['f'])\n")
    v = run(sol("return ext.f(x)", head=head), cfg)
    assert v.compiled and v.violation and "dispatch guard" in v.violation, v.to_dict()


# ----------------------------------------------------------------------------- correctness hacks
@pytest.mark.slow
def test_input_mutation(cfg):
    v = run(sol("np.maximum(x.numpy(), 0, out=x.numpy())\nreturn torch.from_numpy(x.numpy().copy())"), cfg)
    assert v.violation and "modified its inputs" in v.violation, v.to_dict()


def test_stale_output_cache(cfg):  # returns the first output it ever computed
    v = run(sol("""
        if not hasattr(self, 'c'):
            self.c = torch.from_numpy(np.maximum(x.numpy(), 0))
        return self.c"""), cfg)
    assert not v.correct and v.error and "incorrect on trial" in v.error, v.to_dict()


@pytest.mark.slow
def test_pointer_keyed_cache_fails(pcfg):
    """Freed inputs are often reallocated at the same address, so a cache keyed on the pointer answers a new
    input with an old output: caught on a trial or a timed call (every call has fresh inputs and is checked).
    When no address repeats, the cache never answers and the candidate is simply correct."""
    v = run(sol("""
        k = x.data_ptr()
        if k not in self.c:
            self.c[k] = torch.from_numpy(np.maximum(x.numpy(), 0))
        return self.c[k]""", init="self.c = {}"), pcfg)
    if v.correct:  # no address came back: the cache never answered, every checked call was computed
        assert v.timings["checked_calls"] == pcfg.warmup + pcfg.iters, v.to_dict()
    else:
        assert "incorrect on trial" in v.error or "timed call" in v.error, v.to_dict()


@pytest.mark.slow
def test_degenerate_softmax_fails(cfg):
    honest = "e = np.exp(x.numpy() - np.max(x.numpy(), 1, keepdims=True))\nreturn torch.from_numpy(e / np.sum(e, 1, keepdims=True))"
    assert run(sol(honest), cfg, task=SOFTMAX_TASK).correct
    uniform = sol("return torch.from_numpy(np.full(tuple(x.shape), 1.0 / x.shape[1], dtype=np.float32))")
    v = run(uniform, cfg, task=SOFTMAX_TASK)
    assert not v.correct, v.to_dict()  # on whichever input variant a trial drew
    v = run(uniform, dataclasses.replace(cfg, n_trials=1), task=SOFTMAX_TASK)  # one trial: get_inputs' own draw
    assert not v.correct and "relative L2" in v.error and v.trials[0]["variant"] == "plain", v.to_dict()
    assert all(t["max_abs_err"] < cfg.atol for t in v.trials), "allclose alone would have passed it"


def test_compare_unit():
    import torch
    r = torch.softmax(torch.rand(8, 4096), 1)
    assert compare([r], [r.clone()], None, "cpu", 1e-2, 1e-2)["ok"]
    deg = compare([r], [torch.full_like(r, 1 / 4096)], None, "cpu", 1e-2, 1e-2)
    assert not deg["ok"] and deg["rel_l2"] > 0.1
    bad = r.clone()
    bad[3, 7] = float("nan")
    assert compare([r], [bad], None, "cpu", 1e-2, 1e-2)["first_bad_index"] == [3, 7]


@pytest.mark.parametrize("body,why", [
    ("return torch.from_numpy(np.maximum(x.numpy(), 0).astype(np.float64))", "dtype"),
    ("return torch.from_numpy(np.maximum(x.numpy(), 0).reshape(-1))", "shape"),
    ("y = np.maximum(x.numpy(), 0); y[0, 0] = np.nan\nreturn torch.from_numpy(y)", "non-finite"),
    ("class Lazy(torch.Tensor):\n    pass\nreturn torch.from_numpy(np.maximum(x.numpy(), 0)).as_subclass(Lazy)",
     "exactly torch.Tensor"),
])
@pytest.mark.slow
def test_wrong_output_kind(cfg, body, why):
    v = run(sol(body), cfg)
    assert not v.correct and why in (v.error or ""), v.to_dict()


# ----------------------------------------------------------------------------- threads
def test_python_thread_writes_after_return(cfg):
    v = run(sol("""
        y = torch.empty_like(x)
        def late():
            time.sleep(0.02)
            np.maximum(x.numpy(), 0, out=y.numpy())
        threading.Thread(target=late).start()
        return y"""), cfg)
    assert v.violation and "thread" in v.violation, v.to_dict()


def test_native_thread_writes_after_return(cfg, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(RELU_WS, ws)
    (ws / "kernels" / "relu.cpp").write_text(textwrap.dedent("""
        #include <chrono>
        #include <thread>
        extern "C" void relu_forward(const float* x, float* y, long n, void* stream) {
            std::thread([=] {  // detached: still writing after forward returned
                std::this_thread::sleep_for(std::chrono::milliseconds(10));
                for (long i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
            }).detach();
        }"""))
    v = run(ws, cfg)  # its output was copied out when forward returned, before the thread wrote it
    assert v.compiled and not v.correct and reward_of(v) == -1, v.to_dict()


# ----------------------------------------------------------------------------- timer
SLOW = "time.sleep(0.01)\n" + HONEST


@pytest.mark.slow
def test_patched_time_module_changes_nothing(pcfg):
    head = "time.perf_counter = lambda: 0.0\ntime.perf_counter_ns = lambda: 0"
    assert "patches a library" in run(sol(SLOW, head=head), pcfg).violation  # the static layer refuses it
    v = run(sol(SLOW, head=head), dynamic_only(pcfg))  # and the dynamic layers change nothing
    assert v.correct and v.violation is None and v.candidate_ms >= 9.0, v.to_dict()


@pytest.mark.slow
def test_patched_worker_module_changes_nothing(pcfg):
    """The harness in the candidate's process measures nothing: patching its clock, its sync and its channel
    leaves the driver's clock (in another process) as it was."""
    head = ("import sandbox_worker\nsandbox_worker._perf = lambda: 0.0\nsandbox_worker._sync = lambda: None\n"
            "import wire\n_send = wire.Link.send\n"
            "wire.Link.send = lambda self, o: _send(self, {**o, 'ms': 1e-6, 'error': None})\n")
    v = run(sol(SLOW, head=head), dynamic_only(pcfg))
    assert v.correct and v.violation is None and v.candidate_ms >= 9.0, v.to_dict()


# ctypes overwrites the harness's captured clock in place, wherever it finds it in the process
CLOCK_SWAP = """
import gc
_fake = lambda: 0.0
for o in gc.get_objects():
    if type(o) is tuple and len(o) == 2 and o[0] is time.perf_counter:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_fake))
        ctypes.c_void_p.from_address(id(o) + 24).value = id(_fake)
time.perf_counter = _fake
"""


@pytest.mark.slow
def test_a_clock_overwritten_in_memory_changes_nothing(pcfg):
    honest = run(sol(SLOW), dynamic_only(pcfg))
    assert honest.correct and honest.violation is None, honest.to_dict()
    v = run(sol(SLOW, head=CLOCK_SWAP), dynamic_only(pcfg))
    assert v.correct and v.candidate_ms >= 9.0, v.to_dict()  # the driver's clock, in its own process


def test_candidate_time_is_the_baselines_statistic():
    """The candidate's time is the minimum of its round medians, as the eager baseline's is: two slow rounds and
    one fast give the fast round's median (the median over all calls would give the slow one)."""
    ms = [1.0] * 34 + [1.1] * 33 + [0.5] * 33
    calls = [{"phase": "time", "ms": m} for m in [2.0] * 3 + ms]  # 3 warm-ups, not counted
    base = {"eager_ms": 0.4, "compile_ms": 0.8, "runs": 2, "eager_rounds": [0.4, 0.45, 0.5]}
    v = sandbox.Verdict(correct=True)
    sandbox.harness.rules.timing(calls, {}, base, v, SandboxConfig(warmup=3, iters=100), retime=None)
    assert v.timings["cand_rounds"] == [1.0, 1.1, 0.5] and v.timings["cand_median_all"] == 1.0
    assert v.candidate_ms == 0.5 and v.speedup_eager == pytest.approx(0.8) and v.speedup_compile == pytest.approx(1.6)


@pytest.mark.slow
def test_eager_is_timed_in_the_candidates_child(pcfg, tmp_path):
    """The speedup over eager compares the candidate with eager's rounds timed in the candidate's own child
    just before its import, not with the baseline cached per task (timed once, at another speed of the host):
    a cached eager baseline of 1 s changes nothing; with eager_beside off it is what the candidate is compared
    with. The compile baseline stays the cached one."""
    import dataclasses
    import hashlib
    cfg = dataclasses.replace(pcfg, cache_dir=str(tmp_path / "cache"))
    src = sandbox.read_task(RELU_TASK)
    base = sandbox.baselines(src, cfg)
    key = f"{hashlib.sha256(src.encode()).hexdigest()}|{base['device']}|{base['precision']}"
    sandbox.baseline_cache(cfg, key, {**base, "eager_ms": 1000.0, "eager_rounds": [1000.0] * 3, "runs": 2})
    v = run(RELU_WS, cfg)
    assert v.correct and v.eager_ms < 100 and len(v.timings["eager_rounds"]) == 3, v.to_dict()
    assert v.eager_ms == pytest.approx(min(v.timings["eager_rounds"]), abs=1e-5)
    assert v.timings["eager_cached_ms"] == 1000.0
    assert v.compile_ms == base["compile_ms"]
    v = run(RELU_WS, dataclasses.replace(cfg, eager_beside=False))
    assert v.correct and v.eager_ms == 1000.0 and "eager_rounds" not in v.timings, v.to_dict()


def test_eager_beside_a_baseline_retimed_only_for_the_compile_tier():
    """With eager timed beside the candidate, the cached baseline a tier rests on is compile's: it is re-timed
    (once, when measured in a single run) only if the candidate beats it."""
    calls = [{"phase": "time", "ms": 0.5} for _ in range(13)]
    end = {"eager": [0.9, 0.8, 1.0]}  # eager's round medians, timed by the driver in the candidate's child
    base = {"eager_ms": 0.4, "compile_ms": 0.6, "runs": 1, "eager_rounds": [0.4] * 3}
    retimed = {**base, "runs": 2}
    v = sandbox.Verdict(correct=True)
    sandbox.harness.rules.timing(calls, end, base, v, SandboxConfig(warmup=3, iters=10), retime=lambda: retimed)
    assert v.eager_ms == 0.8 and v.speedup_eager == pytest.approx(1.6) and v.timings.get("baseline_retimed")
    v = sandbox.Verdict(correct=True)
    sandbox.harness.rules.timing(calls, end, {**base, "compile_ms": 0.3}, v, SandboxConfig(warmup=3, iters=10),
                                 retime=None)
    assert v.eager_ms == 0.8 and not v.timings.get("baseline_retimed")  # neither tier rests on compile's 0.3


# ----------------------------------------------------------------------------- escapes
@pytest.mark.slow
def test_fake_verdict_on_stdout_and_result_fd(cfg):
    fake = '{"compiled": true, "correct": true, "violation": null, "error": null, "reward": 3.0}'
    v = run(sol("print(%r, flush=True)\nreturn torch.from_numpy(np.zeros(tuple(x.shape), np.float32))" % fake), dynamic_only(cfg))
    assert not v.correct and reward_of(v) == -1, v.to_dict()
    head = "import json\nj = json.load(open('job.json'))\nos.write(j['result_fd'], b'X' * 64)\n"
    v = run(sol(head=head), dynamic_only(cfg))
    assert not v.correct and v.error and "bad frame" in v.error, v.to_dict()


@pytest.mark.slow
def test_writes_outside_workspace_do_not_persist(cfg, tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    targets = [f"/tmp/sbx_escape_{os.getpid()}", os.path.join(repo, f"sbx_escape_{os.getpid()}"),
               os.path.join(os.path.expanduser("~"), f"sbx_escape_{os.getpid()}"), str(tmp_path / "escape")]
    head = f"for p in {targets!r}:\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
    v = run(sol(head=head), cfg)
    assert v.correct, v.to_dict()
    if sandbox.isolation() == "bwrap":
        assert not [p for p in targets if os.path.exists(p)]
    for p in targets:
        if os.path.exists(p):
            os.remove(p)


@pytest.mark.slow
@pytest.mark.skipif(sandbox.isolation() != "bwrap", reason="the bytecode cache is used under bubblewrap only")
def test_children_import_from_a_bytecode_cache_they_cannot_write(cfg, tmp_path, monkeypatch):
    """Where torch ships no bytecode, children import it from a cache filled once by a trusted process: a
    candidate child sees it as its PYTHONPYCACHEPREFIX and cannot plant a .pyc there for a later child."""
    import sandbox.build
    monkeypatch.setattr(sandbox.build, "ships_bytecode", lambda: False)
    monkeypatch.setattr(sandbox.child, "PYCACHE", None)
    c = dataclasses.replace(cfg, cache_dir=str(tmp_path / "cache"))
    d = sandbox.build.bytecode_cache(c)
    assert d and any(f.startswith("compile_fx.") for _, _, fs in os.walk(d) for f in fs), d
    head = """
        p = os.path.join(sys.pycache_prefix or '/nonexistent', 'planted.pyc')
        try:
            open(p, 'wb').write(b'x')
            wrote = True
        except OSError:
            wrote = False
        cached = os.path.isdir(sys.pycache_prefix + os.path.dirname(torch.__file__))
        raise RuntimeError(f'prefix={sys.pycache_prefix} torch_cached={cached} wrote={wrote}')
        """
    v = run(sol(head=head), dynamic_only(c))
    assert f"prefix={sandbox.child.PYCACHE_SEEN} torch_cached=True wrote=False" in (v.error or ""), v.to_dict()
    assert not os.path.exists(os.path.join(d, "planted.pyc"))


@pytest.mark.slow
def test_network_is_unreachable(cfg):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.5)
    port, hits = srv.getsockname()[1], []

    def accept():
        for _ in range(40):
            try:
                hits.append(srv.accept()[0])
            except OSError:
                pass
    th = threading.Thread(target=accept, daemon=True)
    th.start()
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # twin: reachable from the host
    head = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\nexcept OSError:\n    pass\n"
    v = run(sol(head=head), dynamic_only(cfg))
    assert v.correct, v.to_dict()
    if sandbox.isolation() in ("bwrap", "unshare"):
        assert len(hits) == 1, "only the host's own connection may arrive"
    srv.close()


@pytest.mark.parametrize("body,why", [
    ("os._exit(3)", "exited with code 3"),
    ("sys.exit(0)", "SystemExit"),
    ("ctypes.string_at(0)", "SIGSEGV"),
    ("while True:\n    pass", "timed out"),
    ("bufs = []\nfor _ in range(12):\n    bufs.append(np.ones(512 << 17))\nreturn torch.from_numpy(bufs[0])",
     "memory limit exceeded|memoryerror"),  # the host's RSS watch, or RLIMIT_AS (limit + 4 GiB) where torch
    # maps more address space at import (the H200 image: the 512 MiB allocation that crosses it raises)
])
@pytest.mark.slow
def test_process_deaths_become_verdicts(cfg, body, why):
    import dataclasses
    c = dataclasses.replace(cfg, run_timeout_s=20 if why == "timed out" else 120, compile_timeout_s=1,
                            mem_limit_mb=1024, static_scan=False)  # raw ctypes reads are refused statically
    v = run(sol(body), c)
    assert not v.correct and reward_of(v) == -1 and any(w in (v.error or "").lower() for w in why.lower().split("|")), \
        v.to_dict()


@pytest.mark.slow
def test_cannot_read_baseline_cache_or_sandbox_root(pcfg):
    assert run(RELU_WS, pcfg).correct  # makes sure baselines.json exists
    secret = os.path.join(os.path.expanduser(pcfg.cache_dir), "baselines.json")
    assert os.path.exists(secret)
    root = sandbox.child.root()  # holds every job dir; inside, only the candidate's own job path may show
    head = (f"if os.path.exists({secret!r}):\n    raise RuntimeError('LEAK baselines')\n"
            f"jobs = os.listdir({root!r})\n"
            f"if len(jobs) != 1 or os.listdir(os.path.join({root!r}, jobs[0])) != ['w']:\n"
            f"    raise RuntimeError('LEAK root')\n")
    v = run(sol(head=head), pcfg)
    if sandbox.isolation() == "bwrap":
        assert v.correct and v.error is None, v.to_dict()


# ----------------------------------------------------------------------------- compile, pool, run_isolated
def test_compile_cache_and_one_kernel_rebuild(cfg, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(RELU_WS, ws)
    shutil.copy(ws / "kernels" / "relu.cpp", ws / "kernels" / "relu2.cpp")
    ok, log, sos = sandbox.compile_workspace(str(ws), cfg)
    assert ok and set(sos) == {"relu", "relu2"}
    (ws / "kernels" / "relu2.cpp").write_text((ws / "kernels" / "relu2.cpp").read_text() + "\n// edit\n")
    ok2, _, sos2 = sandbox.compile_workspace(str(ws), cfg)
    assert ok2 and sos2["relu"] == sos["relu"] and sos2["relu2"] != sos["relu2"]


def test_compile_error_is_a_verdict(cfg, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(RELU_WS, ws)
    (ws / "kernels" / "relu.cpp").write_text('extern "C" void relu_forward( { oops }\n')
    v = run(ws, cfg)
    assert not v.compiled and v.stage == "compile" and "error" in v.compile_log and reward_of(v) == -1


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    """$CUDA_AGENT_CACHE sets every command's sandbox cache (the device script gives each lane its own)."""
    import cuda_agent
    import kernelbench_eval
    monkeypatch.setenv("CUDA_AGENT_CACHE", str(tmp_path))
    assert SandboxConfig().cache_dir == cuda_agent.SolveConfig("t.py").sandbox.cache_dir == \
        kernelbench_eval.EvalConfig().sandbox.cache_dir == str(tmp_path)
    monkeypatch.delenv("CUDA_AGENT_CACHE")
    assert SandboxConfig().cache_dir == "~/.cache/cuda_agent"


@pytest.mark.slow
def test_run_isolated():
    c = SandboxConfig()
    ok, val, err = sandbox.run_isolated("sandbox.harness.measure:stats", {"times": [1.0, 2.0, 3.0]}, c, 60)
    assert ok and val["median_ms"] == 2.0, err
    ok, val, err = sandbox.run_isolated("os:abort", {}, c, 60)
    assert not ok and "SIGABRT" in err


@pytest.mark.slow
def test_pool(cfg):
    pool = sandbox.SandboxPool(cfg, compile_workers=2)
    try:
        futs = [pool.submit(RELU_TASK, RELU_WS), pool.submit(RELU_TASK, sol("return torch.from_numpy(np.zeros(tuple(x.shape), np.float32))"))]
        a, b = [f.result(timeout=300) for f in futs]
        assert a.correct and not b.correct
        assert pool.compile(RELU_WS).result()[0]
    finally:
        pool.close()


def test_precision_rule():
    assert sandbox.precision_of(SandboxConfig(device="cuda", rtol=1e-2)) == "tf32"
    assert sandbox.precision_of(SandboxConfig(device="cuda", rtol=1e-4)) == "fp32"
    assert sandbox.precision_of(SandboxConfig(device="cpu", rtol=1e-2)) == "fp32"


# --- guard detection: the static layer refuses code that inspects the harness (only the last timed
# iteration runs under the dispatch guard, so telling guarded from unguarded calls must itself be a violation)
_HONEST = '''
import ctypes, torch
from sandbox_worker import load_kernel, ptr, stream
lib = load_kernel("relu")   # we inspect nothing; the word profiler in a comment is fine
class ModelNew(torch.nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.relu_forward(ptr(x), ptr(y), x.numel(), stream())
        return y
'''


@pytest.mark.parametrize("hack", [
    "if torch._C._len_torch_dispatch_stack() == 0: return torch.relu(x)",
    "if not torch.autograd.profiler._is_profiler_enabled: return torch.relu(x)",
    "if not torch.autograd._profiler_enabled(): return torch.relu(x)",
    "import measure; measure._sync = lambda: None",
    "import sandbox_worker; sandbox_worker._GUARD = None",
    "import sys; sys.setprofile(None)",
    "import inspect; inspect.stack()",
])
def test_static_scan_refuses_guard_detection(hack):
    from sandbox import static_scan
    assert static_scan(_HONEST) is None  # honest control
    bad = _HONEST.replace("        y = torch.empty_like(x)", f"        {hack}\n        y = torch.empty_like(x)")
    assert "introspection" in (static_scan(bad) or "")


def test_static_scan_allows_launchers_named_like_tensor_methods():
    """`lib.mm(...)` on a library from load_kernel is the candidate's own kernel (seen on the H200: a false
    positive on an honest cuBLAS launcher); `a.mm(b)` on a tensor is still torch compute."""
    from sandbox import static_scan
    src = _HONEST.replace('load_kernel("relu")', 'load_kernel("k")').replace("lib.relu_forward", "lib.mm")
    assert static_scan(src) is None
    assert "mm" in (static_scan(src.replace("return y", "return x.mm(x)")) or "")


def test_other_compute_libraries_are_a_violation(tmp_path):
    """Seen here before the import allow-list: a numpy ReLU (`np.maximum(x.numpy(), 0)`) earned reward 3 on
    the cpu backend. Kernels must be the candidate's own; the honest OpenMP twin still passes (other tests)."""
    from sandbox import static_scan
    assert static_scan(_HONEST) is None
    np_relu = _HONEST.replace("import ctypes, torch", "import ctypes, torch\nimport numpy as np").replace(
        "        y = torch.empty_like(x)\n", "        return torch.from_numpy(np.maximum(x.numpy(), 0))\n")
    assert "import of 'numpy'" in static_scan(np_relu)
    for lib in ("cupy", "triton", "numba", "jax", "scipy", "torch.utils.dlpack"):
        assert "not allowed" in static_scan(_HONEST.replace("import ctypes, torch", f"import ctypes, torch, {lib}"))
    assert "__import__" in static_scan(_HONEST.replace("return y", "np = __import__('numpy'); return y"))
    assert ".numpy()" in static_scan(_HONEST.replace("return y", "return x.numpy()"))


@pytest.mark.slow
def test_prewarm_fills_inductor_cache_only(tmp_path):
    """sandbox.prewarm compiles in parallel but times nothing: the inductor cache fills, baselines.json does
    not; a broken task gives its one-line error; tasks with cached baselines are skipped."""
    import hashlib
    c = SandboxConfig(cache_dir=str(tmp_path / "cache"), run_timeout_s=120)
    bad = SOFTMAX_TASK.replace("torch.softmax(x, dim=1)", "x.no_such_method()")
    out = sandbox.prewarm([SOFTMAX_TASK, bad], c, workers=2)
    h = hashlib.sha256(SOFTMAX_TASK.encode()).hexdigest()
    assert out[h] is None and "no_such_method" in out[hashlib.sha256(bad.encode()).hexdigest()]
    inductor = tmp_path / "cache" / "inductor"
    assert any(p.is_file() for p in inductor.rglob("*")), "prewarm left the inductor cache empty"
    assert not (tmp_path / "cache" / "baselines.json").exists()
    sandbox.baseline_cache(c, f"{h}|cpu|{sandbox.precision_of(c)}", {"eager_ms": 1.0, "timing": sandbox.baseline_timing(c)})
    assert sandbox.prewarm([SOFTMAX_TASK], c) == {}
