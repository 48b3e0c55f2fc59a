"""RL training (paper §3.3, §4.1): LoRA PPO with a critic on an open MoE, RFT warm-up, value pretraining.

What it does
  * Pure math, tested against hand-computed references (tests/test_ppo.py): token-level GAE (`compute_gae`,
    gamma 1, lambda 0.95, reward on the last policy token, V(s_T) = 0, multi-turn gaps skipped), the clipped
    policy loss with clip-higher (`ppo_policy_loss`, eps 0.2 / 0.28, averaged over each trajectory's tokens,
    then over trajectories), the value loss against V + A (`value_loss`), masks, whitening, explained
    variance, entropy, and the RFT filter (`rft_filter`).
  * Models: one frozen base and two LoRA adapters on one PeftModel, "actor" and "critic" (switched with
    set_adapter), plus a scalar value head on the critic's last hidden state. The reference policy for the
    optional KL is the base with adapters disabled. LoRA reaches attention and the fused 3-D MoE experts of
    transformers 5 (peft `target_parameters`). One copy of the base weights.
  * `train(cfg)`: the four stages in order, each resumable from an atomic checkpoint (run_dir/checkpoint.pt):
      1) single-turn PPO warm-up (env single-turn mode);
      2) agent trajectories with that policy, `rft_filter`, SFT on the action tokens (RFT);
      3) value pretraining: critic fitted to GAE targets on the stage-2 trajectories, actor frozen;
         explained variance reported on held-out trajectories;
      4) agentic PPO.
    Rollouts are real: env.run_episodes with policy.HFPolicy over the actor, verdicts from the sandbox pool,
    rewards from reward.py (Eq. 1 milestones, or `--reward speedup`).
  * Logging: one line per step, run_dir/metrics.jsonl, every rollout in run_dir/rollouts/*.jsonl (demos
    flagged source=demo), optional TensorBoard (--tensorboard), run_dir/curves.png at the end.

Ablations (each one flag; the default is the paper's recipe): --rft-steps 0, --value-pretrain-steps 0,
--reward speedup, --max-turns 1 (no agent loop: stages 2 and 4 run single-turn), --kl-coef, --lora-rank,
--lora-targets.

Departures from the paper
  1. LoRA (both adapters on one frozen base) instead of full fine-tuning, and hence our own learning rates:
     actor 3e-5, critic 6e-5 in the paper preset (~10x the paper's full-FT 3e-6 / 6e-6, the usual LoRA
     factor, keeping the paper's 1:2 actor:critic ratio); a fresh value head at 1e-4. Rank 16, alpha 32:
     peft's LoRA on fused experts is per expert (A: (E*r, in), B: (out, E*r)), so on Qwen3-30B-A3B one
     rank unit costs ~39M parameters per adapter (attention: ~0.8M); r = 16 gives ~0.63B per adapter,
     ~20 GB with fp32 weights, gradients and AdamW moments for both adapters, next to 61 GB of bf16 base.
  2. The paper's base (Seed1.6, 23B/230B MoE) is not public. `--preset paper` uses
     Qwen/Qwen3-Coder-30B-A3B-Instruct: an open MoE of the same family (fine-grained experts, 3B active of
     30B), trained for agentic coding with tool calls, 256k context (stage 4 needs 128k), LoRA-trainable on
     one node. It is loaded with the real HF code (policy.load_policy_model).
  3. The tiny preset (the default) builds a random ~0.4M-parameter Qwen3-MoE with a local tokenizer
     (policy.build_tiny_model_and_tokenizer), so everything runs offline on a CPU. A random model never
     writes a correct kernel, so RFT would have nothing with reward > 0: the tiny preset mixes shipped
     demonstration solutions (data/demos/<task hash>/<backend>/, from synth.py) into the stage-1 and stage-2
     rollout batches (`--demo-fraction`, 25%), rendered through the same env with policy.ReplayPolicy and
     flagged `source: demo` in the logs and rollout files. Demos are trained on exactly like policy samples
     (their old log-probs are the current actor's, i.e. importance weight 1 at the first epoch). The paper
     preset has no demos.
  4. Old log-probs are recomputed by the trainer (not taken from the rollout engine), which removes the
     train/inference mismatch that §3.3 blames for ratio explosions; the sampled log-probs stay in the
     rollout files for comparison.
  5. Not stated in the paper, so ours: advantage whitening over the batch (on), PPO epochs / minibatches
     (paper preset: 1 / 1, "one update per batch"), no entropy bonus, no KL (flag), fresh AdamW per stage,
     stage lengths of stages 1-3 in the paper preset (50 / 200 SFT steps on 1024 rollouts / 50). One
     context budget (--max-context, 128k in the paper preset) for the single-turn and agentic stages.
  6. Multi-GPU: `accelerate launch` runs one process per training GPU (data parallel over trajectories);
     LoRA and value-head gradients are all-reduced by hand (actor and critic share one PeftModel, which
     DDP cannot wrap: each forward uses a different adapter). The sandbox gets its own GPUs
     (--sandbox-gpus, split between ranks). Stage-3 held-out explained variance is averaged over ranks.
  7. Stage 3's critic targets are GAE returns recomputed from the current critic at each step (TD(lambda)
     style), not fixed Monte-Carlo returns; with gamma 1 and lambda 0.95 they are close.

Smoke: python cuda_agent.py train                  (tiny preset, CPU, offline; ~5-10 min on 2 busy cores)
       python -m pytest -q tests/test_ppo.py tests/test_ppo_learning.py
Full:  accelerate launch --num_processes 6 cuda_agent.py train --preset paper --sandbox-gpus 6,7
GPU bench: python scripts/bench_ppo.py             (Qwen3-30B-A3B shape, random weights, one H200)
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field

import numpy as np
import torch

@dataclass
class TrainConfig:
    preset: str = "tiny"
    """preset the other defaults came from: tiny (CPU, offline, minutes) | paper (the paper's recipe, GPU node)"""
    run_dir: str = "runs/tiny"
    """run directory: checkpoints, metrics.jsonl, rollouts/*.jsonl, curves.png"""
    resume: bool = False
    """pick up the last checkpoint in run_dir (stage and step included)"""
    seed: int = 0
    """the one seed (python, numpy, torch, sampling)"""
    model: str = "tiny"
    """tiny = random tiny Qwen3-MoE + local tokenizer (offline); else a HF hub id or local path"""
    tasks: str = "data/tasks_tiny.jsonl"
    """training tasks, anything synth.load_tasks accepts"""
    demos: str | None = "data/demos"
    """demo solutions (dir of <task hash>/<backend>/) mixed into stage 1/2 rollouts; none = off"""
    demo_fraction: float = 0.25
    """share of each stage-1 and stage-2 rollout batch filled with demonstration trajectories"""
    device: str = "auto"
    """training device: auto | cpu | cuda (with accelerate launch: the local rank's GPU)"""
    cpu_threads: int = 1
    """torch CPU threads; 1 avoids OpenMP oversubscription next to sandbox jobs (7-15x faster on a busy 2-core box)"""
    sandbox_device: str = "cpu"
    """where candidate kernels run: cpu (C++/OpenMP kernels) | cuda"""
    sandbox_gpus: list[int] = field(default_factory=list)
    """GPU ids set aside for the sandbox pool (never used for training), comma-separated"""
    sandbox_cpu_slots: int = 2
    """concurrent verify/profile jobs when sandbox_device is cpu (timing is noisier above 1)"""
    sandbox_prewarm: int = 8
    """cuda sandbox: before stage 1, compile the torch.compile baselines of uncached tasks this many at a time
    (sandbox.prewarm), instead of one at a time inside timed checks; 0 = off"""
    bf16: bool = False
    """bf16 weights and activations (GPU)"""
    grad_checkpointing: bool = False
    """gradient checkpointing of the base model (GPU, long contexts)"""
    reward: str = "milestone"
    """milestone (Eq. 1: -1/1/2/3) | speedup (ablation: t_compile / t)"""
    max_turns: int = 4
    """agent turns per episode in stage 2 and 4 (paper: 150); 1 = no agent loop (single-turn ablation)"""
    max_new_tokens: int = 64
    """tokens sampled per assistant turn"""
    max_context: int = 4096
    """token budget per episode (paper: 32k single-turn, 128k agentic)"""
    temperature: float = 1.0
    """sampling temperature (log-probs in the loss use the same temperature)"""
    rollout_engine: bool = True
    """sample rollouts with generate.Engine (per-episode KV cache reused across turns, issue 7); off: the
    plain model.generate loop that re-encodes each conversation every turn"""
    lora_rank: int = 8
    """LoRA rank of both adapters"""
    lora_alpha: float = 16.0
    """LoRA alpha (scale = alpha / rank)"""
    lora_targets: str = "attention,experts"
    """comma-separated subset of attention | experts (fused 3-D MoE params) | mlp (dense MLP)"""
    lr_actor: float = 2e-3
    """actor LoRA learning rate (paper full fine-tuning: 3e-6; LoRA needs ~10x more)"""
    lr_critic: float = 4e-3
    """critic LoRA learning rate (paper full fine-tuning: 6e-6; we keep the paper's 2:1 critic:actor ratio)"""
    lr_head: float = 1e-2
    """learning rate of the freshly initialised scalar value head"""
    batch_size: int = 4
    """trajectories per PPO step, summed over ranks (paper: 1024)"""
    micro_batch_size: int = 2
    """trajectories per forward/backward (gradient accumulation; the loss is invariant to it)"""
    ppo_epochs: int = 2
    """passes over each batch (paper: "one update per batch" -> 1)"""
    num_minibatches: int = 2
    """optimizer steps per epoch (paper: 1)"""
    eps_low: float = 0.2
    """lower clip range of the ratio (Eq. 5)"""
    eps_high: float = 0.28
    """upper clip range of the ratio, clip-higher (Eq. 5)"""
    gamma: float = 1.0
    """GAE discount (paper: 1)"""
    lam: float = 0.95
    """GAE lambda (paper: 0.95)"""
    kl_coef: float = 0.0
    """KL(pi || base) penalty coefficient, k3 estimator (paper: not stated; 0 = off)"""
    entropy_coef: float = 0.0
    """entropy bonus (paper: not stated; 0 = off)"""
    vf_clip: float | None = None
    """value-loss clip range around the old values (none = unclipped)"""
    whiten_advantages: bool = True
    """whiten advantages over the batch (paper: not stated)"""
    max_grad_norm: float = 1.0
    """gradient-norm clip per optimizer"""
    warmup_steps: int = 2
    """stage 1: single-turn PPO warm-up steps"""
    rft_rollouts: int = 4
    """stage 2: agent trajectories collected with the warm-up policy (before filtering)"""
    rft_steps: int = 4
    """stage 2: SFT steps on the filtered trajectories; 0 = no RFT (ablation)"""
    rft_batch_size: int = 2
    """stage 2: trajectories per SFT step"""
    value_pretrain_steps: int = 4
    """stage 3: critic-only steps on the stage-2 trajectories; 0 = no value pretraining (ablation)"""
    value_heldout: float = 0.25
    """stage 3: share of the stage-2 trajectories held out to report explained variance"""
    agent_steps: int = 2
    """stage 4: agentic PPO steps (paper: 150)"""
    checkpoint_every: int = 1
    """write a checkpoint every N steps (and at the end of each stage)"""
    sample_every: int = 1
    """print one decoded sample trajectory every N steps"""
    tensorboard: bool = False
    """also log to TensorBoard (run_dir/tb)"""


# ----------------------------------------------------------------------------------------------------------
# Pure math. Every tensor is (B, T): B trajectories, T token positions. `mask` is 1.0 on policy (action)
# tokens and 0.0 on prompt, observation (tool output) and padding tokens. Per-token quantities are aligned
# to the token they describe: logp[:, t] = log pi(token_t | tokens_<t), values[:, t] = V(tokens_<t), the
# value of the state in which token_t is chosen.


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask == 1 (over all positions, or along `dim`)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over masked positions (Bessel-corrected by default)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked positions; masked-out positions are returned as 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over masked positions (paper Fig. 5's critic signal).

    1 = perfect critic, 0 = no better than a constant, < 0 = worse than a constant. NaN if Var[returns] = 0.
    """
    var_r = masked_var(returns, mask)
    if var_r.item() == 0.0:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask) / var_r)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE (Eq. 5, §4.1: gamma = 1, lambda = 0.95). Returns (advantages, returns), both (B, T).

    Steps are the masked (policy) positions only, in order. For the step at position t, let t' be the
    next masked position in the same row (none: the episode ended, V(s_T) = 0):
        delta_t = r_t + gamma * V[t'] - V[t],     A_t = delta_t + gamma * lam * A_t'
    Multi-turn gaps: observation tokens between two turns are not steps. They are skipped, with no
    discount and no reward: the bootstrap for the last token of turn k is the value at the first policy
    token of turn k+1 (a state that already contains the tool output). Rewards off the mask must be 0
    (the paper puts the reward on the last policy token); this is asserted. Returns = A + V (the critic's
    target, §4.1); advantages and returns are 0 off the mask.
    """
    assert rewards.shape == values.shape == mask.shape, f"shapes differ: {rewards.shape} {values.shape} {mask.shape}"
    m = mask.to(values.dtype)
    assert (rewards * (1 - m)).abs().sum() == 0, "rewards must sit on policy tokens (mask == 1)"
    B, T = rewards.shape
    adv = torch.zeros_like(values)
    next_v = torch.zeros(B, dtype=values.dtype, device=values.device)  # V at the next step (0 past the end)
    next_a = torch.zeros(B, dtype=values.dtype, device=values.device)  # A at the next step
    for t in reversed(range(T)):  # O(T) python loop, vectorized over B
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        on = m[:, t] > 0
        adv[:, t] = torch.where(on, a, torch.zeros_like(a))
        next_v = torch.where(on, values[:, t], next_v)  # off-mask positions carry the next step through
        next_a = torch.where(on, a, next_a)
    return adv, (adv + values) * m


def _per_trajectory_then_batch(per_token: torch.Tensor, mask: torch.Tensor, num_traj: int | None) -> torch.Tensor:
    """§4.1: average over each trajectory's tokens, then over trajectories.

    `num_traj` is the number of trajectories in the FULL batch: with micro-batching + gradient accumulation,
    each micro-batch passes the full-batch count, so the accumulated gradient equals the full-batch one.
    Rows with an empty mask (nothing to train) contribute 0 and are not counted by default.
    """
    m = mask.to(per_token.dtype)
    n_tok = m.sum(-1)  # (B,)
    per_traj = (per_token * m).sum(-1) / n_tok.clamp(min=1.0)  # (B,)
    denom = num_traj if num_traj is not None else int((n_tok > 0).sum().item())
    return per_traj.sum() / max(denom, 1)


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    eps_low: float = 0.2, eps_high: float = 0.28, num_traj: int | None = None
                    ) -> tuple[torch.Tensor, dict]:
    """Clipped-ratio PPO loss with clip-higher (Eq. 5, §4.1: eps_low 0.2, eps_high 0.28).

    logp, old_logp, adv, mask: (B, T). Returns (scalar loss, stats) where stats has the token-mean
    `clipfrac` (share of tokens where the clipped branch is active) and `approx_kl` (k3 estimator,
    E[(r - 1) - log r], r = pi/pi_old, which is >= 0 and unbiased for KL(pi_old || pi)).
    """
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)  # (B, T)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(pg1, pg2)
    loss = _per_trajectory_then_batch(per_token, mask, num_traj)
    with torch.no_grad():
        clipfrac = masked_mean((pg2 > pg1).float(), mask)
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, mask)
    return loss, {"clipfrac": clipfrac.item(), "approx_kl": approx_kl.item()}


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               old_values: torch.Tensor | None = None, clip: float | None = None,
               num_traj: int | None = None) -> tuple[torch.Tensor, dict]:
    """0.5 * (V - (V_old + A))^2, aggregated like the policy loss. `returns` = V_old + A from compute_gae.

    With `clip` and `old_values`, the PPO2-style clipped value loss max((V-R)^2, (V_old + clip(V-V_old))-R)^2).
    Returns (scalar loss, {"vf_clipfrac": share of tokens where the clipped term is the larger}).
    """
    vl = (values - returns) ** 2
    vf_clipfrac = 0.0
    if clip is not None:
        assert old_values is not None, "value clipping needs old_values"
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        vl2 = (v_clipped - returns) ** 2
        vf_clipfrac = masked_mean((vl2 > vl).float(), mask).item()
        vl = torch.maximum(vl, vl2)
    return 0.5 * _per_trajectory_then_batch(vl, mask, num_traj), {"vf_clipfrac": vf_clipfrac}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
               num_traj: int | None = None) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token, aggregated like the policy loss (optional, --kl-coef)."""
    log_r = (ref_logp - logp) * mask
    return _per_trajectory_then_batch(torch.exp(log_r) - 1.0 - log_r, mask, num_traj)


# ----------------------------------------------------------------------------------------------------------
# RFT filter (§3.3 stage 2): keep trajectories with reward > 0, drop loops, redundant repeated calls and
# malformed tool calls.


def _call_key(call) -> str:
    """A hashable identity for one tool call: its name + arguments (the call id is ignored).

    Accepts OpenAI-format calls {"function": {"name", "arguments": JSON string}}, flat {"tool"/"name",
    "args"/"arguments"} dicts, or anything else (compared by its text)."""
    if not isinstance(call, dict):
        return str(call)
    f = call.get("function", call)
    name, args = f.get("name", f.get("tool")), f.get("arguments", f.get("args"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return json.dumps({"tool": name, "args": args}, sort_keys=True, default=str)


def _has_loop(keys: list[str], max_period: int, min_repeats: int) -> bool:
    """True if some block of 1..max_period calls repeats `min_repeats` times back to back."""
    n = len(keys)
    for p in range(1, max_period + 1):
        for start in range(0, n - p * min_repeats + 1):
            block = keys[start:start + p]
            if all(keys[start + k * p:start + (k + 1) * p] == block for k in range(1, min_repeats)):
                return True
    return False


def rft_filter(trajectories: list[dict], min_reward: float = 0.0, max_identical_calls: int | None = None,
               max_consecutive_identical: int = 1, loop_period: int = 4, loop_repeats: int = 3,
               max_invalid_calls: int = 0, drop_truncated: bool = False) -> list[dict]:
    """Return the trajectories worth imitating (§3.3 stage 2), in their original order.

    Each trajectory is a dict with `reward` (float) and `tool_calls`: a list of calls, each a dict
    {"tool", "args", "valid"} (or any object; `valid` defaults to True). Optional `truncated` (bool).
    A trajectory is dropped when:
      - reward <= min_reward;
      - it made more than `max_invalid_calls` invalid (malformed / unknown tool) calls;
      - the same call (tool + args) occurs more than `max_identical_calls` times in total (off by default:
        re-running the same compile/verify command after each edit is normal);
      - the same call occurs more than `max_consecutive_identical` times in a row (a redundant turn);
      - a block of 1..`loop_period` calls repeats `loop_repeats` times back to back (a loop);
      - `drop_truncated` and it hit the turn/length limit.
    """
    kept = []
    for tr in trajectories:
        if float(tr["reward"]) <= min_reward:
            continue
        if drop_truncated and tr.get("truncated", False):
            continue
        calls = tr.get("tool_calls", [])
        if sum(1 for c in calls if isinstance(c, dict) and not c.get("valid", True)) > max_invalid_calls:
            continue
        keys = [_call_key(c) for c in calls]
        if max_identical_calls is not None and keys and max(keys.count(k) for k in set(keys)) > max_identical_calls:
            continue
        run, worst = 1, 1 if keys else 0
        for a, b in zip(keys, keys[1:]):
            run = run + 1 if a == b else 1
            worst = max(worst, run)
        if worst > max_consecutive_identical:
            continue
        if _has_loop(keys, loop_period, loop_repeats):
            continue
        kept.append(tr)
    return kept


# ----------------------------------------------------------------------------------------------------------
# Models: one frozen base, two LoRA adapters ("actor", "critic") on the same PeftModel, a scalar value head.
# The reference policy for the optional KL is the base with adapters disabled: one copy of the base weights.

LORA_TARGETS = {
    "attention": {"modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "mlp": {"modules": ["gate_proj", "up_proj", "down_proj"]},  # dense MLPs (dense models, shared experts)
    # transformers 5 stores MoE experts as fused 3-D nn.Parameters (E, out, in), not nn.Linear:
    # peft reaches them through `target_parameters` (peft >= 0.17).
    "experts": {"params": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
}


def add_actor_critic_adapters(base, rank: int, alpha: float, targets: str, dropout: float = 0.0):
    """Wrap `base` in a PeftModel holding two fresh LoRA adapters, "actor" (active) and "critic".

    targets: comma-separated subset of LORA_TARGETS. Targets that the model does not have are dropped
    with a message; the peft version lacking `target_parameters` drops "experts" the same way.
    Returns (peft_model, info) where info = {"modules": n wrapped modules, "params": n wrapped 3-D params}.
    """
    from peft import LoraConfig, get_peft_model
    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in LORA_TARGETS]
    assert not unknown, f"unknown --lora-targets {unknown}; choose from {sorted(LORA_TARGETS)}"
    leaf = {n.rsplit(".", 1)[-1] for n, _ in base.named_modules()}
    pnames = [n for n, _ in base.named_parameters()]
    modules = [m for t in names for m in LORA_TARGETS[t].get("modules", []) if m in leaf]
    params = [p for t in names for p in LORA_TARGETS[t].get("params", []) if any(n.endswith(p) for n in pnames)]
    if params and "target_parameters" not in LoraConfig.__dataclass_fields__:
        print(f"[ppo] peft has no target_parameters (needs >= 0.17): experts stay frozen, LoRA on {modules}")
        params = []
    dropped = [t for t in names if not any(x in modules + params for x in
                                           LORA_TARGETS[t].get("modules", []) + LORA_TARGETS[t].get("params", []))]
    if dropped:
        print(f"[ppo] LoRA targets not present in this model (skipped): {dropped}")
    kw = {"target_parameters": params} if params else {}
    lc = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules or [], bias="none", **kw)
    model = get_peft_model(base, lc, adapter_name="actor")
    model.add_adapter("critic", lc)
    model.set_adapter("actor")
    n_mod = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A.actor"))
    info = {"modules": len([n for n, m in model.named_modules() if hasattr(m, "lora_A") and "actor" in m.lora_A
                            and not n.endswith("base_layer")]), "params": len(params), "lora_A": n_mod}
    assert n_mod > 0, f"LoRA targets {names} matched nothing in {type(base).__name__}"
    return model, info


def adapter_params(model, name: str) -> list[torch.nn.Parameter]:
    """The LoRA parameters of one adapter (by name), whatever peft's current requires_grad flags say."""
    ps = [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n + "."]
    assert ps, f"adapter {name!r} has no parameters"
    return ps


def build_models(cfg: "TrainConfig", device: torch.device):
    """(peft_model, value_head, tokenizer). cfg.model == "tiny": the random tiny Qwen3-MoE of policy.py
    (offline); else a hub id / local path loaded with the real HF code (policy.load_policy_model)."""
    import policy
    if cfg.model == "tiny":
        base, tok = policy.build_tiny_model_and_tokenizer(seed=cfg.seed)
    else:
        base, tok = policy.load_policy_model(cfg.model, dtype="bfloat16" if cfg.bf16 else "float32",
                                             device=str(device))
    base.to(device)
    for p in base.parameters():
        p.requires_grad_(False)
    if cfg.grad_checkpointing:
        # active in train mode only (the updates); rollouts run in eval mode and keep the KV cache
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, info = add_actor_critic_adapters(base, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    print(f"[ppo] LoRA r={cfg.lora_rank} on {info['modules']} modules + {info['params']} fused expert "
          f"param kinds; trainable per adapter: {sum(p.numel() for p in adapter_params(model, 'actor')):,}")
    head = torch.nn.Linear(base.config.hidden_size, 1).to(device)  # critic's scalar value head
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return model, head, tok


def _decoder(model):
    """The inner decoder stack of a PeftModel-wrapped causal LM (LoRA layers are injected in place)."""
    lm = model.get_base_model()
    return lm.model


def actor_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, temperature: float = 1.0,
                   adapter: str | None = "actor", with_entropy: bool = False):
    """logp[:, t] = log pi(ids[:, t] | ids[:, :t]) (B, T), 0 at t = 0; and entropy (B, T) if asked.

    adapter=None evaluates the reference policy (base, adapters disabled) for the optional KL.
    """
    if adapter is None:
        with model.disable_adapter():
            return actor_logprobs(model, ids, attn, temperature, "__none__", with_entropy)
    if adapter != "__none__":
        model.set_adapter(adapter)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
    logits = logits / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    logp = torch.nn.functional.pad(logp, (1, 0))
    ent = torch.nn.functional.pad(entropy_from_logits(logits), (1, 0)) if with_entropy else None
    return logp, ent


def critic_values(model, head: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """values[:, t] = V(ids[:, :t]) (B, T): the value head on the critic's last hidden state at t - 1."""
    model.set_adapter("critic")
    h = _decoder(model)(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # (B, T, H)
    v = head(h.to(head.weight.dtype)).squeeze(-1)  # (B, T): value after reading token t
    return torch.nn.functional.pad(v[:, :-1], (1, 0))


# ----------------------------------------------------------------------------------------------------------
# Batches. A sample is a dict with 1-D lists "input_ids", "mask" (1 on policy tokens) and a float "reward"
# (placed on the last policy token, §3 Eq. 1). Optional per-sample tensors are added during an update.


def _pad(rows: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """Right-pad 1-D tensors to (B, T_max)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def collate(samples: list[dict], pad_id: int, device) -> dict:
    """input_ids, attn, mask, rewards: (B, T) tensors on `device`; reward on each row's last policy token."""
    ids = [torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples]
    mask = [torch.as_tensor(s["mask"], dtype=torch.float32) for s in samples]
    rew = []
    for s, m in zip(samples, mask):
        assert m.sum() > 0, "a sample with an empty policy mask cannot be trained on"
        r = torch.zeros_like(m)
        r[int(m.nonzero()[-1])] = float(s["reward"])  # Eq. 1 reward on the last policy token
        rew.append(r)
    b = {"input_ids": _pad(ids, pad_id), "attn": _pad([torch.ones_like(i) for i in ids]),
         "mask": _pad(mask), "rewards": _pad(rew)}
    return {k: v.to(device) for k, v in b.items()}


def _chunks(xs: list, n: int) -> list[list]:
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def _all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Data parallel: sum LoRA/head gradients over ranks (losses are already divided by the global count).
    Done by hand rather than DDP because actor and critic share one PeftModel (different params per forward).
    One flat all-reduce, not one per parameter: a parameter can have a gradient on one rank and none on
    another (an unrouted expert), and per-parameter calls would then pair different tensors across ranks.
    A parameter no rank touched keeps grad None, so the optimizer skips it as it would on one process."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1) or not params:
        return
    dev = params[0].device
    has = torch.tensor([float(p.grad is not None) for p in params], device=dev)
    flat = torch.cat([has] + [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                              for p in params])
    dist.all_reduce(flat)
    off = len(params)
    for i, p in enumerate(params):
        n = p.numel()
        if flat[i] > 0:
            p.grad = flat[off:off + n].view_as(p).to(p.dtype).clone()
        off += n


def _global_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


# ----------------------------------------------------------------------------------------------------------
# Updates. `samples` is this rank's share of the batch; `n_global` the batch size over all ranks.


@torch.no_grad()
def score_batch(model, head, samples: list[dict], cfg, pad_id: int, device, need_logp: bool = True) -> dict:
    """Old log-probs, old values, GAE advantages and returns for every sample (stored on it as 1-D tensors
    under "_old_logp", "_values", "_adv", "_ret", "_ref_logp"). Advantages are whitened over the whole batch
    (all ranks) when cfg.whiten_advantages. Returns {"explained_variance", "value_mean", "adv_mean"}."""
    allv, allr, allm = [], [], []
    for micro in _chunks(samples, cfg.micro_batch_size):
        b = collate(micro, pad_id, device)
        values = critic_values(model, head, b["input_ids"], b["attn"])  # (B, T)
        adv, ret = compute_gae(b["rewards"], values, b["mask"], cfg.gamma, cfg.lam)  # (B, T) each, Eq. 5
        old = actor_logprobs(model, b["input_ids"], b["attn"], cfg.temperature)[0] if need_logp else None
        ref = actor_logprobs(model, b["input_ids"], b["attn"], cfg.temperature, adapter=None)[0] \
            if need_logp and cfg.kl_coef > 0 else None
        for i, s in enumerate(micro):
            n = len(s["input_ids"])
            s["_values"], s["_adv"], s["_ret"] = values[i, :n], adv[i, :n], ret[i, :n]
            if old is not None:
                s["_old_logp"] = old[i, :n]
            if ref is not None:
                s["_ref_logp"] = ref[i, :n]
        allv.append(values[b["mask"] > 0])
        allr.append(ret[b["mask"] > 0])
        allm.append(adv[b["mask"] > 0])
    v, r, a = torch.cat(allv), torch.cat(allr), torch.cat(allm)
    if cfg.whiten_advantages:  # batch-level whitening over all ranks (our choice; the paper does not say)
        s = _global_sum(torch.stack([a.sum(), (a * a).sum(), torch.tensor(float(a.numel()), device=a.device)]))
        mean = s[0] / s[2]
        std = (s[1] / s[2] - mean ** 2).clamp(min=0).sqrt()
        for smp in samples:
            m = torch.as_tensor(smp["mask"], device=device, dtype=torch.float32)
            smp["_adv"] = (smp["_adv"] - mean) / (std + 1e-8) * m
    ones = torch.ones_like(v)
    return {"explained_variance": explained_variance(v, r, ones) if v.numel() > 1 else float("nan"),
            "value_mean": v.mean().item(), "return_mean": r.mean().item(), "adv_mean": a.mean().item()}


def _stack(micro: list[dict], key: str, device) -> torch.Tensor:
    return _pad([s[key] for s in micro]).to(device)


def ppo_update(model, head, opt: dict, samples: list[dict], cfg, pad_id: int, device, n_global: int,
               train_actor: bool = True, train_critic: bool = True) -> dict:
    """PPO epochs over already-scored samples (score_batch): clipped policy loss (+ optional KL to the
    base, + optional entropy bonus) on the actor, value loss on the critic. One optimizer step per
    minibatch; micro-batches accumulate gradients with the full-minibatch trajectory count (§4.1 mean)."""
    stats: dict[str, list[float]] = {}
    world = max(1, n_global // max(1, len(samples)))
    actor_ps, critic_ps = adapter_params(model, "actor"), adapter_params(model, "critic") + list(head.parameters())
    model.train()  # gradient checkpointing (if enabled) is active in train mode; LoRA dropout is 0
    for _epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(len(samples)).tolist()
        for mb_idx in _chunks(perm, max(1, -(-len(samples) // cfg.num_minibatches))):
            mb = [samples[i] for i in mb_idx]
            n_traj = len(mb) * world  # trajectories in this minibatch over all ranks
            for o in opt.values():
                o.zero_grad(set_to_none=True)
            for micro in _chunks(mb, cfg.micro_batch_size):
                b = collate(micro, pad_id, device)
                if train_actor:
                    logp, ent = actor_logprobs(model, b["input_ids"], b["attn"], cfg.temperature, with_entropy=True)
                    pg, st = ppo_policy_loss(logp, _stack(micro, "_old_logp", device), _stack(micro, "_adv", device),
                                             b["mask"], cfg.eps_low, cfg.eps_high, num_traj=n_traj)
                    loss = pg
                    if cfg.kl_coef > 0:
                        kl = kl_penalty(logp, _stack(micro, "_ref_logp", device), b["mask"], num_traj=n_traj)
                        loss = loss + cfg.kl_coef * kl
                        stats.setdefault("kl_ref", []).append(kl.item() * n_traj / len(micro))
                    ent_mean = _per_trajectory_then_batch(ent, b["mask"], n_traj)
                    if cfg.entropy_coef > 0:
                        loss = loss - cfg.entropy_coef * ent_mean
                    loss.backward()
                    for k, v in (("pg_loss", pg.item() * n_traj / len(micro)), ("clipfrac", st["clipfrac"]),
                                 ("approx_kl", st["approx_kl"]), ("entropy", ent_mean.item() * n_traj / len(micro))):
                        stats.setdefault(k, []).append(v)
                if train_critic:
                    v = critic_values(model, head, b["input_ids"], b["attn"])
                    vl, vst = value_loss(v, _stack(micro, "_ret", device), b["mask"], _stack(micro, "_values", device),
                                         cfg.vf_clip, num_traj=n_traj)
                    vl.backward()
                    stats.setdefault("v_loss", []).append(vl.item() * n_traj / len(micro))
            for name, ps in (("actor", actor_ps), ("critic", critic_ps)):
                if (name == "actor" and train_actor) or (name == "critic" and train_critic):
                    _all_reduce_grads(ps)
                    gn = torch.nn.utils.clip_grad_norm_(ps, cfg.max_grad_norm)
                    stats.setdefault(f"grad_norm_{name}", []).append(gn.item())
                    opt[name].step()
    return {k: sum(v) / len(v) for k, v in stats.items()}


def sft_update(model, opt_actor, samples: list[dict], cfg, pad_id: int, device, n_global: int) -> dict:
    """One RFT step (§3.3 stage 2): next-token NLL on the action tokens only (mask == 1), averaged per
    trajectory then over trajectories; one optimizer step over `samples` (micro-batched)."""
    world = max(1, n_global // max(1, len(samples)))
    model.train()
    opt_actor.zero_grad(set_to_none=True)
    nll_sum = 0.0
    for micro in _chunks(samples, cfg.micro_batch_size):
        b = collate(micro, pad_id, device)
        logp, _ = actor_logprobs(model, b["input_ids"], b["attn"], cfg.temperature)
        loss = _per_trajectory_then_batch(-logp, b["mask"], len(samples) * world)
        loss.backward()
        nll_sum += loss.item()
    ps = adapter_params(model, "actor")
    _all_reduce_grads(ps)
    gn = torch.nn.utils.clip_grad_norm_(ps, cfg.max_grad_norm)
    opt_actor.step()
    return {"sft_nll": nll_sum * world, "grad_norm_actor": gn.item()}


def make_optimizers(model, head, cfg) -> dict:
    """AdamW per role: actor LoRA at lr_actor; critic LoRA at lr_critic and the fresh value head at lr_head."""
    return {"actor": torch.optim.AdamW(adapter_params(model, "actor"), lr=cfg.lr_actor, weight_decay=0.0),
            "critic": torch.optim.AdamW([{"params": adapter_params(model, "critic"), "lr": cfg.lr_critic},
                                         {"params": list(head.parameters()), "lr": cfg.lr_head}], weight_decay=0.0)}


# ----------------------------------------------------------------------------------------------------------
# Rollouts through the real agent environment (env.run_episodes) and the sandbox pool.

STAGES = {1: "warmup", 2: "rft", 3: "value", 4: "agentic"}


def load_demos(demos_dir: str | None, tasks: list[dict], backend: str) -> list[tuple[dict, dict[str, str]]]:
    """[(task, {relative path: text})] for every task with a shipped demo at demos_dir/<task hash>/<backend>/."""
    out = []
    if not demos_dir or not os.path.isdir(demos_dir):
        return out
    for t in tasks:
        root = os.path.join(demos_dir, str(t.get("hash")), backend)
        if not os.path.isdir(root):
            continue
        files = {}
        for d, _, names in os.walk(root):
            for n in sorted(names):
                with open(os.path.join(d, n)) as f:
                    files[os.path.relpath(os.path.join(d, n), root)] = f.read()
        out.append((t, files))
    return out


def demo_script(files: dict[str, str], single_turn: bool) -> list[dict]:
    """The assistant messages that play a demonstration back through env + ReplayPolicy: single-turn, one
    response with a fenced block per file (env.SINGLE_TURN_FORMAT); agentic, write every file + compile +
    verify in turn 1, profile in turn 2, finish in turn 3."""
    if single_turn:
        lang = {".py": "python", ".cu": "cuda", ".cpp": "cpp"}
        blocks = [f"```{lang.get(os.path.splitext(p)[1], '')} {p}\n{t if t.endswith(chr(10)) else t + chr(10)}```"
                  for p, t in sorted(files.items())]
        return [{"content": "\n".join(blocks)}]
    call = lambda name, **a: {"type": "function", "function": {"name": name, "arguments": json.dumps(a)}}  # noqa
    writes = [call("write_file", path=p, content=t) for p, t in sorted(files.items())]
    return [{"content": "", "tool_calls": writes + [call("compile"), call("verify")]},
            {"content": "", "tool_calls": [call("profile")]},
            {"content": "", "tool_calls": [call("finish")]}]


def collect(model, tok, tasks, demos, n: int, n_demo: int, single_turn: bool, cfg, pool, work_dir: str,
            rng: random.Random) -> list[dict]:
    """Run n episodes: n - n_demo sampled from the actor, n_demo demonstrations replayed through the same env.
    Returns records {"traj": env.Trajectory, "source": "policy" | "demo"}."""
    import env
    import policy
    ecfg = env.EnvConfig(max_turns=1 if single_turn else cfg.max_turns, max_context_tokens=cfg.max_context,
                         single_turn=single_turn, device=cfg.sandbox_device, work_dir=work_dir,
                         tool_workers=4, final_check=True)
    out = []
    n_pol = n - n_demo
    model.eval()  # generation: KV cache on, gradient checkpointing off
    if n_pol > 0:
        model.set_adapter("actor")
        pol = policy.HFPolicy(model, tok, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              seed=rng.randrange(2 ** 31), engine=cfg.rollout_engine)  # fresh engine per update
        picks = [tasks[rng.randrange(len(tasks))] for _ in range(n_pol)]
        trajs = env.run_episodes(pol, [{"code": t["code"], "name": t.get("hash")} for t in picks], pool, ecfg,
                                 tokenizer=tok)
        out += [{"traj": t, "source": "policy"} for t in trajs]
    if n_demo > 0:
        picks = [demos[rng.randrange(len(demos))] for _ in range(n_demo)]
        scripts = {n_pol + i: demo_script(files, single_turn) for i, (_, files) in enumerate(picks)}
        trajs = env.run_episodes(policy.ReplayPolicy(scripts), [{"code": t["code"], "name": t.get("hash")}
                                                                  for t, _ in picks], pool, ecfg,
                                 tokenizer=tok, id_offset=n_pol)
        out += [{"traj": t, "source": "demo"} for t in trajs]
    shutil.rmtree(work_dir, ignore_errors=True)  # records keep the best workspace snapshot
    return out


def to_sample(rec: dict) -> dict:
    """A training sample (ids, mask, reward on the last policy token) from a rollout record."""
    t = rec["traj"]
    assert len(t.ids) == len(t.mask) and sum(t.mask) > 0, f"trajectory of {t.task} has no policy tokens"
    return {"input_ids": t.ids, "mask": t.mask, "reward": float(t.final_reward), "source": rec["source"]}


def rft_view(rec: dict) -> dict:
    """What rft_filter reads, from an env.Trajectory: reward, the tool calls (with validity), truncation."""
    t = rec["traj"]
    calls = []
    for turn in t.turns:
        calls += [{"tool": c["name"], "args": c["args_text"], "valid": c.get("error") is None} for c in turn["calls"]]
        calls += [{"tool": "<malformed>", "args": e, "valid": False} for e in turn.get("errors", [])]
    truncated = t.stop_reason in ("max_turns", "context") or any(x["finish_reason"] == "length" for x in t.turns)
    return {"reward": t.final_reward, "tool_calls": calls, "truncated": truncated, "rec": rec}


def rollout_metrics(recs: list[dict], seconds: float) -> dict:
    """Reward mean and -1/1/2/3 distribution, pass/faster rates, limit share, turns, generation tokens/s."""
    rs = [float(r["traj"].final_reward) for r in recs]
    vs = [r["traj"].final_verdict or {} for r in recs]
    m = {"reward_mean": sum(rs) / max(1, len(rs)), "n": len(rs), "n_demo": sum(r["source"] == "demo" for r in recs)}
    for tier in (-1, 1, 2, 3):
        m[f"r{tier}"] = sum(1 for r in rs if r == tier) / max(1, len(rs))
    m["pass_rate"] = sum(bool(v.get("correct")) for v in vs) / max(1, len(vs))
    m["faster_rate"] = sum(bool(v.get("correct")) and (v.get("speedup_compile") or 0) > 1 for v in vs) / max(1, len(vs))
    m["clipped_share"] = sum(rft_view(r)["truncated"] for r in recs) / max(1, len(recs))
    m["turns"] = sum(len(r["traj"].turns) for r in recs) / max(1, len(recs))
    gen = sum(sum(r["traj"].mask) for r in recs if r["source"] == "policy")
    m["gen_tok_s"] = gen / max(seconds, 1e-9)
    return m


def write_rollouts(path: str, recs: list[dict], stage: int, step: int) -> None:
    """Every rollout to JSONL (style principle 9), with its source (policy | demo) and stage/step."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in recs:
            d = dataclasses.asdict(r["traj"])
            d.update(source=r["source"], stage=stage, step=step)
            f.write(json.dumps(d) + "\n")


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: adapters, value head, optimizers, RNG, stage, step, resolved config; tmp file + os.replace.


def save_checkpoint(run_dir: str, model, head, opt: dict, stage: int, step: int, cfg) -> None:
    from peft import get_peft_model_state_dict
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
    from peft import set_peft_model_state_dict
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


def _truncate_metrics(path: str, stage: int, step: int) -> None:
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


# ----------------------------------------------------------------------------------------------------------
# The four stages (§3.3). `run` bundles what every stage uses; each stage resumes at `start` (finished steps).


@dataclass
class Run:
    cfg: TrainConfig
    model: object
    head: torch.nn.Module
    tok: object
    pool: object
    tasks: list
    demos: list
    logger: Logger
    device: torch.device
    rank: int = 0
    world: int = 1
    opt: dict = field(default_factory=dict)

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else 0


def _gather_mean(run: Run, m: dict, totals: tuple = ()) -> dict:
    """Average per-rank metric dicts over ranks (equal shards), for rank 0's log line; keys in `totals` are
    summed instead (counts over the whole batch)."""
    ms = _all_ranks(run, [m])
    return {k: sum(d.get(k, 0.0) for d in ms) / (1 if k in totals else len(ms)) if isinstance(v, (int, float))
            else v for k, v in m.items()}


def _local_demos(run: Run, n_local: int, fraction: float) -> int:
    """This rank's share of the demonstrations in a global batch of n_local * world episodes. The share is
    set over the global batch and dealt round-robin, so a 4-episode batch at 25% holds one demonstration
    on 2 ranks too (rounding per rank would give round(0.5) = 0 on each)."""
    if not run.demos:
        return 0
    n = round(n_local * run.world * fraction)
    return min(n_local, len(range(run.rank, n, run.world)))


def _all_ranks(run: Run, xs: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (identity on one process)."""
    if run.world == 1:
        return xs
    # torch.distributed directly: under torchrun on CPUs accelerate's state reported one process, and its
    # gather_object then returned only this rank's part (ranks that disagree on a count then deadlock)
    import torch.distributed as dist
    parts = [None] * run.world
    dist.all_gather_object(parts, xs)
    return [x for part in parts for x in part]


def _checkpoint(run: Run, stage: int, step: int, force: bool = False) -> None:
    if run.world > 1:
        import torch.distributed as dist
        dist.barrier()
        # data parallel by hand (_all_reduce_grads): every rank must hold the same weights, or rank 0's
        # checkpoint silently differs from what the others train. A checksum per role, compared to rank 0's.
        ps = [adapter_params(run.model, "actor"), adapter_params(run.model, "critic") + list(run.head.parameters())]
        mine = torch.stack([sum(p.detach().double().sum() for p in g) for g in ps]).to(run.device)
        ref = mine.clone()
        dist.broadcast(ref, 0)
        assert torch.allclose(mine, ref, rtol=1e-9, atol=0), f"rank {run.rank} diverged from rank 0: {mine} vs {ref}"
    if run.rank == 0 and (force or step % run.cfg.checkpoint_every == 0):
        save_checkpoint(run.cfg.run_dir, run.model, run.head, run.opt, stage, step, run.cfg)


def _print_sample(recs: list[dict], tok) -> None:
    """Now and then, look at a decoded sample: kernel RL fails in ways only samples show (principle 9)."""
    pol = [r for r in recs if r["source"] == "policy"] or recs
    t = pol[0]["traj"]
    text = tok.decode([i for i, m in zip(t.ids, t.mask) if m])[:300].replace("\n", "\\n")
    print(f"    sample [{pol[0]['source']}] {t.task} reward {t.final_reward}: {text!r}", flush=True)


def ppo_stage(run: Run, stage: int, n_steps: int, start: int, single_turn: bool, demo_fraction: float) -> None:
    """Stage 1 (single-turn warm-up) and stage 4 (agentic PPO): rollout -> reward -> GAE -> PPO -> log -> ckpt."""
    cfg = run.cfg
    n_local = max(1, cfg.batch_size // run.world)
    for step in range(start, n_steps):
        t0 = time.time()
        # 1) rollout: actor episodes (+ demonstrations in the tiny preset's warm-up), sandbox verdicts included
        n_demo = _local_demos(run, n_local, demo_fraction)
        wd = os.path.join(cfg.run_dir, "workspaces", f"s{stage}_{step}_r{run.rank}")
        recs = collect(run.model, run.tok, run.tasks, run.demos, n_local, n_demo, single_turn, cfg, run.pool, wd,
                       random)
        t_gen = time.time() - t0
        write_rollouts(os.path.join(cfg.run_dir, "rollouts", f"s{stage}_{step:04d}_r{run.rank}.jsonl"), recs,
                       stage, step)
        # 2) reward: Eq. 1 milestone (or --reward speedup) from the final sandbox verdict, on the last policy token
        samples = [to_sample(r) for r in recs]
        # 3) GAE: old log-probs (recomputed by the trainer), critic values, advantages and returns (Eq. 5)
        sc = score_batch(run.model, run.head, samples, cfg, run.pad_id, run.device)
        # 4) PPO epochs: clipped actor loss (clip-higher) + critic loss, per-trajectory-then-batch means
        t1 = time.time()
        st = ppo_update(run.model, run.head, run.opt, samples, cfg, run.pad_id, run.device, n_local * run.world)
        n_tok = sum(len(s["input_ids"]) for s in samples) * cfg.ppo_epochs * 2  # actor + critic passes
        # 5) log
        m = {**rollout_metrics(recs, t_gen), **sc, **st, "train_tok_s": n_tok / max(time.time() - t1, 1e-9)}
        m = _gather_mean(run, m)
        run.logger.log(stage, step, m)
        if run.rank == 0 and cfg.sample_every and step % cfg.sample_every == 0:
            _print_sample(recs, run.tok)
        # 6) checkpoint (step + 1 steps of this stage are finished)
        _checkpoint(run, stage, step + 1, force=step + 1 == n_steps)


def _rft_file(run: Run) -> str:
    return os.path.join(run.cfg.run_dir, f"stage2_trajectories_r{run.rank}.jsonl")


def load_stage2(run: Run) -> list[dict]:
    import env
    with open(_rft_file(run)) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    names = {f.name for f in dataclasses.fields(env.Trajectory)}
    return [{"traj": env.Trajectory(**{k: v for k, v in d.items() if k in names}), "source": d["source"]} for d in rows]


def rft_stage(run: Run, start: int) -> None:
    """Stage 2: agent trajectories from the warm-up policy (+ demos), rft_filter, SFT on action tokens.
    Step 0 collects (its trajectories are saved for stage 3 and for resume); steps 1..rft_steps are SFT."""
    cfg = run.cfg
    single_turn = cfg.max_turns == 1
    if start == 0:
        t0 = time.time()
        n_local = max(1, cfg.rft_rollouts // run.world)
        n_demo = _local_demos(run, n_local, cfg.demo_fraction)
        recs = collect(run.model, run.tok, run.tasks, run.demos, n_local, n_demo, single_turn, cfg, run.pool,
                       os.path.join(cfg.run_dir, "workspaces", f"s2_r{run.rank}"), random)
        write_rollouts(_rft_file(run) + ".tmp", recs, 2, 0)
        os.replace(_rft_file(run) + ".tmp", _rft_file(run))
        kept = [v["rec"] for v in rft_filter([rft_view(r) for r in recs])]
        m = {**rollout_metrics(recs, time.time() - t0), "n_kept": len(kept),
             "n_kept_demo": sum(r["source"] == "demo" for r in kept)}
        run.logger.log(2, 0, _gather_mean(run, m, totals=("n_kept", "n_kept_demo")))
        _checkpoint(run, 2, 1, force=True)
        start = 1
    recs = load_stage2(run)
    # data parallel: the filter keeps different counts on different ranks, so every rank pools all ranks'
    # kept trajectories and each step deals out one global batch in equal shards (equal shards keep the
    # gradient all-reduce in step on every rank; a short pool is sampled with replacement to fill them)
    kept = _all_ranks(run, [to_sample(v["rec"]) for v in rft_filter([rft_view(r) for r in recs])])
    if not kept and cfg.rft_steps > 0:
        print("[ppo] RFT: no trajectory passed the filter (reward > 0, no loops/invalid calls): SFT skipped")
        return
    for step in range(start, cfg.rft_steps + 1):
        t1 = time.time()
        rng = random.Random(cfg.seed * 1_000_003 + step)  # the same global batch on every rank
        n = -(-min(len(kept), cfg.rft_batch_size) // run.world) * run.world
        batch = rng.sample(kept, n) if n <= len(kept) else rng.choices(kept, k=n)
        local = batch[run.rank::run.world]
        st = sft_update(run.model, run.opt["actor"], local, cfg, run.pad_id, run.device, n)
        n_tok = sum(len(s["input_ids"]) for s in local)
        st.update(n_kept=len(kept), train_tok_s=n_tok / max(time.time() - t1, 1e-9))
        run.logger.log(2, step, _gather_mean(run, st))
        _checkpoint(run, 2, step + 1, force=step == cfg.rft_steps)


def value_stage(run: Run, start: int) -> None:
    """Stage 3: fit the critic to GAE targets (V + A, recomputed from the current critic each step) on the
    stage-2 trajectories, actor frozen; report explained variance on a held-out split."""
    cfg = run.cfg
    samples = [to_sample(r) for r in load_stage2(run)]
    idx = list(range(len(samples)))
    random.Random(cfg.seed).shuffle(idx)  # a fixed split, the same after resume
    n_held = max(1, int(round(len(samples) * cfg.value_heldout))) if len(samples) > 1 else 0
    held, train_set = [samples[i] for i in idx[:n_held]], [samples[i] for i in idx[n_held:]]
    for step in range(start, cfg.value_pretrain_steps):
        t1 = time.time()
        batch = random.sample(train_set, min(len(train_set), cfg.batch_size))
        sc = score_batch(run.model, run.head, batch, cfg, run.pad_id, run.device, need_logp=False)
        st = ppo_update(run.model, run.head, run.opt, batch, cfg, run.pad_id, run.device, len(batch) * run.world,
                        train_actor=False)
        n_tok = sum(len(s["input_ids"]) for s in batch) * cfg.ppo_epochs
        m = {**sc, **st, "train_tok_s": n_tok / max(time.time() - t1, 1e-9)}
        if held:
            m["heldout_explained_variance"] = score_batch(run.model, run.head, held, cfg, run.pad_id, run.device,
                                                          need_logp=False)["explained_variance"]
        run.logger.log(3, step, _gather_mean(run, m))
        _checkpoint(run, 3, step + 1, force=step + 1 == cfg.value_pretrain_steps)


# ----------------------------------------------------------------------------------------------------------
# Entry point


def _setup(cfg: TrainConfig):
    """(device, rank, world). Multi-GPU: `accelerate launch` starts one process per training GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist
        from accelerate import Accelerator
        acc = Accelerator()  # sets up the process group (NCCL on GPUs, gloo on CPUs) and this rank's device
        # the process group's own rank: under torchrun on CPUs, accelerate 1.x reported process_index 0 on
        # every rank (both ranks then wrote the same checkpoint file)
        rank = dist.get_rank() if dist.is_initialized() else acc.process_index
        device, local = acc.device, int(os.environ.get("LOCAL_RANK", acc.local_process_index))
        assert device.type == "cpu" or local not in cfg.sandbox_gpus, "a training GPU is also a sandbox GPU"
    else:
        rank = 0
        device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if cfg.device == "auto" else cfg.device))
    return device, rank, world


def train(cfg: TrainConfig) -> int:
    """Run the four stages in order (§3.3), resuming from run_dir/checkpoint.pt with --resume."""
    import sandbox
    import synth
    device, rank, world = _setup(cfg)
    if cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rank == 0:
        with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
    model, head, tok = build_models(cfg, device)
    tasks = synth.load_tasks(cfg.tasks)
    assert tasks, f"no tasks in {cfg.tasks}"
    demos = load_demos(cfg.demos, tasks, "cuda" if cfg.sandbox_device == "cuda" else "cpu") \
        if cfg.demo_fraction > 0 else []
    assert not (cfg.demos and cfg.demo_fraction > 0) or demos, f"no demonstrations for these tasks in {cfg.demos}"
    print(f"[ppo] {len(tasks)} tasks, {len(demos)} demonstrations ({cfg.demo_fraction:.0%} of stage-1/2 batches, "
          f"flagged source=demo), device {device}, rank {rank}/{world}", flush=True)
    gpus = cfg.sandbox_gpus[rank::world] if cfg.sandbox_gpus else None
    if cfg.sandbox_device == "cuda" and device.type == "cuda" and not gpus:
        print("[ppo] WARNING: no --sandbox-gpus: kernels are timed on GPU 0 next to training (noisy rewards)")
    pool = sandbox.SandboxPool(sandbox.SandboxConfig(device=cfg.sandbox_device, reward=cfg.reward, seed=cfg.seed),
                               gpus=gpus, cpu_slots=cfg.sandbox_cpu_slots)
    if cfg.sandbox_device == "cuda" and cfg.sandbox_prewarm > 0:  # nothing is timed yet: compile in parallel
        t0 = time.time()
        warmed = pool.prewarm([t["code"] for t in tasks[rank::world]], cfg.sandbox_prewarm)
        print(f"[ppo] prewarmed {len(warmed)} uncached task baselines in {time.time() - t0:.0f} s", flush=True)
    stage, start, ck = 1, 0, None
    metrics = os.path.join(cfg.run_dir, "metrics.jsonl")
    if cfg.resume:
        ck = load_checkpoint(cfg.run_dir, model, head)
        if ck:
            stage, start = ck["stage"], ck["step"]
            print(f"[ppo] resumed from {cfg.run_dir}/checkpoint.pt at stage {stage} ({STAGES.get(stage, 'done')}), "
                  f"step {start}", flush=True)
    if rank == 0:
        if ck:
            _truncate_metrics(metrics, stage, start)
        elif os.path.exists(metrics):
            os.remove(metrics)  # a fresh run in an old run_dir
    run = Run(cfg, model, head, tok, pool, tasks, demos, Logger(cfg.run_dir, cfg.tensorboard, rank == 0),
              device, rank, world)
    n_steps = {1: cfg.warmup_steps, 2: cfg.rft_steps, 3: cfg.value_pretrain_steps, 4: cfg.agent_steps}
    try:
        for s in range(stage, 5):
            step0 = start if s == stage else 0
            run.opt = make_optimizers(model, head, cfg)  # fresh AdamW per stage (different objectives)
            if ck and s == stage and step0 > 0:
                for k, o in run.opt.items():
                    o.load_state_dict(ck["opt"][k])
            print(f"[ppo] ==== stage {s}) {STAGES[s]}: {n_steps[s]} steps (from {step0}) ====", flush=True)
            if s == 1:
                ppo_stage(run, 1, cfg.warmup_steps, step0, single_turn=True, demo_fraction=cfg.demo_fraction)
            elif s == 2 and (cfg.rft_steps > 0 or cfg.value_pretrain_steps > 0):
                rft_stage(run, step0)  # collects stage-2 trajectories (stage 3 needs them too), then SFT
            elif s == 3 and cfg.value_pretrain_steps > 0:
                value_stage(run, step0)
            elif s == 4:
                ppo_stage(run, 4, cfg.agent_steps, step0, single_turn=cfg.max_turns == 1, demo_fraction=0.0)
            _checkpoint(run, s + 1, 0, force=True)
    finally:
        pool.close()
    if world > 1:  # the last _checkpoint was the last collective call
        import torch.distributed as dist
        dist.destroy_process_group()
    if rank == 0 and os.path.exists(metrics):
        print(f"[ppo] done: {plot_curves(cfg.run_dir)}, {metrics}, rollouts in {cfg.run_dir}/rollouts", flush=True)
    return 0


# The paper's recipe (§4.1) where it states one; ours (marked) where it does not. The default model is an
# open MoE like the paper's Seed1.6 (23B active / 230B total, not public): Qwen3-Coder-30B-A3B-Instruct has
# the same architecture family (fine-grained MoE, 3B active of 30B), is trained for agentic coding with
# tool calls, has a 256k context (the agentic stage needs 128k), and LoRA-trains on one 8-GPU node.
PRESETS = {
    "tiny": TrainConfig(),
    "paper": TrainConfig(
        preset="paper", run_dir="runs/paper", model="Qwen/Qwen3-Coder-30B-A3B-Instruct",
        tasks="BytedTsinghua-SIA/CUDA-Agent-Ops-6K", demos=None, demo_fraction=0.0, sandbox_device="cuda",
        bf16=True, grad_checkpointing=True, max_turns=150, max_new_tokens=8192, max_context=131072,
        lora_rank=16, lora_alpha=32.0,                      # ours (see departure 1 for the memory math)
        lr_actor=3e-5, lr_critic=6e-5, lr_head=1e-4,        # ours: ~10x the paper's full-FT rates, same 1:2 ratio
        batch_size=1024, micro_batch_size=1, ppo_epochs=1, num_minibatches=1,  # "one update per batch"
        warmup_steps=50, rft_rollouts=1024, rft_steps=200, rft_batch_size=64,  # ours (not stated)
        value_pretrain_steps=50, agent_steps=150, checkpoint_every=1, sample_every=10),
}
