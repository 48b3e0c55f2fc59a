"""sandbox/ray.py: the sandbox pool on a Ray cluster, on a local cluster of 2 nodes x 2 CPU lanes
(ray.cluster_utils.Cluster, cpu backend). The pool's verdicts equal the local pool's on the same candidates; a lane
killed mid-check is replaced and its check retried, and a check lost twice is a SandboxError, never a -1; a small
`synth` gives the local run's file byte for byte; a stage-4 step of the tiny preset runs through the real CLI; `check`,
`solve` and `kernelbench_eval` run as a user runs them (a child process with --sandbox.ray-address) give the local
run's exit code, verdicts and reward tiers, and their verdicts name the node and lane that checked them.
Skipped without ray (an optional extra: pip install ray).

Run: python -m pytest -q tests/test_sandbox_ray.py -s   (7 min on the 2-core box under load; -s: timings)
"""
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray", exc_type=ImportError)  # absent, or installed without its dependencies
from ray.cluster_utils import Cluster  # noqa: E402

import tyro  # noqa: E402

import cuda_agent  # noqa: E402
import kernelbench_eval  # noqa: E402
import reward  # noqa: E402
import sandbox  # noqa: E402
import sandbox.child  # noqa: E402
import sandbox.ray  # noqa: E402
import synth  # noqa: E402
from sandbox import SandboxConfig, SandboxError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "sandbox")
RELU_TASK = pathlib.Path(FIX, "relu_task.py")
RELU_WS = pathlib.Path(FIX, "relu_ws")
KB = os.path.join(ROOT, "tests", "fixtures", "kernelbench")
KB_RELU = os.path.join(KB, "KernelBench", "level1", "1_Tiny_ReLU.py")
KB_HACKED = os.path.join(KB, "samples", "level_1_problem_1_sample_1_kernel.py")  # torch.relu fallback: a violation


def sol(body: str) -> str:
    """A form (a) solution whose forward is `body` (numpy stands in for a kernel, as in test_sandbox.py)."""
    return ("import time\nimport numpy as np\nimport torch\nimport torch.nn as nn\n\n"
            "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "    def forward(self, x):\n" + textwrap.indent(textwrap.dedent(body), " " * 8))


@pytest.fixture(scope="module")
def cluster():
    t0 = time.time()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    sandbox.ray.connect(c.address)
    print(f"\n[ray] 2-node cluster up and connected in {time.time() - t0:.1f} s")
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def cfg(cluster, tmp_path_factory):
    return SandboxConfig(cache_dir=str(tmp_path_factory.mktemp("ray_cache")), warmup=2, iters=10, run_timeout_s=120,
                         allow_imports="numpy,sys,threading,time", ray_address=cluster.address)


def open_pool(cfg, **kw) -> sandbox.ray.RayPool:
    t0 = time.time()
    pool = sandbox.ray.RayPool(cfg, **kw)
    print(f"[ray] {len(pool.lanes)} lanes started in {time.time() - t0:.1f} s")
    return pool


def candidates(tmp_path) -> dict:
    """Candidates of each verdict kind: correct (workspace; slow numpy), wrong, a rule violation, a compile
    error (workspace: the bytes must travel), a workspace holding a link and a missing path (host refusals), and
    a one-line source that reads like a path (judged as source on both)."""
    broken = tmp_path / "broken_ws"
    shutil.copytree(RELU_WS, broken)
    for f in (broken / "kernels").iterdir():
        f.write_text(f.read_text() + "\nthis is not C++\n")
    linked = tmp_path / "linked_ws"
    shutil.copytree(RELU_WS, linked)
    os.symlink("/etc/passwd", linked / "kernels" / "notes.h")
    return {"workspace": RELU_WS, "slow": sol("time.sleep(0.02)\nreturn torch.from_numpy(np.maximum(x.numpy(), 0))"),
            "wrong": sol("return torch.from_numpy(np.zeros(tuple(x.shape), np.float32))"),
            "violation": sol("return torch.relu(x)"), "compile_error": broken, "link": linked,
            "missing": tmp_path / "nothing" / "model_new.py", "path_like": "model_new.py"}


@pytest.mark.slow
def test_verdicts_equal_the_local_pools(cfg, tmp_path):
    cands = candidates(tmp_path)
    local = sandbox.SandboxPool(dataclasses.replace(cfg, ray_address=None))
    try:  # the local pool first: it times the relu baselines once, into the cache the lanes share here
        want = {k: f.result(timeout=600) for k, f in {k: local.submit(RELU_TASK, c) for k, c in cands.items()}.items()}
    finally:
        local.close()
    pool = open_pool(cfg)
    try:
        t0 = time.time()
        got = {k: f.result(timeout=600) for k, f in {k: pool.submit(RELU_TASK, c) for k, c in cands.items()}.items()}
        print(f"[ray] {len(cands)} checks on {len(pool.lanes)} lanes in {time.time() - t0:.1f} s")
    finally:
        pool.close()
    for k in cands:
        w, g = want[k], got[k]
        tier = [reward.reward_from_verdict(v.to_dict()) for v in (w, g)]
        assert (w.compiled, w.correct, w.stage) == (g.compiled, g.correct, g.stage), (k, w, g)
        assert (w.violation is None, w.error is None) == (g.violation is None, g.error is None), (k, w, g)
        if k == "workspace":  # correct; its tier (1, 2 or 3) is a timing on a shared 2-core machine
            assert min(tier) >= 1, (k, tier)
        else:
            assert tier[0] == tier[1], (k, tier, w.error, g.error)
        assert g.timings["lane"]["node_id"] and g.timings["lane"]["gpu"] is None, g.timings
    assert want["slow"].correct and reward.reward_from_verdict(got["slow"].to_dict()) == 1
    assert not want["wrong"].correct and want["violation"].violation and "compile failed" in want["compile_error"].error
    assert want["path_like"].error == "solution defines no ModelNew"
    for k in ("violation", "link", "missing", "path_like"):  # the host's reasons, word for word
        assert (want[k].violation, want[k].error) == (got[k].violation, got[k].error), k
    assert len({v.timings["lane"]["node_id"] for v in got.values()}) == 2, "the checks ran on both nodes"


def _busy_lane(pool, not_pid=None, timeout=120):
    """The first lane holding a call (and not the process `not_pid`), once it has held it for a second."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy = [s for s in pool.lanes if s.busy and s.ready and s.info["pid"] != not_pid]
        if busy:
            time.sleep(0.5)  # inside the check, which takes seconds
            return busy[0]
        time.sleep(0.05)
    raise AssertionError("no lane took the check")


def _kill(slot) -> int:
    root = ray.get(slot.actor.call.remote(sandbox.child.root))  # its job dirs (no atexit runs on SIGKILL)
    pid = slot.info["pid"]
    os.kill(pid, signal.SIGKILL)
    for d in (root, slot.info["tmp"]):
        shutil.rmtree(d, ignore_errors=True)
    return pid


@pytest.mark.slow
def test_a_killed_lane_is_replaced_and_its_check_retried(cfg):
    pool = open_pool(dataclasses.replace(cfg, profile=False))
    slow = sol("time.sleep(0.5)\nreturn torch.from_numpy(np.maximum(x.numpy(), 0))")  # seconds long: killed inside
    try:
        fut = pool.submit(RELU_TASK, slow)
        slot = _busy_lane(pool)
        pid = _kill(slot)
        v = fut.result(timeout=300)
        assert v.correct and "was lost" in v.timings["lane_lost"], (v.error, v.timings.get("lane_lost"))
        deadline = time.time() + 120
        while not (slot.ready and slot.info["pid"] != pid) and time.time() < deadline:
            time.sleep(0.2)
        assert slot.ready and slot.info["pid"] != pid, "the lost lane was not replaced"
        # lost twice (the retry's lane killed too): the infrastructure's error, never a verdict of -1
        fut = pool.submit(RELU_TASK, slow)
        first = _kill(_busy_lane(pool))
        _kill(_busy_lane(pool, not_pid=first))
        with pytest.raises(SandboxError, match="lost twice"):
            fut.result(timeout=300)
    finally:
        pool.close()


@pytest.mark.slow
def test_small_synth_gives_the_local_file(cfg, tmp_path):
    def run(name, ray_address):  # workers: on each lane with Ray, in all without (it does not change the file)
        c = synth.SynthConfig(out=str(tmp_path / name / "t.jsonl"), n_candidates=4, seed=0, chunk=2,
                              workers=1 if ray_address else 2,
                              compile_backend="eager", min_ms=0.0, max_ms=1e9, timings=False, progress=False)
        c.sandbox = dataclasses.replace(c.sandbox, device="cpu", warmup=1, iters=2, cache_dir=cfg.cache_dir,
                                        ray_address=ray_address)
        assert synth.main(c) == 0
        return open(c.out, "rb").read()
    t0 = time.time()
    on_ray = run("ray", cfg.ray_address)
    print(f"[ray] synth of 4 candidates in {time.time() - t0:.1f} s")
    assert on_ray and on_ray == run("local", None), "the same seed gives the same JSONL on the lanes"


@pytest.mark.slow
def test_a_stage4_step_of_the_tiny_preset_through_the_cli(cfg, tmp_path):
    out = tmp_path / "run"
    args = ["--out", str(out), "--warmup.steps", "0", "--rft.steps", "0", "--value.steps", "0",
            "--agent.steps", "1", "--agent.batch-size", "2", "--agent.mixed-probe", "0",
            "--sampler.max-new-tokens", "16",
            "--env.max-turns", "2", "--sandbox.device", "cpu", "--sandbox.no-profile",
            "--sandbox.cache-dir", cfg.cache_dir, "--sandbox.ray-address", cfg.ray_address]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "cuda_agent.py"), "train", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [(x["stage"], x["step"]) for x in rows if x["stage"] == 4] == [(4, 0)], rows
    trajs = [json.loads(x) for f in sorted((out / "rollouts").glob("s4_*.jsonl")) for x in open(f)]
    verdicts = [t["final_verdict"] for t in trajs if t.get("final_verdict")]
    assert len(trajs) == 2 and verdicts, trajs
    assert all(v["timings"]["lane"]["node_id"] for v in verdicts), "each verdict names the lane that timed it"


# ----------------------------------------------------------------------------------------------------------
# check, solve and kernelbench_eval as a user runs them: a child process with --sandbox.ray-address


def start_cli(script: str, *args, address: str) -> subprocess.Popen:
    """`python SCRIPT ARGS --sandbox.ray-address ADDRESS` from the repo root, started (a separate Ray driver)."""
    argv = [sys.executable, os.path.join(ROOT, script), *map(str, args), "--sandbox.ray-address", address]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NO_COLOR": "1"})


def finish(p: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def assert_lane(v: dict) -> None:
    """The verdict names the lane that checked (and timed) it: its index, node address and node id."""
    lane = v["timings"]["lane"]
    assert isinstance(lane["lane"], int) and lane["node"] and lane["node_id"] and lane["gpu"] is None, lane


@pytest.mark.slow
def test_check_through_the_cli_equals_the_local_check(cfg, tmp_path, capsys, monkeypatch):
    """`cuda_agent.py check` on a lane: the local check's exit code, verdict and reward tier (timed: a candidate
    200 ms slower than eager is tier 1 on any machine, a loaded one too, where eager's relu was seen at 30-70 ms;
    a torch fallback is a violation, -1), with timings["lane"]
    in --json and a `lane` line in the text output, which otherwise equals the local one line for line."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(cfg.cache_dir, "inductor"))
    slow = tmp_path / "slow.py"
    slow.write_text(sol("time.sleep(0.2)\nreturn torch.from_numpy(np.maximum(x.numpy(), 0))"))
    flags = ["--sandbox.device", "cpu", "--sandbox.cache-dir", cfg.cache_dir, "--sandbox.warmup", "2",
             "--sandbox.iters", "10"]
    runs = {"timed": ["check", RELU_TASK, slow, "--json", "--sandbox.allow-imports", "numpy,time", *flags],
            "violation": ["check", KB_RELU, KB_HACKED, "--sandbox.no-profile", *flags]}
    t0 = time.time()
    children = {k: start_cli("cuda_agent.py", *a, address=cfg.ray_address) for k, a in runs.items()}
    local = {}
    for k, a in runs.items():  # meanwhile, the same commands without the flag, in this process
        rc = cuda_agent.main([str(x) for x in a])
        local[k] = rc, capsys.readouterr().out
    on_ray = {k: finish(p) for k, p in children.items()}
    with capsys.disabled():
        print(f"\n[ray] check through the CLI, local and on the lanes, in {time.time() - t0:.1f} s")
    for k in runs:
        assert on_ray[k][0] == local[k][0] == {"timed": 0, "violation": 1}[k], (k, on_ray[k][2][-3000:])
        assert "Traceback" not in on_ray[k][2], on_ray[k][2][-3000:]
    want, got = (json.loads(out.strip().splitlines()[-1]) for out in (local["timed"][1], on_ray["timed"][1]))
    for key in ("compiled", "correct", "violation", "error", "stage", "reward"):
        assert want[key] == got[key], (key, want, got)
    assert got["reward"] == 1 and got["candidate_ms"] and got["eager_ms"], got  # timed on the lane
    assert_lane(got)
    assert "lane" not in want["timings"]
    want, got = local["violation"][1].splitlines(), on_ray["violation"][1].splitlines()
    lanes = [ln for ln in got if ln.startswith("lane ")]
    assert len(lanes) == 1 and re.fullmatch(r"lane      : \d+ on node \S+ \(\w+\)", lanes[0]), got
    assert [ln for ln in got if ln not in lanes] == want and "violation : " in "\n".join(want), (want, got)


@pytest.mark.slow
def test_solve_through_the_cli_equals_the_local_solve(cfg, tmp_path, capsys, monkeypatch):
    """`cuda_agent.py solve` with a replayed policy that writes the relu workspace, verifies and finishes: on the
    lanes, the local run's exit code, rewards, best files and summary line; each verdict names its lane."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(cfg.cache_dir, "inductor"))
    def turn(*calls):
        return {"content": "", "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls]}
    writes = [("write_file", {"path": rel, "content": open(os.path.join(RELU_WS, rel)).read()})
              for rel in ("kernels/relu.cpp", "model_new.py")]
    script = tmp_path / "script.json"
    script.write_text(json.dumps([turn(*writes, ("verify", {})), turn(("finish", {}))]))

    def args(out):
        return ["solve", RELU_TASK, "--policy.kind", "replay", "--policy.script", script, "--out", out,
                "--env.max-turns", "3", "--sandbox.device", "cpu", "--sandbox.no-profile",
                "--sandbox.cache-dir", cfg.cache_dir]
    t0 = time.time()
    child = start_cli("cuda_agent.py", *args(tmp_path / "ray"), "--sandbox.ray-lane-cpus", "2", address=cfg.ray_address)
    rc = cuda_agent.main([str(x) for x in args(tmp_path / "local")])
    local_out = capsys.readouterr().out
    ray_rc, ray_out, ray_err = finish(child)
    with capsys.disabled():
        print(f"\n[ray] solve through the CLI, local and on the lanes, in {time.time() - t0:.1f} s")
    assert ray_rc == rc == 0, ray_err[-3000:]
    summary = [[ln for ln in out.splitlines() if "best_reward=" in ln] for out in (local_out, ray_out)]
    assert summary[0] == summary[1] and "best_reward=1.0 final_reward=1.0" in summary[0][0], summary
    (want,), (got,) = ([json.loads(x) for x in open(tmp_path / d / "trajectory.jsonl")] for d in ("local", "ray"))
    for key in ("stop_reason", "best_reward", "final_reward", "best_files"):
        assert want[key] == got[key], key
    verdicts = [got["final_verdict"]] + [c["verdict"] for t in got["turns"] for c in t["calls"] if c.get("verdict")]
    assert len(verdicts) == 2 and all(v["correct"] for v in verdicts), verdicts
    for v in verdicts:
        assert_lane(v)
    for rel in ("kernels/relu.cpp", "model_new.py"):
        assert (tmp_path / "ray" / "best" / rel).read_text() == (tmp_path / "local" / "best" / rel).read_text()


@pytest.mark.slow
def test_kernelbench_eval_through_the_cli_equals_the_local_eval(cfg, tmp_path, capsys, monkeypatch):
    """`kernelbench_eval.py` (samples mode: an honest sample, a torch fallback and wrong math on two problems) on
    the lanes: the local run's records (correct, tier, every sample's fate) and pass rate; each record's verdict
    names its lane."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(cfg.cache_dir, "inductor"))
    common = ["--kernelbench-dir", KB, "--level", "1", "--problems", "1", "2", "--samples-dir",
              os.path.join(KB, "samples"), "--sandbox.device", "cpu", "--sandbox.no-profile",
              "--sandbox.cache-dir", cfg.cache_dir]
    t0 = time.time()
    child = start_cli("kernelbench_eval.py", *common, "--out", tmp_path / "ray", "--sandbox.ray-lane-cpus", "2",
                      address=cfg.ray_address)
    rc = kernelbench_eval.main(tyro.cli(kernelbench_eval.EvalConfig,
                                        args=[str(x) for x in (*common, "--out", tmp_path / "local")]))
    capsys.readouterr()
    ray_rc, _, ray_err = finish(child)
    with capsys.disabled():
        print(f"\n[ray] kernelbench_eval through the CLI, local and on the lanes, in {time.time() - t0:.1f} s")
    assert ray_rc == rc == 0, ray_err[-3000:]
    want, got = (kernelbench_eval.read_results(str(tmp_path / d / "results.jsonl")) for d in ("local", "ray"))
    assert sorted(want) == sorted(got) == [(1, 1), (1, 2)]
    for k in want:
        w, g = want[k], got[k]
        assert (w["correct"], w["tier"], w["n_candidates"]) == (g["correct"], g["tier"], g["n_candidates"]), k
        fates = [[(c["correct"], re.sub(r"\d+(\.\d+)?", "N", c["why"] or "")) for c in r["candidates"]]
                 for r in (w, g)]  # the reason without its numbers (each check draws its own inputs)
        assert fates[0] == fates[1], (k, fates)
        assert_lane(g["verdict"])
    assert {k: [c["correct"] for c in r["candidates"]] for k, r in got.items()} == {(1, 1): [True, False],
                                                                                    (1, 2): [True, False]}
    sums = [json.load(open(tmp_path / d / "summary.json")) for d in ("local", "ray")]
    assert [(s["n"], s["n_correct"], s["pass_rate"]) for s in sums] == [(2, 2, 1.0)] * 2


def test_an_address_without_a_cluster_is_one_line_at_once(tmp_path):
    """`check --sandbox.ray-address HOST:PORT` where nothing listens: exit 2 and one line, in seconds (ray.init
    alone retries such an address for minutes)."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.time()
    rc, _, err = finish(start_cli("cuda_agent.py", "check", KB_RELU, KB_HACKED, "--sandbox.device", "cpu",
                                  "--sandbox.cache-dir", tmp_path / "cache", address=address), timeout=300)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"error: --sandbox.ray-address {address}: no Ray cluster there"), lines
    assert time.time() - t0 < 120

def test_without_the_flag_the_local_pool(cfg):
    pool = sandbox.ray.make_pool(dataclasses.replace(cfg, ray_address=None))
    try:
        assert isinstance(pool, sandbox.SandboxPool)
    finally:
        pool.close()
