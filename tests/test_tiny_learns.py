"""The tiny preset learns: after RFT on the shipped demonstrations (stage 2), the tiny actor writes kernels that
pass the sandbox in stage 4, through the real CLI, the real env and the CPU sandbox.

A shortened `python cuda_agent.py train` (no warm-up, stage 2 collects 4 demonstrations only, one value step, two
agentic steps); the test reads stage 4's pass rate from metrics.jsonl. It fails when RFT is off
(`--rft.steps 0`): the random actor then never writes a working kernel and stage 4 sits at pass rate 0.

Run: python -m pytest -q tests/test_tiny_learns.py   (a few minutes on the 2-core box; marked slow)
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the tiny preset, shortened where it does not change what is learned; stage 4 on all tasks without the probe
# (--agent.mixed-probe, covered in test_ppo_train.py). RFT as in the preset: SFT until the actor samples every
# task's demonstration with probability >= 0.2 (--rft.target), so 16 stage-4 episodes all failing is unlikely
SHORT = ["--warmup.steps", "0", "--rft.rollouts", "4", "--demos.fraction", "1.0",
         "--value.steps", "1", "--agent.steps", "2", "--agent.mixed-probe", "0", "--sandbox.device", "cpu"]


def stage_rows(out, stage):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["stage"] == stage]


@pytest.mark.slow
def test_tiny_preset_passes_after_rft(tmp_path):
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "cuda_agent.py"), "train", "--out", out, *SHORT],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sft = [x["sft_nll"] for x in stage_rows(out, 2) if "sft_nll" in x]
    assert sft and sft[-1] < 0.5 * sft[0], f"SFT did not fit the demonstrations: NLL {sft[0]} -> {sft[-1]}"
    agentic = stage_rows(out, 4)
    assert len(agentic) == 2, agentic
    passed = [x["pass_rate"] for x in agentic]
    assert max(passed) > 0, f"stage 4 never passed after RFT: pass rates {passed}"
