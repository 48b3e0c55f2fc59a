"""Integrity attacks on the sandbox's check protocol, one property each, next to honest controls.

A policy rewarded for speed looks for calls that are not checked: it counts calls, recognises inputs it
has seen, reads seeds from files or the worker's frames, precomputes in `__init__`, floods the result
channel, or profits from a baseline timed on a loaded machine. Each test below is such an attack; each
asserts that the attack gains nothing. Candidates are form (a) files whose "kernel" is numpy (a stand-in
that the dispatch guard allows), so the tests run on the cpu backend in seconds.
Run: python -m pytest tests/test_sandbox_integrity.py -q
"""
import dataclasses
import json
import os
import pathlib
import textwrap

import pytest

import reward
import sandbox
import sandbox.reference
from sandbox import SandboxConfig, check, static_scan

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sandbox")
RELU_TASK = pathlib.Path(FIX, "relu_task.py")
WORK = "time.sleep(0.02)\ny = torch.from_numpy(np.maximum(x.numpy(), 0))"  # an honest 20 ms "kernel"


def reward_of(v) -> float:
    """Eq. 1 of a verdict: reward.py is the one place a verdict becomes a reward."""
    return reward.reward_from_verdict(v.to_dict())


def sol(body: str, head: str = "", init: str = "pass") -> str:
    """A form (a) solution; `head` runs at import, `init` in __init__, `body` is forward's body (returns y)."""
    return (f"import ctypes, json, os, sys, threading, time\nimport numpy as np\nimport torch\nimport torch.nn as nn\n"
            f"{textwrap.dedent(head)}\n"
            f"class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + textwrap.indent(textwrap.dedent(init), " " * 8) + "\n"
            f"    def forward(self, x):\n" + textwrap.indent(textwrap.dedent(body) + "\nreturn y", " " * 8))


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return SandboxConfig(cache_dir=str(tmp_path_factory.mktemp("integrity_cache")), warmup=2, iters=10,
                         run_timeout_s=120, profile=True, allow_imports="numpy,sys,threading,time,json",
                         static_scan=False)  # the attacks below must be caught by the protocol itself


@pytest.fixture(scope="module")
def honest(cfg):
    v = check(RELU_TASK, sol(WORK), cfg)
    assert v.correct and v.candidate_ms >= 15, v.to_dict()
    return v


# ----------------------------------------------------------------------------- A. timed calls are checked calls
@pytest.mark.slow
def test_honest_control_every_timed_call_checked(honest, cfg):
    assert honest.timings["checked_calls"] == cfg.warmup + cfg.iters
    assert len(honest.trials) == cfg.n_trials and all(t["ok"] for t in honest.trials)


COUNTER = """
self.n += 1
if self.n <= 6 or self.n == 6 + {timed} or self.last is None:  # 5 trials, the op listing, the last timed call
    {work}
    self.last = y
else:                                   # a call an older protocol never compared: the last answer, at once
    y = self.last
"""


@pytest.mark.slow
def test_computing_only_on_counted_calls_is_caught(cfg):
    """An older protocol made 5 + 1 + warmup + iters calls and compared 7 of them (the trials, the op
    listing, the last timed call); a candidate that computed on those alone timed at ~0 ms."""
    body = COUNTER.format(timed=cfg.warmup + cfg.iters, work=WORK.replace("\n", "\n    "))
    v = check(RELU_TASK, sol(body, init="self.n, self.last = 0, None"), cfg)
    assert not v.correct and "timed call" in (v.error or ""), v.to_dict()


PROPORTIONAL = """
y = None
flat = x.numpy().reshape(-1)
for xs, ys in self.seen:                # an input proportional to one seen before: scale the old answer
    r = flat[7] / xs[7] if xs[7] != 0 else 0.0
    if r > 0 and np.allclose(flat[:64], r * xs[:64], rtol=1e-5, atol=1e-9):
        y = torch.from_numpy(ys * np.float32(r))
        break
if y is None:
    {work}
    self.seen.append((flat.copy(), y.numpy().copy()))
"""


@pytest.mark.slow
def test_recognising_inputs_gains_no_speed(honest, cfg):
    """Old protocol: timed inputs were 3 stored variants times a scalar, so "proportional to something seen"
    marked an uncompared call. Now every call draws fresh inputs: the shortcut never fires."""
    v = check(RELU_TASK, sol(PROPORTIONAL.format(work=WORK.replace("\n", "\n    ")), init="self.seen = []"), cfg)
    assert v.correct, v.to_dict()
    assert v.candidate_ms > 0.7 * honest.candidate_ms, (v.candidate_ms, honest.candidate_ms)


PLAN_KEYS = ("seeds", "seed", "timing_seed", "final_seed", "warmup", "iters", "profile", "nonce", "plan")
READ_PLAN = """
job = json.load(open("job.json"))
leak = sorted(k for k in job if k in {keys}) + sorted(k for k in os.environ if "SEED" in k.upper())
if leak:
    raise RuntimeError("the check's plan is readable: " + ",".join(leak))
"""


@pytest.mark.slow
def test_job_file_and_environment_hold_no_seed_count_or_plan(cfg):
    v = check(RELU_TASK, sol(WORK, init=READ_PLAN.format(keys=PLAN_KEYS)), cfg)
    assert v.correct and v.error is None, v.to_dict()


FRAME_WALK = """
leak = []
for f in sys._current_frames().values():
    while f is not None:
        for k, val in list(f.f_locals.items()):
            if isinstance(val, dict):
                leak += [key for key in val if key in {keys}]
            if k in {keys}:
                leak.append(k)
        f = f.f_back
if leak:
    raise RuntimeError("found in the worker's frames: " + ",".join(sorted(set(leak))))
"""


@pytest.mark.slow
def test_walking_the_workers_frames_finds_no_future_seed(cfg):
    """With the static scan off, a forward that walks every frame finds only the call it is in."""
    keys = tuple(k for k in PLAN_KEYS if k != "seed")  # the current request carries its own seed, nothing more
    v = check(RELU_TASK, sol(FRAME_WALK.format(keys=keys) + WORK), cfg)
    assert v.correct and v.error is None, v.to_dict()


@pytest.mark.parametrize("snippet", [
    "try:\n    1 / 0\nexcept Exception as e:\n    f = e.__traceback__.tb_frame.f_back",
    "f = sys._current_frames()",
    "g = load.__globals__",
    "import gc\nobjs = gc.get_objects()",
    "v = f.f_locals",
    "p = ctypes.pythonapi",
    "x = ctypes.string_at(123, 8)",
    "torch.relu = lambda t: t",
    "setattr(torch, 'relu', None)",
    "import sandbox_worker\nk = sandbox_worker._KERNELS",
])
def test_static_scan_refuses_introspection_and_patching(snippet):
    src = sol(WORK, head=snippet)
    assert static_scan(src, ("numpy", "sys", "threading", "time", "json", "gc")), snippet


# ----------------------------------------------------------------------------- import and __init__ are guarded
@pytest.mark.slow
def test_compute_in_init_is_refused_statically_and_dynamically(cfg):
    pre = "self.c = torch.relu(torch.randn(64, 64))"
    assert "__init__" in (static_scan(sol(WORK, init=pre), ("numpy", "sys", "threading", "time", "json")) or "")
    assert static_scan(sol(WORK, head="C = torch.matmul(torch.randn(8, 8), torch.randn(8, 8))"), ("numpy",))
    v = check(RELU_TASK, sol(WORK, init=pre), cfg)  # static scan off: the init guard alone
    assert v.violation and "constructing ModelNew" in v.violation, v.to_dict()


HONEST_INIT = """
self.lin = nn.Linear(16, 16)
self.conv = nn.Conv2d(3, 8, 3)
self.norm = nn.LayerNorm(16)
self.bn = nn.BatchNorm2d(8)
self.emb = nn.Embedding(10, 4, padding_idx=0)
self.attn = nn.MultiheadAttention(16, 2)
self.rnn = nn.LSTM(8, 8)
self.scale = nn.Parameter(torch.randn(16) * 0.02)
self.register_buffer("mask", torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8))
"""


@pytest.mark.slow
def test_honest_init_building_layers_passes(cfg):
    src = sol(WORK, init=HONEST_INIT)
    assert static_scan(src, ("numpy", "sys", "threading", "time", "json")) is None
    v = check(RELU_TASK, src, cfg)
    assert v.correct and v.violation is None, v.to_dict()


# ----------------------------------------------------------------------------- C. the host's memory
@pytest.mark.slow
def test_an_oversized_output_never_reaches_the_host(cfg):
    """The reference output is 1 MB; a 400 MB output is refused by its shape in the child, and outputs never
    travel as messages: the driver reads the shared output region, sized by the reference."""
    v = check(RELU_TASK, sol("y = torch.from_numpy(np.zeros(100_000_000, np.float32))"), cfg)
    assert not v.correct and "shape" in (v.error or ""), v.to_dict()


@pytest.mark.slow
def test_a_shrunk_shared_buffer_cannot_fault_the_host(cfg):
    """Inputs and outputs live in memfds the driver maps. A child that shrank one would make the driver's reads
    fault (SIGBUS); the driver seals them against shrinking and growing before the child exists."""
    v = check(RELU_TASK, sol("""
        shrunk = []
        for f in os.listdir('/proc/self/fd'):
            try:
                if 'cuda_agent_share' in os.readlink('/proc/self/fd/' + f):
                    os.ftruncate(int(f), 0)
                    shrunk.append(f)
            except OSError:
                pass
        y = torch.zeros_like(x) if shrunk else torch.from_numpy(np.maximum(x.numpy(), 0))"""), cfg)
    assert v.correct, v.to_dict()


def test_a_malformed_or_endless_message_from_the_child_is_its_failure():
    """The driver reads what the candidate's process writes on their link: a line that is not a JSON object, or
    a line that never ends, reads as an error (a verdict), never as an exception in the driver."""
    import socket
    from sandbox.harness.wire import Link
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = Link(a.detach())
    for raw, want in ((b"[1, 2]\n", "malformed"), (b"{not json\n", "malformed"), (b'{"k": 1}\n', None)):
        b.sendall(raw)
        got = link.recv(5)
        assert (got.get("error") or "").find(want) >= 0 if want else got == {"k": 1}, (raw, got)
    import threading

    def endless():
        b.sendall(b"x" * (Link.MAX_LINE + (1 << 16)))
        b.close()
    t = threading.Thread(target=endless)
    t.start()
    assert "longer than" in (link.recv(5) or {}).get("error", "")
    while link.recv(5) is not None:  # what was left of the endless line, then EOF
        pass
    t.join()
    assert link.eof
    link.close()


# ----------------------------------------------------------------------------- C. baselines
@pytest.mark.slow
def test_an_inflated_cached_baseline_is_retimed_before_a_speedup_tier(cfg, honest):
    """A baseline timed once on a loaded machine made an honest kernel look 20x faster. Eager is timed again in
    the candidate's own child, so an inflated cached eager time awards nothing; before a tier is awarded on a
    cached single-run baseline (compile's; eager's with `eager_beside` off), the sandbox times it again and
    keeps the minimum."""
    path = os.path.join(cfg.cache_dir, "baselines.json")
    with open(path) as f:
        data = json.load(f)
    (key, entry), = [(k, e) for k, e in data.items()]
    true_eager, true_compile = entry["eager_ms"], entry["compile_ms"]
    fake = 5 * honest.candidate_ms  # so that the honest 20 ms kernel would look 5x faster than eager
    n = len(entry.get("eager_rounds", [1]))
    inflated = {**entry, "eager_ms": fake, "eager_rounds": [fake] * n, "runs": 1}
    if true_compile:
        inflated.update(compile_ms=fake, compile_rounds=[fake] * n)
    for beside in (True, False):
        with open(path, "w") as f:
            json.dump({**data, key: inflated}, f)
        v = check(RELU_TASK, sol(WORK), dataclasses.replace(cfg, eager_beside=beside))
        assert v.correct and v.eager_ms < 10 * true_eager, (beside, v.eager_ms, true_eager, v.to_dict())
        if true_compile or not beside:
            assert v.timings.get("baseline_retimed"), v.to_dict()
            assert "round medians over 2 run(s)" in v.timings["baseline"]
        if true_compile:
            assert v.compile_ms < 10 * true_compile, (beside, v.compile_ms, true_compile)
        assert reward_of(v) == 1.0, "correct, but not faster than the re-timed eager baseline"


# ----------------------------------------------------------------------------- C. no state survives a check
STASH = "os.path.join(os.environ.get('TORCH_EXTENSIONS_DIR') or os.path.join(os.getcwd(), 'ext'), 'stash')"


@pytest.mark.slow
def test_a_stash_in_the_build_dir_does_not_survive_into_the_next_check(cfg):
    """Form (a)'s load_inline build dir is kept across checks of one source. A checked run that could write
    there could keep answers for the next check's inputs; it only ever writes into a private copy."""
    src = sol(WORK + f"\nopen({STASH}, 'w').write('answers')",
              init=f"if os.path.exists({STASH}):\n    raise RuntimeError('a stash survived')")
    first = check(RELU_TASK, src, cfg)
    assert first.correct, first.to_dict()
    second = check(RELU_TASK, src, cfg)
    assert second.correct and second.error is None, second.to_dict()


# ----------------------------------------------------------------------------- warm spares: one candidate each
LEFTOVERS = """
_marks = [p for p in ("/tmp/stash", os.path.expanduser("~/stash"), "stash") if os.path.exists(p)]
if _marks or getattr(sys.modules.get("sandbox_worker"), "STASH", None):
    raise RuntimeError(f"found a stash left by an earlier candidate: {_marks}")
for _p in ("/tmp/stash", os.path.expanduser("~/stash"), "stash"):
    open(_p, "w").write("x")
sys.modules["sandbox_worker"].STASH = 1
"""


def test_a_spare_outlives_the_thread_that_asked_for_it(cfg):
    """bwrap --die-with-parent kills a child when the thread that started it exits: a spare requested from a
    short-lived thread (a check run by a pool) must still be alive when the next check takes it."""
    import threading
    import time
    spares, key = sandbox.spares.Spares(), ("cpu", None, cfg.mem_limit_mb, (), sandbox.isolation())

    def spawn():  # the starting thread lingers 1 s, so bwrap has armed its parent-death signal when it exits
        c = sandbox.child.Child(sandbox.new_jobdir(), device="cpu", mem_limit_mb=cfg.mem_limit_mb)
        time.sleep(1.0)
        return c
    got = []
    t = threading.Thread(target=lambda: got.append(spares.take(key, 1, spawn)))
    t.start()
    t.join()
    try:
        t_end = time.time() + 60
        while not spares._ready.get(key[:2]) and time.time() < t_end:
            time.sleep(0.1)
        time.sleep(1.0)   # past the exit of every thread but the one that started the spare
        child, warm = spares.take(key, 0, spawn)
        assert warm and child.alive(), (child.proc.poll(), spares.last_error)
        child.kill()
    finally:
        got[0][0].kill()
        spares.close()


@pytest.mark.slow
def test_warm_spares_serve_one_candidate_each(cfg, tmp_path):
    """Form (b) checks run in pre-started children; nothing a candidate leaves in its process, /tmp, HOME
    or job dir reaches the next candidate, and later checks find their child already started."""
    c = dataclasses.replace(cfg, warm_spares=1)
    verdicts = []
    for i in range(4):
        ws = tmp_path / f"ep{i}"
        ws.mkdir()
        (ws / "model_new.py").write_text(sol(WORK, head=LEFTOVERS))
        verdicts.append(check(RELU_TASK, ws, c))
    assert all(v.correct for v in verdicts), [v.to_dict() for v in verdicts]
    assert any(v.timings["warm_child"] for v in verdicts[1:]), \
        ([v.timings for v in verdicts], sandbox.core._SPARES.last_error)


@pytest.mark.slow
def test_form_a_builds_in_a_warm_build_child(cfg):
    """With spares on, a single-file (form a) solution is built in a pre-started build child that writes only its
    own job dir; the host copies the build (links refused) into the cache and removes the child's dir."""
    import sandbox.build
    c = dataclasses.replace(cfg, warm_spares=1)
    cpp = ("torch::Tensor f(torch::Tensor x) { auto y = torch::empty_like(x); const float* a = x.data_ptr<float>(); "
           "float* b = y.data_ptr<float>(); for (long i = 0; i < x.numel(); ++i) b[i] = a[i] > 0 ? a[i] : 0; "
           f"return y; }} // {os.getpid()}")  # a source no other test builds; the candidate imports its module
    src = sol("y = ext.f(x)", head="from torch.utils.cpp_extension import load_inline\n"
              f"ext = load_inline(name='warm_build_relu', cpp_sources='{cpp}', functions=['f'])")
    v = check(RELU_TASK, src, c)
    assert v.correct, v.to_dict()
    sha = __import__("hashlib").sha256(src.encode()).hexdigest()[:16]
    assert os.path.exists(os.path.join(os.path.expanduser(c.cache_dir), "torch_ext", sha, ".built"))
    key, _, _ = sandbox.build._build_spare(c)
    assert sandbox.build.BUILD_SPARES._ready.get(key[:2]) or sandbox.build.BUILD_SPARES._pending.get(key[:2]), \
        sandbox.build.BUILD_SPARES.last_error  # its replacement is started
    sandbox.build.BUILD_SPARES.close()


@pytest.mark.parametrize("spares", [0, 1])
def test_a_link_in_the_build_dir_is_a_compile_failure(cfg, spares):
    """A form (a) import that leaves a link in its build dir (a path out of the copy the candidate child gets)
    is refused when the host copies the dir, in the warm and the cold build path, as the candidate's
    compile failure: a verdict, not a sandbox error."""
    c = dataclasses.replace(cfg, warm_spares=spares)
    link = (f"_d = os.environ.get('TORCH_EXTENSIONS_DIR')  # {os.getpid()} {spares}\n"
            "if _d and os.path.isdir(_d) and not os.path.lexists(os.path.join(_d, 'leak')):\n"
            "    os.symlink('/etc/passwd', os.path.join(_d, 'leak'))")
    v = check(RELU_TASK, sol(WORK, head=link), c)
    assert not v.correct and not v.compiled and "build dir refused" in (v.error or ""), v.to_dict()
    assert "internal error" not in v.error
    if spares:
        import sandbox.build
        sandbox.build.BUILD_SPARES.close()


BIG_TASK = """import torch
import torch.nn as nn
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4096, 4200, bias=False)  # 69 MB of weights in the driver's ready message
    def forward(self, x):
        return self.proj(x)
def get_inputs():
    return [torch.randn(2, 4096)]
def get_init_inputs():
    return []
"""


def test_a_warm_driver_reads_its_first_message_under_the_jobs_limit(cfg):
    """A warm child's channel waits for its next message before the job, and the job's message limit, exist.
    A driver's first message after its job carries the task's weights (here 69 MB, over the 64 MB a child
    starts with): it must be read under the job's limit, not refused under the start-up one."""
    import time
    c = dataclasses.replace(cfg, warm_spares=1)
    key, n, spawn = sandbox.reference.driver_spare(c, None)
    sandbox.reference.DRIVER_SPARES.fill(key, n, spawn)
    t_end, ready = time.time() + 120, []
    while not (ready and ready[0][1].msgs) and time.time() < t_end:  # started, and its first message read:
        time.sleep(0.2)                                                # its reader now waits for the next frame
        ready = sandbox.reference.DRIVER_SPARES._ready.get(key[:2]) or []
    assert ready and ready[0][1].msgs, (sandbox.reference.DRIVER_SPARES.last_error,
                                       ready and open(os.path.join(ready[0][1].jobdir, "stderr")).read()[-800:])
    with sandbox.reference.driver(BIG_TASK, c, None) as d:
        assert tuple(d.state_dict["proj.weight"].shape) == (4200, 4096)
