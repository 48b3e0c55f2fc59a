"""What a training run writes to its run directory: the checkpoint, metrics.jsonl, TensorBoard, curves.png.

  * `save_checkpoint` / `load_checkpoint`: both LoRA adapters (and the KL reference's, when there is one), the
    value head, the optimizers, every RNG, the stage and step, and the resolved config, written to
    run_dir/checkpoint.pt through a temporary file and os.replace (a kill leaves the previous checkpoint intact).
  * `save_adapter`: run_dir/adapter/, what users load: the actor as a plain peft adapter folder
    (adapter_config.json + adapter_model.safetensors, `PeftModel.from_pretrained(base, DIR)`), critic/ (the
    critic adapter + value_head.safetensors), base/ for the tiny preset's random base model, and
    cuda_agent.json naming the base model, stage and step. `cuda_agent.py solve --policy.adapter DIR` and
    `kernelbench_eval.py --policy.adapter DIR` load it.
  * `Logger`: a tqdm bar per stage (the step's key numbers in its postfix; the full line per step with
    --verbose), one JSON row per step in metrics.jsonl, optional TensorBoard (behind --tensorboard);
    `truncate_metrics` drops rows past a resumed checkpoint.
  * `summary`: the end-of-run table, one row per stage; `plot_curves`: curves.png, reward and pass rate,
    stage 2's SFT loss and the critic's explained variance, each over the steps that logged it, stage
    boundaries and the demonstrations' share marked.

Departures from the paper: none; the paper does not describe its tooling.

Smoke: python -m pytest -q tests/test_ppo_train.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import time

import shutil

import matplotlib.pyplot as plt
import numpy as np
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import save_file
from tqdm import tqdm

from policy import ADAPTER_META

STAGES = {1: "warmup", 2: "rft", 3: "value", 4: "agentic"}   # the four stages of §3.3, in order


def save_checkpoint(run_dir: str, model, head, opt: dict, stage: int, step: int, cfg) -> None:
    ck = {name: get_peft_model_state_dict(model, adapter_name=name) for name in ("actor", "critic", "ref")
          if name in model.peft_config}
    ck.update({
          "head": head.state_dict(), "opt": {k: o.state_dict() for k, o in opt.items()},
          "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                  "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
          "stage": stage, "step": step, "config": dataclasses.asdict(cfg)})
    path = os.path.join(run_dir, "checkpoint.pt")
    torch.save(ck, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a kill leaves the previous checkpoint intact


def load_checkpoint(run_dir: str, model, head) -> dict | None:
    path = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(path):
        return None
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if "ref" in ck and "ref" not in model.peft_config:  # the KL reference of a stage in progress
        model.add_adapter("ref", dataclasses.replace(model.peft_config["actor"]))
    for name in ("actor", "critic", "ref"):
        if name in ck:
            set_peft_model_state_dict(model, ck[name], adapter_name=name)
    model.set_adapter("actor")
    head.load_state_dict(ck["head"])
    random.setstate(ck["rng"]["python"])
    np.random.set_state(ck["rng"]["numpy"])
    torch.set_rng_state(ck["rng"]["torch"])
    if ck["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ck["rng"]["cuda"])
    return ck


def save_adapter(run_dir: str, model, head, meta: dict, base_dir: str | None = None) -> str:
    """Write run_dir/adapter/ (see the module docstring) through adapter.tmp and a rename, so a reader sees
    the previous folder or the new one. meta: what cuda_agent.json records ("base_model": hub id or path);
    base_dir: a saved base model to copy in as base/ (the tiny preset's random base). Returns the folder."""
    out, tmp = os.path.join(run_dir, "adapter"), os.path.join(run_dir, "adapter.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, selected_adapters=["actor", "critic"])  # peft: tmp/actor/, tmp/critic/
    for f in os.listdir(os.path.join(tmp, "actor")):                   # the actor is the folder itself
        os.replace(os.path.join(tmp, "actor", f), os.path.join(tmp, f))
    os.rmdir(os.path.join(tmp, "actor"))
    save_file({k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()},
              os.path.join(tmp, "critic", "value_head.safetensors"))
    if base_dir:
        shutil.copytree(base_dir, os.path.join(tmp, "base"))
        meta = {**meta, "base_model": "base"}  # relative: the folder can be moved
    with open(os.path.join(tmp, ADAPTER_META), "w") as f:
        json.dump(meta, f, indent=1)
    old = out + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


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
    """A tqdm bar per stage, metrics.jsonl, and TensorBoard when asked (rank 0 only: `enabled`). The bar's
    postfix holds the last step's reward and pass rate and the phase now running (a step can take a minute
    on a CPU); `verbose` also prints every step's full line."""

    KEYS = ("reward_mean", "pass_rate", "entropy", "clipfrac", "approx_kl", "logp_gap", "gap_clip_share",
            "explained_variance",
            "heldout_explained_variance", "heldout_ev_final_reward", "sft_nll", "v_loss", "n_kept", "gen_tok_s",
            "train_tok_s")
    SHORT = {"reward_mean": "reward", "pass_rate": "pass", "heldout_explained_variance": "ev_heldout",
             "explained_variance": "ev", "sft_nll": "nll", "v_loss": "v_loss", "n_kept": "kept",
             "logp_gap": "gap", "gap_clip_share": "gap_clip"}

    def __init__(self, run_dir: str, tensorboard: bool, enabled: bool, verbose: bool = False):
        self.path, self.enabled, self.t0, self.tb = os.path.join(run_dir, "metrics.jsonl"), enabled, time.time(), None
        self.verbose, self.bar, self.post = verbose, None, {}
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency, behind --tensorboard
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def start_stage(self, stage: int, total: int, initial: int = 0) -> None:
        self.close()
        if self.enabled:
            self.bar = tqdm(total=max(total, initial), initial=initial, desc=f"{stage}) {STAGES[stage]}",
                            unit="step", dynamic_ncols=True)
            self.post = {}

    def phase(self, name: str) -> None:
        """Show what the current step is doing (rollout, update, ...) in the bar's postfix."""
        if self.bar is not None:
            self.bar.set_postfix(self.post | {"now": name})

    def write(self, line: str) -> None:
        (self.bar.write if self.bar is not None else print)(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log(self, stage: int, step: int, m: dict) -> None:
        if not self.enabled:
            return
        row = {"stage": stage, "stage_name": STAGES[stage], "step": step, "time_s": round(time.time() - self.t0, 2),
               **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in m.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        nums = {k: m[k] for k in self.KEYS if isinstance(m.get(k), (int, float))}
        if self.verbose:
            self.write(f"[{stage}) {STAGES[stage]:7s} step {step:3d}] " +
                       " ".join(f"{k} {v:.3g}" for k, v in nums.items()) + f" | {row['time_s']:.0f}s")
        if self.bar is not None:
            self.post = {self.SHORT[k]: f"{v:.3g}" for k, v in nums.items() if k in self.SHORT}
            self.bar.set_postfix(self.post)
            self.bar.update(1)
        if self.tb:
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{STAGES[stage]}/{k}", v, step)


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def _fmt(v, spec: str = ".2f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and v == v else "-"


def summary(run_dir: str) -> str:
    """The end-of-run table: per stage its steps, mean reward over the first half of its steps -> over the
    last half, pass rate (mean over steps, of policy and demo episodes alike), RFT trajectories kept,
    explained variance (stage 3: held-out) and seconds."""
    rows, out, t_prev = _rows(run_dir), [], 0.0
    out.append(f"{'stage':12s} {'steps':>5s} {'reward 1st->2nd half':>20s} {'pass':>5s} {'kept':>5s} "
               f"{'expl.var':>8s} {'seconds':>8s}")
    for s, name in STAGES.items():
        rs = [r for r in rows if r["stage"] == s]
        if not rs:
            continue
        rew = [r["reward_mean"] for r in rs if "reward_mean" in r]
        passes = [r["pass_rate"] for r in rs if "pass_rate" in r]
        kept = next((r["n_kept"] for r in rs if "n_kept" in r), None)
        ev = rs[-1].get("heldout_explained_variance", rs[-1].get("explained_variance"))
        k = max(1, len(rew) // 2)   # half-stage means: one batch's reward mostly reflects its samples
        first_last = f"{_fmt(sum(rew[:k]) / k, '+.2f')} -> {_fmt(sum(rew[-k:]) / k, '+.2f')}" if rew else "-"
        secs = rs[-1]["time_s"] - min(t_prev, rs[0]["time_s"])
        t_prev = rs[-1]["time_s"]
        pass_mean = sum(passes) / len(passes) if passes else None
        out.append(f"{f'{s}) {name}':12s} {len(rs):5d} {first_last:>20s} {_fmt(pass_mean):>5s} "
                   f"{_fmt(kept, '.0f'):>5s} {_fmt(ev):>8s} {secs:8.0f}")
    return "\n".join(out + _stage4_tasks(run_dir))


def _stage4_tasks(run_dir: str) -> list[str]:
    """Below the table: stage 4's probe and the tasks it chose (train.agent_tasks, OUT/stage4_tasks.json), and
    per task its correct episodes in the first half of stage 4's steps -> the second half (rollouts/s4_*)."""
    out, path = [], os.path.join(run_dir, "stage4_tasks.json")
    if os.path.exists(path):
        with open(path) as f:
            p = json.load(f)
        n = sum(b for _, b in p["probe"].values()) // max(1, len(p["probe"]))
        out.append(f"stage 4 trained on {len(p['tasks'])} of {len(p['probe'])} tasks, those passed in some but not "
                   f"all of {n} probe episodes: " + ", ".join(f"{k[:8]} {a}/{b}{'*' if k in p['tasks'] else ''}"
                                                              for k, (a, b) in p["probe"].items()))
    steps: dict[int, list] = {}
    d = os.path.join(run_dir, "rollouts")
    for fn in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if fn.startswith("s4_") and fn.endswith(".jsonl"):
            with open(os.path.join(d, fn)) as f:
                steps.setdefault(int(fn.split("_")[1]), []).extend(json.loads(x) for x in f if x.strip())
    if steps:
        order, k = sorted(steps), max(1, len(steps) // 2)
        per: dict[str, list[int]] = {}
        for half, keys in enumerate((order[:k], order[-k:])):
            for r in (r for s in keys for r in steps[s] if r.get("source", "policy") == "policy"):
                c = per.setdefault(r["task"], [0, 0, 0, 0])
                c[2 * half] += bool((r.get("final_verdict") or {}).get("correct"))
                c[2 * half + 1] += 1
        out.append("stage 4 correct per task, 1st -> 2nd half: " +
                   ", ".join(f"{t[:8]} {a}/{b} -> {c}/{d}" for t, (a, b, c, d) in per.items()))
    return out


def mark_stages(ax, bounds: list[tuple[int, int, str]], demo_share: dict | None = None) -> None:
    """Dashed lines between stages, each stage's name at the top, and grey shading over the steps whose
    batches held demonstrations ("demos 25% of batch"). bounds: (first x, last x, label) per stage;
    demo_share: stage label -> share. Also usable by any plot over logged steps."""
    for i, (x0, x1, label) in enumerate(bounds):
        if i:
            ax.axvline(x0 - 0.5, color="grey", ls="--", lw=0.8)
        ax.text((x0 + x1) / 2, 1.0, label, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                fontsize=8)
        share = (demo_share or {}).get(label)
        if share == 0:  # the stage rolls out the policy alone: a drop here is the demonstrations leaving
            ax.text((x0 + x1) / 2, 0.97, "no demos", transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=7, color="dimgrey")
        elif share:
            ax.axvspan(x0 - 0.5, x1 + 0.5, color="grey", alpha=0.12, lw=0)
            ax.text((x0 + x1) / 2, 0.97, f"demos {share:.0%}\nof batch", transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=7, color="dimgrey")


def _series(rows: list[dict], key) -> tuple[list[tuple[int, float]], list[tuple[int, int, str]], list[int]]:
    """The rows where `key(row)` is a number, on their own axis (x = 0, 1, ...): (points, stage bounds, the
    stage of each point). A panel then spends no width on steps that did not log it (stage 2's 80 SFT steps
    have no rollout; stages 1 and 4 have no SFT loss)."""
    pts, stages = [], []
    for r in rows:
        v = key(r)
        if isinstance(v, (int, float)) and v == v:
            pts.append((len(pts), float(v)))
            stages.append(r["stage"])
    bounds = []
    for s in STAGES:
        xs = [x for (x, _), st in zip(pts, stages) if st == s]
        if xs:
            bounds.append((xs[0], xs[-1], f"{s}) {STAGES[s]}"))
    return pts, bounds, stages


def plot_curves(run_dir: str) -> str:
    """curves.png, three panels, each over the steps that logged what it shows. Left: reward mean (Eq. 1
    tiers -1..3, fixed y-limits) and pass rate (right axis) per rollout batch, the batches that mixed in
    demonstrations shaded (the drop when they stop is not the policy); middle: stage 2's SFT loss on the
    kept trajectories (log scale); right: the critic's explained variance (stage 3: held-out)."""
    rows = _rows(run_dir)
    fig, (ax, ax_sft, ax_ev) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [3, 2, 2]})
    ax_pass = ax.twinx()
    rew, bounds, stages = _series(rows, lambda r: r.get("reward_mean"))
    share = {}
    for s in STAGES:
        shares = [r.get("n_demo", 0) / r["n"] for r in rows if r["stage"] == s and r.get("n")]
        share[f"{s}) {STAGES[s]}"] = max(shares) if shares else None
    rolled = [r for r in rows if isinstance(r.get("reward_mean"), (int, float))
              and r["reward_mean"] == r["reward_mean"]]   # the rows behind `rew`, in the same order
    for s in STAGES:   # one line per stage: a line across a boundary would join unrelated batches
        on = [i for i, st in enumerate(stages) if st == s]
        pas = [(i, rolled[i]["pass_rate"]) for i in on if isinstance(rolled[i].get("pass_rate"), (int, float))]
        if on:
            ax.plot([rew[i][0] for i in on], [rew[i][1] for i in on], marker="o", color="C0",
                    label="reward mean" if not ax.lines else None)
        if pas:
            ax_pass.plot(*zip(*pas), marker="s", ls=":", color="C2", label="pass rate" if not ax_pass.lines else None)
    ax.set_ylim(-1.2, 3.2)
    ax.set_yticks([-1, 0, 1, 2, 3])
    ax.set_ylabel("reward mean (Eq. 1)")
    ax_pass.set_ylim(-0.05, 1.05)
    ax_pass.set_ylabel("pass rate (correct share)", color="C2")
    mark_stages(ax, bounds, share)
    ax.set_xlabel("rollout batch (stages 1, 2's collection, 4)")
    ax.set_title("reward (-1 fail, 1 correct, 2 > eager, 3 > compile) and pass rate", pad=16)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax_pass.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center left", fontsize=8)
    sft, sft_bounds, _ = _series(rows, lambda r: r.get("sft_nll"))
    if sft:
        ax_sft.plot(*zip(*sft), color="C3")
        ax_sft.set_yscale("log")
        mark_stages(ax_sft, sft_bounds)
    ax_sft.set_xlabel("SFT step")
    ax_sft.set_ylabel("NLL per action token")
    ax_sft.set_title("stage 2: imitation loss on the kept trajectories", pad=16)
    ev, ev_bounds, ev_stages = _series(rows, lambda r: r.get("heldout_explained_variance",
                                                             r.get("explained_variance")))
    for s in STAGES:
        on = [p for p, st in zip(ev, ev_stages) if st == s]
        if on:
            ax_ev.plot(*zip(*on), marker="o", color=f"C{s - 1}")
    ax_ev.set_ylim(bottom=min(-1.0, ax_ev.get_ylim()[0]), top=1.05)
    ax_ev.axhline(0, color="grey", lw=0.6)
    ax_ev.set_ylabel("explained variance (1 = perfect, 0 = mean)")
    mark_stages(ax_ev, ev_bounds)
    ax_ev.set_xlabel("PPO step (stages 1, 3, 4)")
    ax_ev.set_title("critic explained variance (stage 3: held-out)", pad=16)
    for a in (ax, ax_sft, ax_ev):
        a.xaxis.get_major_locator().set_params(integer=True)
    path = os.path.join(run_dir, "curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
