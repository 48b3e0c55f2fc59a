"""Attacks from inside the candidate's own process, one class per test, each beside an honest control.

A candidate's process can rewrite anything in it: Python objects, the result channel, native memory. So the
verdict may rest on nothing that process measures or reports; these tests attack exactly that:
  A.  work hidden in the harness's calls: a TorchFunctionMode pushed at import sees the inputs being built and
      computes the answer there, so `forward` only returns it;
  B.  forged times, from Python (a library function the channel uses, patched) and from C++ (a kernel library
      that runs Python through the C API when it is loaded);
  C.  answers right only for `get_inputs`' distribution (MSE of two randn tensors is ~2, LayerNorm of randn is
      ~its input, log_softmax is ~x - (log N + 1/2), x / ||x|| is ~x / sqrt(n));
  D.  complex outputs whose imaginary part is wrong;
  E.  host memory and disk filled through the child's own mounts;
  F.  a thread started at import that watches the input buffers and computes before the clock starts.
Candidates use numpy as a stand-in kernel (the dispatch guard allows it) with the static scan off, so each
attack meets the protocol itself. CUDA versions: tests/test_sandbox_gpu.py.
Run: python -m pytest tests/test_sandbox_attacks.py -q
"""
import dataclasses
import json
import os
import pathlib
import textwrap

import pytest

import reward
from sandbox import SandboxConfig, check

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sandbox")
RELU_TASK = pathlib.Path(FIX, "relu_task.py")
SLOW_RELU = "time.sleep(0.02)\ny = torch.from_numpy(np.maximum(x.numpy(), 0))"  # an honest 20 ms "kernel"


def reward_of(v) -> float:
    return reward.reward_from_verdict(v.to_dict())


def sol(body: str, head: str = "", args: str = "x") -> str:
    """A form (a) solution: `head` runs at import, `body` is forward's body and sets y."""
    return (f"import ctypes, json, os, sys, threading, time\nimport numpy as np\nimport torch\nimport torch.nn as nn\n"
            f"{textwrap.dedent(head)}\n"
            f"class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            f"    def forward(self, {args}):\n" + textwrap.indent(textwrap.dedent(body) + "\nreturn y", " " * 8))


def task(forward: str, inputs: str, args: str = "x") -> str:
    return textwrap.dedent(f"""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
            def forward(self, {args}):
                return {forward}
        def get_inputs():
            return {inputs}
        def get_init_inputs():
            return []
    """)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return SandboxConfig(cache_dir=str(tmp_path_factory.mktemp("attack_cache")), warmup=2, iters=10,
                         run_timeout_s=120, profile=False, static_scan=False,
                         allow_imports="numpy,sys,threading,time,json")


@pytest.fixture(scope="module")
def pcfg(cfg):
    return dataclasses.replace(cfg, profile=True)


@pytest.fixture(scope="module")
def honest(pcfg):
    v = check(RELU_TASK, sol(SLOW_RELU), pcfg)
    assert v.correct and v.candidate_ms >= 15, v.to_dict()
    return v


# ----------------------------------------------------------------------------- A. work hidden in the harness's calls
HOOK = """
STASH = []
class Hook(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {{}}))
        if getattr(func, "__name__", "") == "randn":  # the harness building this call's input
            {work}
            STASH.append(y)
        return out
Hook().__enter__()
"""


@pytest.mark.parametrize("work", ["y = torch.from_numpy(np.maximum(out.numpy(), 0))",   # no kernel at all
                                  "time.sleep(0.02); y = torch.from_numpy(np.maximum(out.numpy(), 0))"])
@pytest.mark.slow
def test_work_done_while_the_harness_builds_inputs_gains_nothing(pcfg, work):
    """The candidate's process never builds an input: a hook on torch's factories sees nothing, so the
    answer it meant to stash does not exist when forward runs, and forward takes its slow path (the honest
    20 ms kernel), which is timed. The bound is that path's own sleep, not a comparison with eager: on a
    loaded machine torch's eager relu can be slower than numpy's, so a reward says nothing about the stash."""
    v = check(RELU_TASK, sol("if STASH:\n    y = STASH.pop()\nelse:\n    " + SLOW_RELU.replace("\n", "\n    "),
                             head=HOOK.format(work=work)), pcfg)
    assert v.correct and v.candidate_ms >= 19, v.to_dict()  # every timed call slept: no stashed answer


# ----------------------------------------------------------------------------- B. forged times and messages
FORGE_PY = """
_dumps = json.dumps
def _forged(obj, *a, **k):  # every message the process sends, rewritten on its way out
    if isinstance(obj, dict):
        obj = dict(obj)
        for key in ("ms", "span_ms", "launch_ms", "eager", "ms_list"):
            if isinstance(obj.get(key), (int, float)):
                obj[key] = obj[key] / 1000
        if obj.get("type") == "result":
            obj.update(stage="done", error=None, violation=None)
    return _dumps(obj, *a, **k)
json.dumps = _forged
"""


@pytest.mark.slow
def test_times_forged_from_python_do_not_enter_the_verdict(pcfg, honest):
    v = check(RELU_TASK, sol(SLOW_RELU, head=FORGE_PY), pcfg)
    assert v.correct and v.candidate_ms >= 15 and reward_of(v) < 3, v.to_dict()


NATIVE = r"""
#include <dlfcn.h>
typedef int (*ensure_t)();
typedef void (*release_t)(int);
typedef int (*run_t)(const char*);
static const char* PY = R"PY(
FORGE
)PY";
__attribute__((constructor)) static void forge() {  // runs inside the candidate's Python when loaded
    ensure_t ensure = (ensure_t)dlsym(RTLD_DEFAULT, "PyGILState_Ensure");
    release_t release = (release_t)dlsym(RTLD_DEFAULT, "PyGILState_Release");
    run_t run = (run_t)dlsym(RTLD_DEFAULT, "PyRun_SimpleString");
    if (!ensure || !release || !run) return;
    int g = ensure();
    run(PY);
    release(g);
}
extern "C" void relu(const float* x, float* y, long n) {
    for (long i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
"""
NATIVE_MODEL_NEW = """
import ctypes
import time
import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr
lib = load_kernel("k")
lib.relu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
    def forward(self, x):
        time.sleep(0.02)
        y = torch.empty_like(x)
        lib.relu(ptr(x), ptr(y), x.numel())
        return y
"""


@pytest.mark.slow
def test_times_forged_from_native_code_do_not_enter_the_verdict(pcfg, honest, tmp_path):
    ws = tmp_path / "native"
    (ws / "kernels").mkdir(parents=True)
    forge = "import json, sys\n" + textwrap.dedent(FORGE_PY)
    (ws / "kernels" / "k.cpp").write_text(NATIVE.replace("FORGE", forge))
    (ws / "model_new.py").write_text(NATIVE_MODEL_NEW)
    v = check(RELU_TASK, ws, pcfg)
    assert v.compiled, v.to_dict()
    assert v.correct and v.candidate_ms >= 15 and reward_of(v) < 3, v.to_dict()


@pytest.mark.slow
def test_a_process_that_forges_every_message_and_computes_nothing_is_wrong(pcfg):
    """Claims of success from the candidate's process count for nothing: only the trusted side's comparisons."""
    v = check(RELU_TASK, sol("y = torch.empty_like(x)", head=FORGE_PY), pcfg)
    assert not v.correct and reward_of(v) == -1, v.to_dict()


# ----------------------------------------------------------------------------- C. answers for one distribution only
SHORTCUTS = {  # task, the shortcut, an honest numpy version (which must keep passing)
    "mse": (task("torch.mean((a - b) ** 2)", "[torch.randn(512, 512), torch.randn(512, 512)]", "a, b"),
            "y = torch.from_numpy(np.array(2.0, dtype=np.float32))",
            "y = torch.from_numpy(np.array(np.mean((a.numpy().astype(np.float64) - b.numpy()) ** 2), "
            "dtype=np.float32))", "a, b"),
    "layernorm": (task("F.layer_norm(x, x.shape[1:])", "[torch.randn(2, 512, 512)]"),
                  "y = x",
                  "v = x.numpy().astype(np.float64).reshape(2, -1)\n"
                  "v = (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + 1e-5)\n"
                  "y = torch.from_numpy(v.reshape(x.shape).astype(np.float32))", "x"),
    "log_softmax": (task("torch.log_softmax(x, dim=1)", "[torch.randn(16, 16384)]"),
                    "y = torch.from_numpy(x.numpy() - np.float32(np.log(16384) + 0.5))",
                    "v = x.numpy().astype(np.float64); m = v.max(1, keepdims=True)\n"
                    "y = torch.from_numpy((v - m - np.log(np.exp(v - m).sum(1, keepdims=True))).astype(np.float32))",
                    "x"),
    "l2_normalize": (task("x / x.norm(dim=1, keepdim=True)", "[torch.randn(16, 16384)]"),
                     "y = torch.from_numpy(x.numpy() / np.float32(np.sqrt(16384)))",
                     "v = x.numpy().astype(np.float64)\n"
                     "y = torch.from_numpy((v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32))", "x"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHORTCUTS))
def test_answers_right_only_for_the_input_distribution_are_wrong(cfg, name):
    src, shortcut, _, args = SHORTCUTS[name]
    v = check(src, sol(shortcut, args=args), cfg)
    assert not v.correct and reward_of(v) == -1, v.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHORTCUTS))
def test_honest_twins_of_the_shortcuts_pass_every_input_variant(cfg, name):
    src, _, honest_body, args = SHORTCUTS[name]
    v = check(src, sol(honest_body, args=args), cfg)
    assert v.correct, v.to_dict()
    assert len({t.get("variant") for t in v.trials}) > 1, v.trials  # the trials did draw beyond get_inputs


@pytest.mark.slow
def test_inputs_whose_reference_turns_non_finite_keep_their_distribution(cfg):
    """log(x) of rand inputs: a shifted variant would take the log of negative numbers; the trusted side sees
    the reference turn non-finite and draws that trial from get_inputs instead (an honest log still passes)."""
    src = task("torch.log(x)", "[torch.rand(64, 1024) + 0.01]")
    v = check(src, sol("y = torch.from_numpy(np.log(x.numpy()))"), cfg)
    assert v.correct, v.to_dict()


# ----------------------------------------------------------------------------- D. complex outputs
COMPLEX_TASK = task("torch.view_as_complex(torch.stack([x, x.flip(1)], -1))", "[torch.randn(64, 256)]")


@pytest.mark.slow
def test_complex_outputs_are_compared_in_full(cfg):
    wrong = "y = torch.from_numpy(x.numpy().astype(np.complex64))"  # the real part right, the imaginary part 0
    v = check(COMPLEX_TASK, sol(wrong), cfg)
    assert not v.correct and "imag" in (v.error or "") + str(v.trials), v.to_dict()
    honest = "v = x.numpy()\ny = torch.from_numpy((v + 1j * v[:, ::-1]).astype(np.complex64))"
    assert check(COMPLEX_TASK, sol(honest), cfg).correct


@pytest.mark.slow
def test_integer_and_bool_outputs_are_compared_exactly(cfg):
    src = task("(x > 0.5)", "[torch.randn(64, 256)]")
    off = "y = torch.from_numpy(x.numpy() > 0.49)"  # allclose would pass a bool off in a few elements
    v = check(src, sol(off), cfg)
    assert not v.correct, v.to_dict()
    assert check(src, sol("y = torch.from_numpy(x.numpy() > 0.5)"), cfg).correct


# ----------------------------------------------------------------------------- E. host memory and disk
FILL = """
import errno
LANDED = {}
for d in ("/tmp", "/dev/shm", os.environ.get("HOME", "."), "/home", "/root", "/opt", "/srv", "/mnt"):
    n = 0
    try:
        with open(os.path.join(d, "fill.bin"), "wb") as f:
            chunk = b"x" * (16 << 20)
            while n < TOTAL:
                f.write(chunk)
                f.flush()
                n += len(chunk)
    except OSError:
        pass
    LANDED[d] = n >> 20
raise RuntimeError("landed " + json.dumps(LANDED))
"""


def test_the_childs_own_mounts_cannot_hold_more_than_its_memory_limit(cfg):
    """tmpfs pages are in no process's RSS: without size caps, 1.5 GB written to /tmp or /dev/shm (or a hidden
    directory's tmpfs) under a 512 MB limit lands in the host's memory. What a mount holds counts."""
    small = dataclasses.replace(cfg, mem_limit_mb=512)
    v = check(RELU_TASK, sol("y = x", head=f"TOTAL = {1536 << 20}\n" + FILL), small)
    assert not v.correct
    err = (v.error or "") + v.compile_log + v.timings.get("log", "")
    if "memory limit exceeded (RSS + tmpfs" in err:  # stopped while filling: what the mounts held was counted
        return
    assert "landed" in err, v.to_dict()  # the candidate ran to its end and said what each mount took
    landed = json.loads(err.split("landed ", 1)[1].split("}")[0] + "}")
    assert landed["/tmp"] + landed["/dev/shm"] <= 512, landed  # capped mounts, counted in the limit
    assert all(landed[d] == 0 for d in ("/home", "/root", "/opt", "/srv", "/mnt")), landed  # hidden: read-only


def test_a_build_child_cannot_fill_the_disk(cfg):
    """A load_inline source runs Python at import in its build child, which writes into its build dir on the
    host's disk: the child is stopped at the disk limit, and the check is a compile failure."""
    small = dataclasses.replace(cfg, disk_limit_mb=128)
    head = ("p = os.path.join(os.getcwd(), 'junk')\nos.makedirs(p, exist_ok=True)\n"
            "for i in range(64):\n    open(os.path.join(p, str(i)), 'wb').write(b'x' * (8 << 20))\n")
    v = check(RELU_TASK, sol("y = x", head=head + "from torch.utils.cpp_extension import load_inline\n"), small)
    assert not v.correct and "disk" in (v.error or "") + v.compile_log + v.timings.get("log", ""), v.to_dict()


# ----------------------------------------------------------------------------- F. work before the clock starts
WATCHER = """
ANSWERS = {}
def watch():
    seen = None
    while True:
        x = WATCHED[0] if WATCHED else None
        if x is not None:
            key = float(x.numpy().reshape(-1)[:64].sum())
            if key != seen:  # new inputs in the buffer: compute their answer at once, before forward is asked
                seen = key
                time.sleep(0.02)
                ANSWERS[key] = torch.from_numpy(np.maximum(x.numpy(), 0))
        time.sleep(0.0005)
WATCHED = []
threading.Thread(target=watch, daemon=True).start()
"""
WATCHED_BODY = """
WATCHED[:] = [x]
y = ANSWERS.get(float(x.numpy().reshape(-1)[:64].sum()))
if y is None:
    time.sleep(0.02)
    y = torch.from_numpy(np.maximum(x.numpy(), 0))
"""


@pytest.mark.slow
def test_a_thread_that_watches_the_input_buffers_is_stopped_until_the_clock_runs(pcfg, honest):
    """The input region is the same buffer every call, so a thread of the candidate's could watch it and start
    on new inputs the moment they appear; forward then returns the watcher's answer. The driver writes them
    while the whole process is stopped, and the clock starts as it continues: the watcher's 20 ms are inside
    the clock. (On cpu the driver continues the child right after writing, so this holds by the order of the
    protocol; the GPU's queued calls write inputs only after the child's last instruction ran.)"""
    v = check(RELU_TASK, sol(WATCHED_BODY, head=WATCHER), pcfg)
    assert v.correct and v.candidate_ms >= 0.75 * honest.candidate_ms, (v.candidate_ms, honest.candidate_ms)
