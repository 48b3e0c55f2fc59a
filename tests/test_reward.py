"""reward.py against a hand-written table (Eq. 1 and the speedup ablation)."""
import math

import pytest

from reward import milestone_reward, reward_from_verdict, speedup_reward

# (correct, t, t_eager, t_compile) -> milestone tier, computed by hand from Eq. 1 with margin 0.05.
MILESTONE_TABLE = [
    (False, 0.1, 1.0, 1.0, -1.0),   # incorrect: fast does not matter
    (True, 0.5, 1.0, 1.0, 3.0),     # faster than both
    (True, 0.94, 1.0, 1.0, 3.0),    # 0.94 < 0.95: just inside the margin
    (True, 0.95, 1.0, 1.0, 1.0),    # exactly 0.95 is not "< 0.95"
    (True, 0.96, 1.0, 1.0, 1.0),    # faster, but inside the 5% margin
    (True, 0.5, 1.0, 0.4, 2.0),     # beats eager, loses to compile
    (True, 0.5, 0.4, 1.0, 1.0),     # beats compile only: the paper gives 1 (tier 2 needs eager)
    (True, 2.0, 1.0, 1.0, 1.0),     # slower: still correct
    (True, None, 1.0, 1.0, 1.0),    # no timing: correct only
    (True, 0.5, None, None, 1.0),   # no baselines
    (True, float("nan"), 1.0, 1.0, 1.0),
]


@pytest.mark.parametrize("correct,t,te,tc,want", MILESTONE_TABLE)
def test_milestone_table(correct, t, te, tc, want):
    assert milestone_reward(correct, t, te, tc) == want


def test_margin_is_a_parameter():
    assert milestone_reward(True, 0.96, 1.0, 1.0, margin=0.0) == 3.0
    assert milestone_reward(True, 0.5, 1.0, 1.0, margin=0.6) == 1.0


@pytest.mark.parametrize("correct,t,tc,want", [
    (False, 1.0, 2.0, -1.0), (True, 1.0, 2.0, 2.0), (True, 4.0, 2.0, 0.5), (True, None, 2.0, 1.0),
    (True, 0.0, 2.0, 1.0),
])
def test_speedup_table(correct, t, tc, want):
    assert math.isclose(speedup_reward(correct, t, tc), want)


def test_from_verdict_violation_is_minus_one():
    v = dict(compiled=True, correct=True, violation="aten::add called in forward", candidate_ms=0.1,
             eager_ms=1.0, compile_ms=1.0)
    assert reward_from_verdict(v) == -1.0
    assert reward_from_verdict(v, "speedup") == -1.0
    v["violation"] = None
    assert reward_from_verdict(v) == 3.0
    assert reward_from_verdict(v, "speedup") == 10.0
    v["compiled"] = False
    assert reward_from_verdict(v) == -1.0
