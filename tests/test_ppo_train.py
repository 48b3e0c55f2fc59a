"""train.train end to end on the tiny model, the real env and the CPU sandbox: SIGKILL mid-stage, --resume,
and no finished step is lost Also: the run directory holds every promised file.

Run: python -m pytest -q tests/test_ppo_train.py -x   (about 2-4 minutes on the 2-core box; marked slow)
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the smallest config that still runs every stage for real (demos give RFT something with reward > 0)
SMALL = dict(warmup_steps=2, batch_size=2, micro_batch_size=2, demo_fraction=0.5, max_new_tokens=12,
             env=dict(max_turns=3), rft_rollouts=2, rft_steps=2, rft_batch_size=2, value_pretrain_steps=3,
             agent_steps=1,
             ppo_epochs=1, num_minibatches=1)

SCRIPT = """
import dataclasses, json, sys
sys.path.insert(0, {root!r})
import train
kw = json.loads(sys.argv[1])
base = train.PRESETS["tiny"]
env = dataclasses.replace(base.env, **kw.pop("env", dict()))
cfg = dataclasses.replace(base, env=env, **kw)
sys.exit(train.train(cfg))
"""


def _launch(run_dir, resume=False):
    kw = dict(SMALL, run_dir=str(run_dir), resume=resume)
    return subprocess.Popen([sys.executable, "-u", "-c", SCRIPT.format(root=ROOT), json.dumps(kw)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)


def _ckpt_position(run_dir):
    import torch
    p = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(p):
        return None
    try:
        ck = torch.load(p, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - never half-written (os.replace), but be robust to a race on open
        return None
    return ck["stage"], ck["step"]


@pytest.mark.slow
def test_kill_mid_stage_then_resume_loses_no_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(run_dir)
    target = (1, 1)  # one finished warm-up step, stage 1 not finished
    deadline = time.time() + 400
    pos = None
    while time.time() < deadline and proc.poll() is None:
        pos = _ckpt_position(run_dir)
        if pos is not None and pos >= target:
            break
        time.sleep(0.5)
    assert proc.poll() is None, f"run ended before it could be killed:\n{proc.stdout.read()[-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: trainer and sandbox children
    proc.wait()
    killed_at = _ckpt_position(run_dir)
    assert killed_at is not None and killed_at >= target, killed_at
    assert killed_at < (5, 0), "killed after the run finished: nothing to resume"

    proc = _launch(run_dir, resume=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert f"resumed from {run_dir}/checkpoint.pt at stage {killed_at[0]}" in out and \
        f"step {killed_at[1]}\n" in out, out[-3000:]

    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    got = [(r["stage"], r["step"]) for r in rows]
    want = ([(1, i) for i in range(2)] + [(2, i) for i in range(3)] + [(3, i) for i in range(3)] + [(4, 0)])
    assert got == want, f"each finished step logged exactly once, in order: {got}"
    assert _ckpt_position(run_dir) == (5, 0)
    # the run directory: plot, rollouts (every rollout, demos flagged), stage-2 trajectories
    assert (run_dir / "curves.png").stat().st_size > 0
    rolls = [json.loads(x) for f in sorted(os.listdir(run_dir / "rollouts")) for x in open(run_dir / "rollouts" / f)]
    assert {r["source"] for r in rolls} == {"policy", "demo"}
    s2 = [r for r in rows if r["stage"] == 2]
    assert s2[0]["n_kept"] >= 1, "RFT must find trajectories with reward > 0 (the demonstrations)"
    assert all(r["sft_nll"] > 0 for r in s2[1:])
    s3 = [r for r in rows if r["stage"] == 3]
    assert all("heldout_explained_variance" in r for r in s3)


@pytest.mark.slow
def test_two_process_data_parallel_run(tmp_path):
    """torchrun with 2 CPU processes (gloo): what `accelerate launch` does on GPUs. Each rank must report its
    own rank, every stage must finish, and train.checkpoint's per-step checksum must find the ranks in sync
    (it raises otherwise). This caught both ranks believing they were rank 0 and racing on checkpoint.pt."""
    # one demonstration per global batch (25% of 4): it lands on rank 0 only, so the RFT filter keeps
    # trajectories on one rank and none on the other, and SFT must still run on both in step
    kw = dict(SMALL, run_dir=str(tmp_path / "ddp"), batch_size=4, rft_rollouts=4, demo_fraction=0.25)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(root=ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(29500 + os.getpid() % 1000), str(script), json.dumps(kw)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "rank 0/2" in out and "rank 1/2" in out, out[-3000:]
    assert os.path.exists(tmp_path / "ddp" / "checkpoint.pt") and "==== stage 4)" in out
    rows = [json.loads(line) for line in open(tmp_path / "ddp" / "metrics.jsonl")]
    assert {r.get("stage") for r in rows} >= {1, 2, 3, 4}, rows
    rft = [r for r in rows if r.get("stage") == 2]
    assert rft[0]["n_kept"] >= 1 and any("sft_nll" in r for r in rft), rft  # SFT ran, on both ranks
