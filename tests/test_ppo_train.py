"""train.train end to end on the tiny model, the real env and the CPU sandbox: SIGKILL mid-stage, --resume,
and no finished step is lost Also: the run directory holds every promised file.

Run: python -m pytest -q tests/test_ppo_train.py -x   (about 2-4 minutes on the 2-core box; marked slow)
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the smallest config that still runs every stage for real (demos give RFT something with reward > 0)
SMALL = {"warmup.steps": 2, "warmup.batch_size": 2, "value.batch_size": 2, "agent.batch_size": 2,
         "ppo.micro_batch_size": 2, "demos.fraction": 0.5, "sampler.max_new_tokens": 12, "env.max_turns": 3,
         "rft.rollouts": 2, "rft.steps": 2, "rft.batch_size": 2, "value.steps": 3, "agent.steps": 1,
         "agent.mixed_probe": 1, "ppo.epochs": 1, "ppo.num_minibatches": 1}

SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import train
import train_config
cfg = train_config.updated(train_config.PRESETS["tiny"], json.loads(sys.argv[1]))
sys.exit(train.train(cfg))
"""


def _launch(run_dir, resume=False):
    kw = dict(SMALL, out=str(run_dir), resume=resume)
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
    assert "reward 1st->2nd half" in out and "\n4) agentic" in out, "the end-of-run table, one row per stage"
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
    kw = dict(SMALL, out=str(tmp_path / "ddp"))
    kw |= {"warmup.batch_size": 4, "value.batch_size": 4, "agent.batch_size": 4, "rft.rollouts": 4,
           "demos.fraction": 0.25}
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(root=ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(29500 + os.getpid() % 1000), str(script), json.dumps(kw)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "rank 0/2" in out and "rank 1/2" in out, out[-3000:]
    assert os.path.exists(tmp_path / "ddp" / "checkpoint.pt") and "==== stage 4)" in out
    assert os.path.exists(tmp_path / "ddp" / "rng_r1.pt"), "rank 1 keeps its own RNG states for a resume"
    rows = [json.loads(line) for line in open(tmp_path / "ddp" / "metrics.jsonl")]
    assert {r.get("stage") for r in rows} >= {1, 2, 3, 4}, rows
    rft = [r for r in rows if r.get("stage") == 2]
    assert rft[0]["n_kept"] >= 1 and any("sft_nll" in r for r in rft), rft  # SFT ran, on both ranks
    assert all("logp_gap" in r for r in rows if r.get("stage") in (1, 4)), "the gap, summed over both ranks"


def _fake_metrics(run_dir):
    """Rows shaped like a tiny run's metrics.jsonl: 2 warm-up steps, collection + 2 SFT steps, 2 value
    steps, 2 agentic steps (demos in stages 1-2 only)."""
    rows, t = [], 0.0
    for stage, step, m in [(1, 0, dict(reward_mean=-0.5, pass_rate=0.25, n=4, n_demo=1, explained_variance=-0.3)),
                           (1, 1, dict(reward_mean=-0.5, pass_rate=0.25, n=4, n_demo=1, explained_variance=0.1)),
                           (2, 0, dict(reward_mean=-0.5, pass_rate=0.25, n=4, n_demo=1, n_kept=1.0)),
                           (2, 1, dict(sft_nll=3.0)), (2, 2, dict(sft_nll=2.0)),
                           (3, 0, dict(explained_variance=0.1, heldout_explained_variance=0.0)),
                           (3, 1, dict(explained_variance=0.5, heldout_explained_variance=0.4)),
                           (4, 0, dict(reward_mean=-1.0, pass_rate=0.0, n=4, n_demo=0, explained_variance=0.2)),
                           (4, 1, dict(reward_mean=0.5, pass_rate=0.5, n=4, n_demo=0, explained_variance=0.3))]:
        t += 10
        rows.append(dict(stage=stage, step=step, time_s=t, **m))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_summary_table_and_curves(tmp_path):
    import runlog
    _fake_metrics(str(tmp_path))
    lines = runlog.summary(str(tmp_path)).splitlines()
    assert len(lines) == 5 and "reward 1st->2nd half" in lines[0]
    by_stage = {ln.split()[0]: ln for ln in lines[1:]}
    assert "-1.00 -> +0.50" in by_stage["4)"] and " 0.25 " in by_stage["4)"]   # half means, mean pass rate
    assert by_stage["2)"].split()[-3] == "1"      # RFT kept
    assert by_stage["3)"].split()[-2] == "0.40"   # stage 3: the held-out explained variance, last step
    assert [ln.split()[-1] for ln in lines[1:]] == ["20", "30", "20", "20"]  # seconds: time_s differences
    png = runlog.plot_curves(str(tmp_path))
    assert os.path.getsize(png) > 10_000


def test_logger_bar_and_escaped_sample(tmp_path, capsys):
    import runlog
    import train
    log = runlog.Logger(str(tmp_path), tensorboard=False, enabled=True, verbose=False)
    log.start_stage(1, 2)
    log.phase("rollout")
    log.log(1, 0, {"reward_mean": -1.0, "pass_rate": 0.0})
    assert log.bar.n == 1 and log.bar.postfix and "reward=-1" in log.bar.postfix
    log.close()
    assert "[1) warmup" not in capsys.readouterr().out, "the per-step line is for --verbose only"

    class Tok:
        def decode(self, ids):
            return "ok\x1b[2J\x07\u202e\nend"
    traj = train.tasks_mod.Trajectory.__new__(train.tasks_mod.Trajectory)
    traj.__dict__.update(ids=[1, 2], mask=[1, 1], source="policy", task="t", final_reward=-1.0)
    train.print_sample([traj], Tok(), log)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out and "\\x1b" in out


def test_batch_shares_add_up_over_ranks(monkeypatch):
    """1024 episodes on 6 ranks are 171 x 4 + 170 x 2 (not 6 x 170 = 1020), the demonstrations of a
    batch are dealt over ranks so that their global count is the batch's share, and each kind is drawn in
    whole passes over its items (every task floor or ceil of n / len times), the same after a resume."""
    import collections

    import train

    tasks, demos = [f"t{i}" for i in range(10)], [f"d{i}" for i in range(3)]
    shares, got_tasks, got_demos = [], [], []
    for rank in range(6):
        monkeypatch.setattr(train, "rank_world", lambda r=rank: (r, 6))
        shares.append(train.local_share(1024))
        t, d = train.deal(tasks, demos, 1024, 0.25, "0:4:7")
        assert len(t) + len(d) == shares[-1]
        assert (t, d) == train.deal(tasks, demos, 1024, 0.25, "0:4:7")  # seeded by the key alone
        got_tasks += t
        got_demos += d
    assert shares == [171, 171, 171, 171, 170, 170] and sum(shares) == 1024
    assert len(got_demos) == 256 and set(collections.Counter(got_demos).values()) <= {85, 86}
    assert len(got_tasks) == 768 and set(collections.Counter(got_tasks).values()) <= {76, 77}
    monkeypatch.setattr(train, "rank_world", lambda: (0, 1))
    t, d = train.deal(tasks[:4], demos, 4, 0.0, "0:4:0")
    assert sorted(t) == tasks[:4] and d == []                          # one episode of each task per step
    assert train.deal(tasks, [], 8, 0.5, "k")[1] == []                 # no demonstrations: all policy


def _traj(turns, stop="finish", reward=1.0):
    """A trajectory of assistant turns, each (n sampled tokens, tool calls); 2 observation tokens between turns."""
    import tasks
    ids, mask, messages, metas = [9, 9], [0, 0], [], []
    for n, calls in turns:
        ids += [5] * n
        mask += [1] * n
        ids += [9, 9]
        mask += [0, 0]
        messages.append({"role": "assistant", "content": "x", "token_ids": [5] * n})
        metas.append({"finish_reason": "stop", "errors": [], "calls": [
            {"name": c, "args_text": "{}", "error": None} for c in calls]})
    return tasks.Trajectory(task="t", task_source="", messages=messages, tools=None, ids=ids, mask=mask,
                            turns=metas, final_reward=reward, stop_reason=stop)


def test_rft_sample_drops_no_call_turns_and_truncated_trajectories():
    import dataclasses

    import train

    import train_config
    cfg = train_config.TrainConfig().rft
    t = _traj([(3, ["write_file"]), (2, []), (0, []), (4, ["verify", "finish"])])   # a chat turn and a 0-token one
    ids, mask = train.rft_sample(t, cfg)
    assert ids == t.ids and sum(mask) == 3 + 4 and mask[5:7] == [0, 0]   # the chat turn left the SFT mask
    assert sum(train.rft_sample(t, dataclasses.replace(cfg, drop_no_call_turns=False))[1]) == 3 + 2 + 4
    assert train.rft_sample(_traj([(3, [])]), cfg) is None                  # nothing left to imitate
    single = _traj([(3, [])], stop="single_turn")                            # single-turn answers have no calls
    assert sum(train.rft_sample(single, cfg)[1]) == 3
    cut = _traj([(3, ["verify"])], stop="max_turns")
    assert train.rft_sample(cut, cfg) is not None                            # default: the paper's filter
    assert train.rft_sample(cut, dataclasses.replace(cfg, drop_truncated=True)) is None
    assert train.rft_sample(_traj([(3, ["verify"])], reward=-1.0), cfg) is None   # reward > 0 only


def test_mixed_tasks_keeps_the_tasks_passed_sometimes(tmp_path):
    """Stage 4 trains on the tasks the probe passed in some but not all episodes (--agent.mixed-probe), in task
    order; none such: all tasks. The end-of-run table then names them and each task's first -> second half."""
    import runlog
    import train
    tasks = [train.tasks_mod.Task(code=f"x = {i}", name=n) for i, n in enumerate("abcd")]
    outcomes = [("a", True)] * 4 + [("b", False)] * 4 + [("c", True), ("c", False), ("c", False), ("c", False)] + \
        [("d", False), ("d", True), ("d", True), ("d", True)]
    chosen, counts = train.mixed_tasks(tasks, outcomes)
    assert [t.name for t in chosen] == ["c", "d"]
    assert counts == {"a": [4, 4], "b": [0, 4], "c": [1, 4], "d": [3, 4]}
    chosen, _ = train.mixed_tasks(tasks, [("a", True), ("b", False), ("c", True), ("d", False)])
    assert chosen == tasks                                          # one episode each: nothing mixed, all kept
    assert [t.name for t in train.mixed_tasks(tasks, outcomes[4:])[0]] == ["c", "d"]   # a unprobed: 0/0
    _fake_metrics(str(tmp_path))
    with open(tmp_path / "stage4_tasks.json", "w") as f:
        json.dump({"tasks": ["c", "d"], "probe": counts}, f)
    os.makedirs(tmp_path / "rollouts")
    for step, oks in enumerate([[0, 1], [0, 0], [1, 1], [1, 0]]):
        with open(tmp_path / "rollouts" / f"s4_{step:04d}_r0.jsonl", "w") as f:
            f.writelines(json.dumps({"task": t, "final_verdict": {"correct": bool(ok)}}) + "\n"
                         for t, ok in zip("cd", oks))
    lines = runlog.summary(str(tmp_path)).splitlines()
    assert lines[-2].startswith("stage 4 trained on 2 of 4 tasks") and "c 1/4*" in lines[-2] and "a 4/4," in lines[-2]
    assert lines[-1].endswith("c 0/2 -> 2/2, d 1/2 -> 1/2")


@pytest.mark.slow
def test_reproduction_is_the_probability_of_sampling_the_kept_action_tokens(tmp_path):
    """train.reproduction (what --rft.target stops stage 2 on) against a plain forward: per task, the largest
    over its kept trajectories of exp(sum over the mask of log softmax(logits / T)[next token])."""
    import types

    import torch
    sys.path.insert(0, ROOT)
    import train
    import train_config
    cfg = train_config.updated(train_config.PRESETS["tiny"], {"out": str(tmp_path), "ppo.micro_batch_size": 2,
                                                              "sampler.temperature": 0.7})
    model, head, tok = train.build_models(cfg, torch.device("cpu"))
    with torch.no_grad():  # an actor that is not the identity adapter
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    kept = []
    for name, n in (("a", 9), ("a", 14), ("b", 11)):
        ids = torch.randint(5, 200, (n,), generator=g).tolist()
        mask = [0] * 3 + [1] * (n - 6) + [0] * 2 + [1]   # observations inside, a policy token last
        kept.append((ids, mask, name))
    run = types.SimpleNamespace(cfg=cfg, model=model, pad_id=tok.pad_token_id or 0, device=torch.device("cpu"))
    got = train.reproduction(run, kept)

    want = {}
    model.set_adapter("actor")
    model.eval()
    with torch.no_grad():
        for ids, mask, name in kept:
            logits = model(input_ids=torch.tensor([ids])).logits[0].float() / cfg.sampler.temperature
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            s = float((lp * torch.tensor(mask[1:], dtype=torch.float32)).sum())
            want[name] = max(want.get(name, -float("inf")), s)
    assert set(got) == {"a", "b"}
    for k in want:
        assert abs(math.log(got[k]) - want[k]) < 1e-4, (k, got[k], want[k])


def test_each_rank_resumes_its_own_rng(tmp_path, monkeypatch):
    """Data parallel resume, ranks simulated in one process: checkpoint() on rank r > 0 saves r's RNG states
    beside checkpoint.pt (which holds rank 0's, and which runlog.load_checkpoint restores on every rank);
    train.restore_rng gives each rank its own back, or, from a missing or stale file, a reseed of its own:
    episode i must not draw the same numbers on every rank."""
    import dataclasses
    import random
    import types

    import numpy as np
    import torch
    sys.path.insert(0, ROOT)
    import ppo
    import train
    import train_config
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def seed_all(s):
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    base = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                              moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                              num_key_value_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1))
    model, _ = ppo.add_actor_critic_adapters(base, rank=2, alpha=4, targets="attention")
    cfg = dataclasses.replace(train_config.TrainConfig(), out=str(tmp_path))
    run = types.SimpleNamespace(cfg=cfg, model=model, head=torch.nn.Linear(16, 1), device=torch.device("cpu"))
    monkeypatch.setattr(train.dist, "barrier", lambda: None)            # one process stands in for each rank
    monkeypatch.setattr(train.dist, "broadcast", lambda t, src: None)
    want = {}
    for rank in (1, 2):
        monkeypatch.setattr(train, "rank_world", lambda r=rank: (r, 3))
        seed_all(100 + rank)
        train.checkpoint(run, 4, 7)                                        # rank r at stage 4, step 7
        want[rank] = draws()
    assert sorted(os.listdir(tmp_path)) == ["rng_r1.pt", "rng_r2.pt"], "ranks > 0 write no checkpoint.pt"
    seed_all(0)                                  # rank 0's states: what load_checkpoint restores on every rank
    rank0 = draws()
    for rank in (1, 2):
        seed_all(0)
        assert train.restore_rng(str(tmp_path), rank, 4, 7, seed=0)
        assert draws() == want[rank]
    fallback = {}
    for rank, step in ((1, 8), (3, 7)):          # a file of another step (a kill between writes); no file at all
        seed_all(0)
        assert not train.restore_rng(str(tmp_path), rank, 4, step, seed=0)
        fallback[rank] = draws()
        assert not train.restore_rng(str(tmp_path), rank, 4, step, seed=0) and draws() == fallback[rank]
    assert len({rank0, want[1], want[2], fallback[1], fallback[3]}) == 5, "every rank draws its own numbers"
