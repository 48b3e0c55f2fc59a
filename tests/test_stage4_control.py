"""The reward-permuted control of stage 4 (--agent.permute-rewards, train.permuted_rewards) and the per-seed
statistics of experiments/stage4_control_report.py.

Run: python -m pytest -q tests/test_stage4_control.py
"""
import importlib.util
import json
import os
import types
from collections import Counter

import pytest

import train
import train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_permuted_rewards_keep_the_multiset_and_follow_the_key():
    rewards = [-1.0, 1.0, 2.0, 3.0, -1.5, 0.5, 2.5, 1.5]  # distinct: where each one went is visible
    out = train.permuted_rewards(rewards, "0:permute:4:3")
    assert sorted(out) == sorted(rewards) and out != rewards
    assert train.permuted_rewards(rewards, "0:permute:4:3") == out, "the same key, the same assignment"
    others = {tuple(train.permuted_rewards(rewards, f"0:permute:4:{s}")) for s in range(10)}
    assert len(others) > 1, "the assignment changes with the step"
    tied = [-1.0, -1.0, 3.0, -1.0, 1.0]  # ties: the multiset is what is kept
    assert Counter(train.permuted_rewards(tied, "k")) == Counter(tied)
    assert train.permuted_rewards([2.0], "k") == [2.0] and train.permuted_rewards([], "k") == []


def test_every_permutation_is_drawn():
    """A uniform draw over the 6 permutations of 3, the identity included: each appears about equally often."""
    seen = Counter(tuple(train.permuted_rewards([0.0, 1.0, 2.0], f"k{i}")) for i in range(1200))
    assert len(seen) == 6 and min(seen.values()) > 150


def test_a_permuted_reward_carries_no_signal_of_its_own_trajectory():
    """The control's point: over steps, the reward a trajectory trains on has covariance ~0 with its own reward
    (a derangement would give -var / (n - 1), here -2.67: a push away from what passed)."""
    rewards = [-1.0, -1.0, -1.0, 1.0, 1.0, 2.0, 3.0, 3.0]
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    covs = []
    for step in range(4000):
        out = train.permuted_rewards(rewards, f"0:permute:4:{step}")
        covs.append(sum((a - mean) * (b - mean) for a, b in zip(rewards, out)) / len(rewards))
    cov = sum(covs) / len(covs)
    assert abs(cov) < 0.1 * var / (len(rewards) - 1), (cov, -var / (len(rewards) - 1))


def test_permute_rewards_is_off_by_default():
    assert train_config.TrainConfig().agent.permute_rewards is False
    assert train_config.PRESETS["paper"].agent.permute_rewards is False


class _Collated(Exception):
    pass


@pytest.mark.parametrize("stage,flag,permuted", [(4, False, False), (4, True, True), (1, True, False)])
def test_ppo_iteration_trains_on_permuted_rewards_in_stage_4_only(stage, flag, permuted, monkeypatch):
    """What ppo_iteration hands to collate (and so to GAE): the episodes' own rewards, or with --agent.permute-rewards
    in stage 4 the step's permutation of them."""
    rewards = [-1.0, 1.0, 3.0, 2.0]
    seen = {}

    def collate(ids, masks, rw, pad_id, device):
        seen["rewards"] = list(rw)
        raise _Collated

    monkeypatch.setattr(train.reward, "reward_from_verdict", lambda v, kind: v["r"])
    monkeypatch.setattr(train.ppo, "collate", collate)
    cfg = train_config.updated(train_config.TrainConfig(), {"agent.permute_rewards": flag, "seed": 5})
    run = types.SimpleNamespace(cfg=cfg, pad_id=0, device="cpu")
    trajs = [types.SimpleNamespace(final_verdict={"r": r}, ids=[1, 2], mask=[0, 1]) for r in rewards]
    with pytest.raises(_Collated):
        train.ppo_iteration(run, stage, 3, trajs=trajs)
    expect = train.permuted_rewards(rewards, f"5:permute:{stage}:3") if permuted else rewards
    assert seen["rewards"] == expect and (seen["rewards"] != rewards) == permuted


def _report():
    spec = importlib.util.spec_from_file_location("stage4_control_report",
                                                  os.path.join(ROOT, "experiments", "stage4_control_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_statistics_hand_cases():
    rep = _report()
    assert rep.rise([[True, False], [False, False], [True, True], [True, False]]) == pytest.approx(0.75 - 0.25)
    assert rep.rise([[False], [True], [True]]) == pytest.approx(1.0 - 0.0)  # an odd step goes to the second half
    assert rep.sign_flip_p([0.2, 0.1, 0.3]) == pytest.approx(2 / 8)         # all positive: 2 of 8 sign patterns
    assert rep.sign_flip_p([0.2, -0.2]) == pytest.approx(1.0)
    s = rep.across_seeds([0.1, 0.3])
    assert s["mean"] == pytest.approx(0.2) and s["sd"] == pytest.approx(0.1414, abs=1e-4)
    assert s["se"] == pytest.approx(0.1) and s["t"] == pytest.approx(2.0) and s["df"] == 1 and s["positive"] == 2


def _write_run(d, ok_per_step):
    os.makedirs(os.path.join(d, "rollouts"))
    for i, oks in enumerate(ok_per_step):
        with open(os.path.join(d, "rollouts", f"s4_{i:04d}_r0.jsonl"), "w") as f:
            for j, ok in enumerate(oks):
                f.write(json.dumps({"final_verdict": {"correct": ok}, "final_reward": 1.0 if ok else -1.0,
                                    "task": "aa0f1c45xx", "ids": [1, 2, 3 + j], "mask": [0, 1, 1]}) + "\n")


def test_report_computes_the_rise_per_run_and_the_differences_per_seed(tmp_path, capsys):
    """Two seeds, three arms, four steps of two episodes: each run's rise, per seed trained - permuted and trained -
    frozen, and across seeds the mean of those per-seed differences (not pooled episodes)."""
    T, F = True, False
    runs = {"s0": {"trained": [[F, F], [T, F], [T, T], [T, T]],      # 1/4 -> 4/4: +0.75
                   "control": [[T, F], [F, F], [T, F], [F, F]],      # 1/4 -> 1/4:  0
                   "permuted": [[F, F], [T, F], [T, F], [T, F]]},    # 1/4 -> 2/4: +0.25
            "s1": {"trained": [[T, F], [F, F], [T, T], [F, T]],      # 1/4 -> 3/4: +0.5
                   "control": [[T, T], [F, F], [T, F], [F, F]],      # 2/4 -> 1/4: -0.25
                   "permuted": [[F, F], [F, F], [F, F], [F, F]]}}    # 0 -> 0
    for seed, arms in runs.items():
        for arm, oks in arms.items():
            _write_run(tmp_path / seed / arm, oks)
    out = _report().main(str(tmp_path))
    assert out["seeds"]["s0"] == pytest.approx({"trained": 0.75, "frozen": 0.0, "permuted": 0.25,
                                                "trained-permuted": 0.5, "trained-frozen": 0.75})
    assert out["seeds"]["s1"] == pytest.approx({"trained": 0.5, "frozen": -0.25, "permuted": 0.0,
                                                "trained-permuted": 0.5, "trained-frozen": 0.75})
    tp, tf = out["trained-permuted"], out["trained-frozen"]
    assert tp["n"] == tf["n"] == 2 and tp["mean"] == pytest.approx(0.5) and tf["mean"] == pytest.approx(0.75)
    assert tp["p"] == pytest.approx(0.5) and tp["p_min"] == pytest.approx(0.5)
    assert "trained vs permuted" in capsys.readouterr().out
