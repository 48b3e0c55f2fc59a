"""Per task, how closely a run's actor has fitted its kept stage-2 trajectories (`train.reproduction`), beside
the stage-4 probe's passes when the run got that far.

    python experiments/rft_reproduction.py RUN_DIR [RUN_DIR ...]

RUN_DIR: a tiny-preset run directory (config.json, checkpoint.pt, stage2_trajectories_r0.jsonl). The actor is
the checkpoint's: for a run stopped at the stage-4 header, or a frozen-actor control (--ppo.lr-actor 0), that is
the RFT actor.
"""
import contextlib
import dataclasses
import io
import json
import os
import sys
import tempfile
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import runlog  # noqa: E402
import tasks as tasks_mod  # noqa: E402
import train  # noqa: E402
import train_config  # noqa: E402


def main():
    for d in sys.argv[1:]:
        with open(os.path.join(d, "config.json")) as f:
            saved = json.load(f)
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            cfg = dataclasses.replace(train_config.PRESETS["tiny"], seed=saved["seed"], out=tmp)
            model, head, tok = train.build_models(cfg, torch.device("cpu"))
        runlog.load_checkpoint(d, model, head)
        trajs = tasks_mod.load_trajectories(os.path.join(d, "stage2_trajectories_r0.jsonl"))
        kept = [(*x, t.task) for t, x in ((t, train.rft_sample(t, cfg.rft)) for t in trajs) if x is not None]
        run = types.SimpleNamespace(cfg=cfg, model=model, pad_id=tok.pad_token_id or 0, device=torch.device("cpu"))
        repro = train.reproduction(run, kept)
        probe_file = os.path.join(d, "stage4_tasks.json")
        probe = json.load(open(probe_file))["probe"] if os.path.exists(probe_file) else {}
        print(d)
        for name, p in sorted(repro.items()):
            passes = f"{probe[name][0]}/{probe[name][1]}" if name in probe else "-"
            print(f"  {name}  reproduction {p:.3f}  probe {passes}")


if __name__ == "__main__":
    main()
