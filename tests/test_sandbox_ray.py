"""sandbox/ray.py: the sandbox pool on a Ray cluster, on a local cluster of 2 nodes x 2 CPU lanes
(ray.cluster_utils.Cluster, cpu backend). The pool's verdicts equal the local pool's on the same candidates; a lane
killed mid-check is replaced and its check retried, and a check lost twice is a SandboxError, never a -1; a small
`synth` gives the local run's file byte for byte; a stage-4 step of the tiny preset runs through the real CLI.
Skipped without ray (an optional extra: pip install ray).

Run: python -m pytest -q tests/test_sandbox_ray.py -s   (2 min on the idle 2-core box, 5 under load; -s: timings)
"""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import reward  # noqa: E402
import sandbox  # noqa: E402
import sandbox.child  # noqa: E402
import sandbox.ray  # noqa: E402
import synth  # noqa: E402
from sandbox import SandboxConfig, SandboxError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "sandbox")
RELU_TASK = os.path.join(FIX, "relu_task.py")
RELU_WS = os.path.join(FIX, "relu_ws")


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
    error (workspace: the bytes must travel), a workspace holding a link and a missing path (host refusals)."""
    broken = tmp_path / "broken_ws"
    shutil.copytree(RELU_WS, broken)
    for f in (broken / "kernels").iterdir():
        f.write_text(f.read_text() + "\nthis is not C++\n")
    linked = tmp_path / "linked_ws"
    shutil.copytree(RELU_WS, linked)
    os.symlink("/etc/passwd", linked / "kernels" / "notes.h")
    return {"workspace": RELU_WS, "slow": sol("time.sleep(0.02)\nreturn torch.from_numpy(np.maximum(x.numpy(), 0))"),
            "wrong": sol("return torch.from_numpy(np.zeros(tuple(x.shape), np.float32))"),
            "violation": sol("return torch.relu(x)"), "compile_error": str(broken), "link": str(linked),
            "missing": str(tmp_path / "nothing" / "model_new.py")}


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
    for k in ("violation", "link", "missing"):  # the host's reasons, word for word
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
    args = ["--out", str(out), "--warmup-steps", "0", "--rft-steps", "0", "--value-pretrain-steps", "0",
            "--agent-steps", "1", "--agent-batch-size", "2", "--mixed-probe", "0", "--max-new-tokens", "16",
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


def test_without_the_flag_the_local_pool(cfg):
    pool = sandbox.ray.make_pool(dataclasses.replace(cfg, ray_address=None))
    try:
        assert isinstance(pool, sandbox.SandboxPool)
    finally:
        pool.close()
