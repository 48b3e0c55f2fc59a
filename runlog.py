"""What a training run writes to its run directory: the checkpoint, metrics.jsonl, TensorBoard, curves.png.

  * `save_checkpoint` / `load_checkpoint`: both LoRA adapters, the value head, the optimizers, every RNG, the
    stage and step, and the resolved config, written to run_dir/checkpoint.pt through a temporary file and
    os.replace (a kill leaves the previous checkpoint intact).
  * `Logger`: one printed line per step, one JSON row per step in metrics.jsonl, optional TensorBoard
    (an optional dependency, behind --tensorboard); `truncate_metrics` drops rows past a resumed checkpoint.
  * `plot_curves`: reward mean and critic explained variance per step, one colour per stage.

Departures from the paper: none; the paper does not describe its tooling.

Smoke: python -m pytest -q tests/test_ppo_train.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

STAGES = {1: "warmup", 2: "rft", 3: "value", 4: "agentic"}   # the four stages of §3.3, in order


def save_checkpoint(run_dir: str, model, head, opt: dict, stage: int, step: int, cfg) -> None:
    ck = {"actor": get_peft_model_state_dict(model, adapter_name="actor"),
          "critic": get_peft_model_state_dict(model, adapter_name="critic"),
          "head": head.state_dict(), "opt": {k: o.state_dict() for k, o in opt.items()},
          "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                  "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
          "stage": stage, "step": step, "config": dataclasses.asdict(cfg)}
    path = os.path.join(run_dir, "checkpoint.pt")
    torch.save(ck, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a kill leaves the previous checkpoint intact


def load_checkpoint(run_dir: str, model, head) -> dict | None:
    path = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(path):
        return None
    ck = torch.load(path, map_location="cpu", weights_only=False)
    for name in ("actor", "critic"):
        set_peft_model_state_dict(model, ck[name], adapter_name=name)
    head.load_state_dict(ck["head"])
    random.setstate(ck["rng"]["python"])
    np.random.set_state(ck["rng"]["numpy"])
    torch.set_rng_state(ck["rng"]["torch"])
    if ck["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ck["rng"]["cuda"])
    return ck


def truncate_metrics(path: str, stage: int, step: int) -> None:
    """On resume, keep only the metric rows of steps finished before the checkpoint (no duplicates)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    keep = [r for r in rows if (r["stage"], r["step"]) < (stage, step)]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------------------------
# Logging: one line per step, metrics.jsonl, optional TensorBoard, a PNG at the end.


class Logger:
    """One line per step on stdout, metrics.jsonl, and TensorBoard when asked (rank 0 only: `enabled`)."""

    def __init__(self, run_dir: str, tensorboard: bool, enabled: bool):
        self.path, self.enabled, self.t0, self.tb = os.path.join(run_dir, "metrics.jsonl"), enabled, time.time(), None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency, behind --tensorboard
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def log(self, stage: int, step: int, m: dict) -> None:
        if not self.enabled:
            return
        row = {"stage": stage, "stage_name": STAGES[stage], "step": step, "time_s": round(time.time() - self.t0, 2),
               **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in m.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        keys = ("reward_mean", "pass_rate", "entropy", "clipfrac", "approx_kl", "explained_variance",
                "heldout_explained_variance", "sft_nll", "v_loss", "n_kept", "gen_tok_s", "train_tok_s")
        print(f"[{stage}) {STAGES[stage]:7s} step {step:3d}] " + " ".join(
            f"{k} {m[k]:.3g}" for k in keys if isinstance(m.get(k), (int, float))) + f" | {row['time_s']:.0f}s",
            flush=True)
        if self.tb:
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{STAGES[stage]}/{k}", v, step)


def plot_curves(run_dir: str) -> str:
    """curves.png: reward mean and critic explained variance per step, one colour per stage."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("reward_mean", "explained_variance")):
        for s in STAGES:
            # stage 3 plots its held-out explained variance; the other stages the batch's
            pts = [(i, r.get("heldout_" + key, r.get(key))) for i, r in enumerate(rows) if r["stage"] == s]
            pts = [(i, v) for i, v in pts if isinstance(v, (int, float)) and v == v]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{s}) {STAGES[s]}", color=f"C{s - 1}")  # one colour a stage
        ax.set_xlabel("logged step (all stages)")
        ax.set_title(key + (" (stage 3: held-out)" if key == "explained_variance" else ""))
        ax.legend()
    path = os.path.join(run_dir, "curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

