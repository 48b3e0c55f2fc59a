"""Rewards: the paper's milestone reward (Eq. 1) and the ablation rewards.

Every reward in training and every tier in evaluation comes from these pure functions, so the two can
never drift. Inputs are the sandbox's verdict fields; nothing here runs code.

Departures from the paper:
  1. The 5% margin is a parameter (`margin`, default 0.05 as in Eq. 1), so ablations can sweep it.
  2. A verdict with a `violation` (an anti-hacking rule broken) is treated exactly like an incorrect one
     (-1). The paper folds this into "correctness fails"; we keep it explicit.
  3. If a baseline time is missing (profiling switched off), a correct kernel earns the "correct but not
     faster" tier (1): it cannot be credited with a speedup nobody measured.

Smoke: python -m pytest tests/test_reward.py -q
"""
from __future__ import annotations

import math


def _faster(t: float | None, t_base: float | None, margin: float) -> bool:
    """True when t < (1 - margin) * t_base; False when either time is missing or not finite."""
    if t is None or t_base is None or not (math.isfinite(t) and math.isfinite(t_base)):
        return False
    return t < (1.0 - margin) * t_base


def milestone_reward(correct: bool, t: float | None, t_eager: float | None, t_compile: float | None,
                     margin: float = 0.05) -> float:
    """Eq. 1, "robust reward scheduling".

    -1  incorrect (compile failure and violations included: the caller passes correct=False)
     3  t < (1-margin)*t_eager and t < (1-margin)*t_compile
     2  t < (1-margin)*t_eager only
     1  correct, but not faster than eager by the margin
    """
    if not correct:
        return -1.0
    if _faster(t, t_eager, margin) and _faster(t, t_compile, margin):
        return 3.0
    if _faster(t, t_eager, margin):
        return 2.0
    return 1.0


def speedup_reward(correct: bool, t: float | None, t_compile: float | None) -> float:
    """The ablation of Table 2 ("speedup reward"): t_compile / t when correct, else -1.

    A correct kernel without timings gets 1.0 (no measured speedup), matching the milestone tier.
    """
    if not correct:
        return -1.0
    if t is None or t_compile is None or not (t > 0 and math.isfinite(t) and math.isfinite(t_compile)):
        return 1.0
    return t_compile / t


REWARDS = {"milestone": milestone_reward, "speedup": speedup_reward}


def reward_from_verdict(v: dict | None, kind: str = "milestone", margin: float = 0.05) -> float:
    """Map a sandbox verdict (as a dict, `Verdict.to_dict()`) to a scalar reward of the given kind. This is the
    one place a verdict becomes a reward: the trainer, the environment and the evaluator all call it. No
    verdict (an episode whose final check never ran) is an incorrect one."""
    assert kind in REWARDS, f"unknown reward kind {kind!r}; choose from {sorted(REWARDS)}"
    v = v or {}
    ok = bool(v.get("compiled")) and bool(v.get("correct")) and not v.get("violation")
    if kind == "speedup":
        return speedup_reward(ok, v.get("candidate_ms"), v.get("compile_ms"))
    return milestone_reward(ok, v.get("candidate_ms"), v.get("eager_ms"), v.get("compile_ms"), margin)
