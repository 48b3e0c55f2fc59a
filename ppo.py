"""PPO math and the LoRA actor/critic (paper §3.3, §4.1). The training loop that uses them is train.py.

  * Pure math on (B, T) tensors, tested against hand-computed cases (tests/test_ppo.py): token-level GAE
    (`compute_gae`: gamma 1, lambda 0.95, reward on the last policy token, V(s_T) = 0, multi-turn gaps
    skipped), the clipped policy loss with clip-higher (`ppo_policy_loss`, Eq. 5), `value_loss` against
    V + A, masks, whitening, explained variance, entropy, the k3 KL, the RFT filter (`rft_filter`), and the
    sampler-trainer gap with its optional correction (`sampler_gap`, `tis_weights`).
  * Models: one frozen base with two LoRA adapters, "actor" and "critic" (switched with set_adapter), and a
    scalar value head on the critic's last hidden state; the reference policy for the optional KL is a frozen
    copy of the actor taken at the start of the PPO stage (`snapshot_reference`: in stage 4, the RFT actor),
    or the base with adapters disabled when there is none. LoRA reaches attention and the fused 3-D MoE
    experts (peft `target_parameters`).
  * Updates on named batch tensors: `collate` -> `score` (old log-probs and values; `collate_sampler` and
    `sampler_gap` compare them with the sampler's) -> `compute_gae` -> `whiten_advantages` -> `ppo_update`
    (or `sft_update` for RFT). Data parallel: gradients are all-reduced by hand, because actor and critic
    share one PeftModel and DDP cannot wrap a model whose forward uses a different adapter each time.

  * Long trajectories: log-probs and entropies are computed at policy tokens only, with the vocabulary
    projection in checkpointed chunks of LOGIT_CHUNK positions (`token_logprobs`): the (T, V) fp32 logits
    never exist (3.5 GiB per 1k tokens at Qwen3's 152k vocabulary). GAE is a scan, not a loop over T. With
    --ppo.offload-activations the forwards of `ppo_update` and `sft_update` keep what they save for the backward
    in host memory (`offload_activations`); with gradient checkpointing that is each decoder layer's input,
    (T, H) per layer. `score` runs without autograd and saves nothing, so the flag does not touch it.

Departures from the paper (the rest are listed in train.py):
  1. LoRA on one frozen base instead of full fine-tuning of two models.
  2. Old log-probs are recomputed by the trainer (`score`), not taken from the rollout sampler. That makes the
     PPO ratio exactly 1 before the first update, but it does not remove the train/inference mismatch that
     §3.3 blames for ratio explosions: the tokens were drawn by the sampler, whose numbers differ (bf16, fused
     Triton experts, CUDA graphs: on an H100 with the paper preset, 0.068 nats per policy token on average,
     5.1% of policy tokens with a sampler/trainer ratio outside the clip range [0.8, 1.28]). The gap is
     logged every PPO step (`sampler_gap`: logp_gap, gap_clip_share). Like the paper, we do not correct it by
     default; --ppo.tis-cap C weights each token's policy loss by min(pi_old / pi_sampler, C) (`tis_weights`,
     truncated importance sampling as verl's rollout correction does; off by default).
  3. Not stated in the paper, so ours: advantage whitening over the batch, value clipping (off), entropy
     bonus and KL (off; its reference is a frozen copy of the actor, `snapshot_reference`), gradient-norm
     clipping at 1.0 per optimizer (--ppo.max-grad-norm), and a constant learning rate (no warm-up, no decay).

Smoke: python -m pytest -q tests/test_ppo.py tests/test_ppo_learning.py
"""
from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from tasks import Trajectory


@dataclass
class PPOConfig:
    """The settings of the updates (`make_optimizers`, `ppo_update`, `sft_update`) and of the advantages that feed
    them. Defaults: the tiny preset's; the paper preset's are in train_config.py."""
    lr_actor: float = 2e-4
    """actor LoRA learning rate of stages 1 and 4 (paper, full fine-tuning: 3e-6; LoRA needs ~10x more)"""
    lr_critic: float = 4e-3
    """critic LoRA learning rate (paper, full fine-tuning: 6e-6)"""
    lr_head: float = 1e-2
    """learning rate of the freshly initialised scalar value head"""
    micro_batch_size: int = 2
    """trajectories per forward/backward (gradient accumulation; the loss is invariant to it)"""
    epochs: int = 4
    """passes over each batch (paper: "one update per batch" -> 1)"""
    num_minibatches: int = 2
    """optimizer steps per epoch (paper: 1)"""
    eps_low: float = 0.2
    """lower clip range of the ratio (Eq. 5)"""
    eps_high: float = 0.28
    """upper clip range of the ratio, clip-higher (Eq. 5)"""
    gamma: float = 1.0
    """GAE discount (paper: 1)"""
    lam: float = 1.0
    """GAE lambda of stages 1 and 4 (paper: 0.95; tiny: 1, advantages R - V(s_t))"""
    kl_coef: float = 0.1
    """k3 KL penalty against the actor as each PPO stage found it (paper: not stated; 0 = off)"""
    entropy_coef: float = 0.0
    """entropy bonus (paper: not stated; 0 = off)"""
    vf_clip: float | None = None
    """value-loss clip range around the old values (None = unclipped)"""
    tis_cap: float | None = None
    """truncated importance sampling cap C, min(pi_old / pi_sampler, C) per token (`tis_weights`); None = off"""
    whiten_advantages: bool = True
    """whiten advantages over the batch (paper: not stated)"""
    max_grad_norm: float = 1.0
    """gradient-norm clip per optimizer (paper: not stated)"""
    offload_activations: bool = False
    """keep the tensors each update forward saves for its backward in pinned host memory (`offload_activations`)"""

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


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over masked positions (paper Fig. 5's critic signal).

    1 = perfect critic, 0 = no better than a constant, < 0 = worse than a constant. NaN if Var[returns] is 0
    up to rounding (every return equal: float32 leaves ~1e-14, which would give -1e13).
    """
    var_r = masked_var(returns, mask)
    if var_r.item() <= 1e-10 * (masked_mean(returns.pow(2), mask).item() + 1e-10):
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask) / var_r)


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
    target, §4.1); advantages and returns are 0 off the mask. lam = 1 (with gamma = 1) makes the returns
    the Monte-Carlo return, the final reward at every step; lam = 0.95 reaches ~1/(1 - 0.95) = 20 steps
    past each token and bootstraps from the critic beyond that, so on long trajectories it is far from it.

    Vectorised (no loop over T): each row's steps are packed to the left, the deltas computed on the packed
    rows, and A = the reverse discounted cumsum of the deltas by doubling (log2(steps) tensor ops, float64).
    The python loop over T it replaces is the reference in tests/test_ppo.py.
    """
    assert rewards.shape == values.shape == mask.shape, f"shapes differ: {rewards.shape} {values.shape} {mask.shape}"
    on = mask > 0                                                                        # (B, T)
    assert (rewards * ~on).abs().sum() == 0, "rewards must sit on policy tokens (mask == 1)"
    n = on.sum(1)                                                                        # (B,) steps per row
    N = int(n.max()) if n.numel() else 0
    adv = torch.zeros_like(values)
    if N == 0:
        return adv, adv.clone()
    rows, cols = on.nonzero(as_tuple=True)                     # every step, row-major: in order within a row
    k = (on.cumsum(1) - 1)[rows, cols]                         # its index among its row's steps
    v = values.new_zeros(on.shape[0], N, dtype=torch.float64)  # (B, N) packed: step k of each row at column k
    r = torch.zeros_like(v)
    v[rows, k], r[rows, k] = values[rows, cols].double(), rewards[rows, cols].double()
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))  # V of the next step; 0 past the row's last (V(s_T) = 0)
    a = r + gamma * v_next - v                                 # (B, N) deltas; 0 past each row's last step
    # A_k = sum_{j >= k} c^(j-k) delta_j, c = gamma * lam. After the pass with shift s, a[k] sums the window
    # [k, k + 2s): a[k] += c^s a[k + s] (Hillis-Steele scan). Zeros past a row's end stop the sum there.
    c, s = gamma * lam, 1
    while s < N:
        a = a + (c ** s) * torch.nn.functional.pad(a[:, s:], (0, s))
        s *= 2
    adv[rows, cols] = a[rows, k].to(values.dtype)
    m = on.to(values.dtype)
    return adv * m, (adv + values) * m


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
                    eps_low: float = 0.2, eps_high: float = 0.28, num_traj: int | None = None,
                    is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped-ratio PPO loss with clip-higher (Eq. 5, §4.1: eps_low 0.2, eps_high 0.28).

    logp, old_logp, adv, mask: (B, T). is_weight (B, T), optional and detached: each token's clipped loss is
    multiplied by it (`tis_weights`, --ppo.tis-cap; None = 1, the paper). Returns (scalar loss, stats) where stats
    has the token-mean `clipfrac` (share of tokens where the clipped branch is active) and `approx_kl` (k3
    estimator, E[(r - 1) - log r], r = pi/pi_old, which is >= 0 and unbiased for KL(pi_old || pi)).
    """
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)  # (B, T)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(pg1, pg2)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    loss = _per_trajectory_then_batch(per_token, mask, num_traj)
    with torch.no_grad():
        clipfrac = masked_mean((pg2 > pg1).float(), mask)
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, mask)
    return loss, {"clipfrac": clipfrac.item(), "approx_kl": approx_kl.item()}


@torch.no_grad()
def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights for the sampler-trainer gap (--ppo.tis-cap; verl's token-level rollout
    correction): w = min(pi_old / pi_sampler, cap) = min(exp(old_logp - sampler_logp), cap) where mask == 1,
    1 elsewhere (rows without sampler log-probs, such as replayed demonstrations, have mask 0). All (B, T).
    The tokens were drawn by the sampler, so w re-weights the trainer's loss toward the trainer's own policy;
    the cap bounds the variance of the rare tokens the trainer finds far likelier than the sampler did."""
    w = torch.exp(old_logp - sampler_logp).clamp(max=cap)
    return torch.where(mask > 0, w, torch.ones_like(w))


@torch.no_grad()
def sampler_gap(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, eps_low: float = 0.2,
                eps_high: float = 0.28, cap: float | None = None) -> dict:
    """How far the rollout sampler's log-probs are from the trainer's recomputed old log-probs, over the policy
    tokens that have sampler log-probs (mask (B, T)), summed over data-parallel ranks (every rank must call it):
    `logp_gap`, the token mean of |old_logp - sampler_logp| in nats; `gap_clip_share`, the share of tokens whose
    ratio pi_old / pi_sampler lies outside the clip range [1 - eps_low, 1 + eps_high] (what the clip would already
    cut before the policy moved); with `cap`, `tis_capped_share`, the share truncated by --ppo.tis-cap. Empty when
    no rank has such a token."""
    on = mask > 0
    d = (old_logp - sampler_logp)[on]                                       # (N,) log pi_old - log pi_sampler
    r = torch.exp(d)
    parts = [d.abs().sum(), ((r < 1.0 - eps_low) | (r > 1.0 + eps_high)).sum().to(d.dtype),
             (r > cap).sum().to(d.dtype) if cap is not None else d.new_zeros(()), d.new_tensor(float(d.numel()))]
    s = global_sum(torch.stack(parts).double())
    if s[3] == 0:
        return {}
    out = {"logp_gap": (s[0] / s[3]).item(), "gap_clip_share": (s[1] / s[3]).item()}
    if cap is not None:
        out["tis_capped_share"] = (s[2] / s[3]).item()
    return out


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
    """k3 estimate of KL(pi || pi_ref) per token, aggregated like the policy loss (optional, --ppo.kl-coef)."""
    log_r = (ref_logp - logp) * mask
    return _per_trajectory_then_batch(torch.exp(log_r) - 1.0 - log_r, mask, num_traj)


# ----------------------------------------------------------------------------------------------------------
# RFT filter (§3.3 stage 2): keep trajectories with reward > 0, drop loops, redundant repeated calls and
# malformed tool calls.


def truncated(t: Trajectory) -> bool:
    """The episode hit the turn or context limit, or a turn hit the token limit."""
    return t.stop_reason in ("max_turns", "context") or any(x.get("finish_reason") == "length" for x in t.turns)


def _call_key(name: str, args) -> str:
    """A hashable identity for one tool call: its name + arguments (parsed when they are JSON text)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return json.dumps({"tool": name, "args": args}, sort_keys=True, default=str)


def _call_keys(t: Trajectory) -> tuple[list[str], int]:
    """(the identity of each tool call in order, malformed ones included; the number of invalid calls: those
    the env answered with an error and the malformed ones it could not parse)."""
    keys, invalid = [], 0
    for turn in t.turns:
        keys += [_call_key(c["name"], c["args_text"]) for c in turn["calls"]]
        keys += [_call_key("<malformed>", e) for e in turn.get("errors", [])]
        invalid += sum(c.get("error") is not None for c in turn["calls"]) + len(turn.get("errors", []))
    return keys, invalid


def _has_loop(keys: list[str], max_period: int, min_repeats: int) -> bool:
    """True if some block of 1..max_period calls repeats `min_repeats` times back to back."""
    n = len(keys)
    for p in range(1, max_period + 1):
        for start in range(0, n - p * min_repeats + 1):
            block = keys[start:start + p]
            if all(keys[start + k * p:start + (k + 1) * p] == block for k in range(1, min_repeats)):
                return True
    return False


def rft_filter(trajectories: list[Trajectory], min_reward: float = 0.0, max_identical_calls: int | None = None,
               max_consecutive_identical: int = 1, loop_period: int = 4, loop_repeats: int = 3,
               max_invalid_calls: int = 0, drop_truncated: bool = False) -> list[Trajectory]:
    """Return the trajectories worth imitating (§3.3 stage 2), in their original order.

    A trajectory is judged by its final_reward, its tool calls (each turn's `calls`, an invalid one carrying an
    `error`, and its malformed `errors`) and `truncated`. It is dropped when:
      - final_reward <= min_reward;
      - it made more than `max_invalid_calls` invalid (malformed / unknown tool / bad arguments) calls;
      - the same call (tool + args) occurs more than `max_identical_calls` times in total (off by default:
        re-running the same compile/verify command after each edit is normal);
      - the same call occurs more than `max_consecutive_identical` times in a row (a redundant turn);
      - a block of 1..`loop_period` calls repeats `loop_repeats` times back to back (a loop);
      - `drop_truncated` and it hit the turn/length limit.
    """
    kept = []
    for tr in trajectories:
        if float(tr.final_reward) <= min_reward:
            continue
        if drop_truncated and truncated(tr):
            continue
        keys, invalid = _call_keys(tr)
        if invalid > max_invalid_calls:
            continue
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


def drop_turns(mask: list[int], keep: list[bool]) -> list[int]:
    """mask with the k-th run of policy tokens (the k-th assistant turn that sampled tokens) set to 0 where
    keep[k] is False: RFT imitates the turns it keeps, the dropped ones stay in the context."""
    assert sum(1 for i, x in enumerate(mask) if x and (i == 0 or not mask[i - 1])) == len(keep), \
        "one keep flag per run of policy tokens"
    out, k = list(mask), -1
    for i, x in enumerate(mask):
        if x and (i == 0 or not mask[i - 1]):
            k += 1
        if x and not keep[k]:
            out[i] = 0
    return out


# ----------------------------------------------------------------------------------------------------------
# Models: one frozen base, two LoRA adapters ("actor", "critic") on the same PeftModel, a scalar value head.
# The reference policy for the optional KL is a third, frozen adapter "ref" (a copy of the actor), or the
# base with adapters disabled. Either way there is one copy of the base weights.

REF = "ref"

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
    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in LORA_TARGETS]
    assert not unknown, f"unknown --lora.targets {unknown}; choose from {sorted(LORA_TARGETS)}"
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


def snapshot_reference(model) -> None:
    """Copy the actor adapter into the frozen "ref" adapter, the KL reference from now on. train.py calls it at
    the start of each PPO stage, so stage 4's KL pulls toward the RFT actor (what stage 4 starts from), not
    toward the base that stage 1 left behind. Costs one more adapter (~0.63B parameters on Qwen3-30B-A3B)."""
    if REF not in model.peft_config:
        model.add_adapter(REF, copy.deepcopy(model.peft_config["actor"]))
    set_peft_model_state_dict(model, get_peft_model_state_dict(model, adapter_name="actor"), adapter_name=REF)
    model.set_adapter("actor")  # peft trains the active adapter only: "ref" stays frozen
    assert not any(p.requires_grad for p in adapter_params(model, REF)), "the KL reference must stay frozen"


def _decoder(model):
    """The inner decoder stack of a PeftModel-wrapped causal LM (LoRA layers are injected in place)."""
    lm = model.get_base_model()
    return lm.model


LOGIT_CHUNK = 1024  # positions per vocabulary projection: (1024, 151936) fp32 logits are 0.6 GiB


def _chunk_logp_entropy(lm_head, h: torch.Tensor, tgt: torch.Tensor, temperature: float, with_entropy: bool,
                        entropy_grad: bool):
    """log softmax(lm_head(h) / temperature)[tgt] and the entropy, for one chunk: h (C, H), tgt (C,) -> (C,), (C,)."""
    z = lm_head(h).float() / temperature                                    # (C, V): the only full-vocab tensor
    lse = torch.logsumexp(z, -1)                                            # (C,)
    logp = z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    # no graph for an entropy that gets no gradient: a checkpointed chunk recomputes every tensor its graph saved
    # and frees each when its backward uses it, so an unused branch would hold its (C, V) tensors to the end of
    # the backward (52 GiB at 48k policy tokens of a 152k vocabulary, seen on an H200)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        ent = lse - (torch.softmax(z, -1) * z).sum(-1)                      # H = lse - E_p[z]
    return logp, ent


def token_logprobs(lm_head, h: torch.Tensor, tgt: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = False, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N,) of targets tgt (N,) under lm_head(h) for hidden states h (N, H), and entropies (N,), in
    chunks of `chunk` positions (default LOGIT_CHUNK): the (N, V) fp32 logits never exist at once. With
    autograd on, each chunk is checkpointed (its logits are recomputed in backward), so the backward holds one
    chunk's logits too.
    The entropy carries a gradient only with entropy_grad (an entropy bonus); else it is a statistic."""
    chunk = chunk or LOGIT_CHUNK
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    lps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        args = (lm_head, h[i:i + chunk], tgt[i:i + chunk], temperature, with_entropy, entropy_grad)
        lp, ent = (torch.utils.checkpoint.checkpoint(_chunk_logp_entropy, *args, use_reentrant=False) if grad
                   else _chunk_logp_entropy(*args))
        lps.append(lp)
        ents.append(ent)
    if not lps:
        z = h.new_zeros(0, dtype=torch.float32)
        return z, (z if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def actor_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, temperature: float = 1.0,
                   adapter: str | None = "actor", with_entropy: bool = False, mask: torch.Tensor | None = None,
                   entropy_grad: bool = False):
    """logp[:, t] = log pi(ids[:, t] | ids[:, :t]) (B, T), 0 at t = 0; and entropy (B, T) if asked.

    mask (B, T): compute only where mask == 1 (the policy tokens; 0 elsewhere), None = every position. The
    decoder runs once; the vocabulary projection runs on the selected positions in chunks (`token_logprobs`),
    so memory grows with the policy tokens times LOGIT_CHUNK, not with T * V.
    adapter: which LoRA adapter acts ("actor", or "ref" for the KL reference); None = the base, adapters off.
    """
    if adapter is None:
        with model.disable_adapter():
            return actor_logprobs(model, ids, attn, temperature, "__none__", with_entropy, mask, entropy_grad)
    if adapter != "__none__":
        model.set_adapter(adapter)
    lm = model.get_base_model()
    assert getattr(lm.config, "final_logit_softcapping", None) is None, "logits are lm_head(h): no soft-capping"
    h = _decoder(model)(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, :-1]  # (B, T-1, H)
    sel = (mask[:, 1:] > 0) if mask is not None else torch.ones_like(ids[:, 1:], dtype=torch.bool)     # (B, T-1)
    lp, ent = token_logprobs(lm.get_output_embeddings(), h[sel], ids[:, 1:][sel], temperature, with_entropy,
                             entropy_grad)
    logp = torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)            # (B, T-1)
    logp = torch.nn.functional.pad(logp, (1, 0))
    if with_entropy:
        ent = torch.nn.functional.pad(torch.zeros_like(logp[:, 1:]).masked_scatter(sel, ent), (1, 0))
    return logp, ent


def critic_values(model, head: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """values[:, t] = V(ids[:, :t]) (B, T): the value head on the critic's last hidden state at t - 1."""
    model.set_adapter("critic")
    h = _decoder(model)(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # (B, T, H)
    v = head(h.to(head.weight.dtype)).squeeze(-1)  # (B, T): value after reading token t
    return torch.nn.functional.pad(v[:, :-1], (1, 0))


def make_optimizers(model, head, cfg: PPOConfig) -> dict:
    """AdamW per role: actor LoRA at lr_actor; critic LoRA at lr_critic and the fresh value head at lr_head."""
    return {"actor": torch.optim.AdamW(adapter_params(model, "actor"), lr=cfg.lr_actor, weight_decay=0.0),
            "critic": torch.optim.AdamW([{"params": adapter_params(model, "critic"), "lr": cfg.lr_critic},
                                         {"params": list(head.parameters()), "lr": cfg.lr_head}], weight_decay=0.0)}


OFFLOAD_MIN_BYTES = 1 << 20  # smaller saved tensors (norm weights, indices, per-token scalars) stay on the device


def _empty_with_layout(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """An empty tensor of t's size and strides on `device` (a strided view such as one half of a chunk() keeps its
    layout, so the backward runs the kernels it would have run), or a contiguous one where those strides span
    more than twice t's elements."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    if span <= 2 * t.numel():
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=pin)
    return torch.empty(t.size(), dtype=t.dtype, device=device, pin_memory=pin)


def offload_activations(on: bool, stats: dict | None = None):
    """A context around a forward whose backward comes later (--ppo.offload-activations; ours, for the 128k-token
    agentic context of §4.1 on one GPU): each tensor that autograd saves for the backward inside it is copied to
    host memory (pinned when it is on a GPU, the copy queued on the current stream) and copied back when the
    backward unpacks it. Frozen parameters, broadcast views and tensors under OFFLOAD_MIN_BYTES stay where they
    are.

    With non-reentrant gradient checkpointing a checkpointed decoder layer saves its input only, (B, T, H), and
    that input is packed by this context (it is the innermost hook when the checkpoint saves it): 48 x 0.5 GiB
    at 131,072 tokens of Qwen3-30B-A3B (hidden 2,048, bf16) leave the GPU, plus the final norm's and the value
    head's inputs and each logit chunk's (C, H) input. What a layer recomputes during the backward is saved
    under the checkpoint's own hook and stays on the GPU. Without checkpointing every saved activation is
    copied, once for each op that saves it. A forward under no_grad (`score`) saves nothing: nothing moves.
    stats: "offload_bytes" grows by the bytes copied. off: a null context."""
    if not on:
        return contextlib.nullcontext()

    def pack(t: torch.Tensor):
        n = t.numel() * t.element_size()
        if (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or n < OFFLOAD_MIN_BYTES
                or t.numel() == 0 or t.layout != torch.strided or t.untyped_storage().nbytes() < n):
            return t.detach()  # weights, small, sparse or expanded; detached: not tied to its own grad_fn
        pin = t.device.type == "cuda"
        host = _empty_with_layout(t, torch.device("cpu"), pin)
        host.copy_(t, non_blocking=pin)
        if stats is not None:
            stats["offload_bytes"] = stats.get("offload_bytes", 0) + host.untyped_storage().nbytes()
        return t.device, host

    def unpack(x):
        if isinstance(x, torch.Tensor):
            return x
        device, host = x
        out = _empty_with_layout(host, device, False)
        return out.copy_(host, non_blocking=device.type == "cuda")

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# ----------------------------------------------------------------------------------------------------------
# Batches and updates. A batch is a handful of named (B, T) tensors, right-padded: b_ids, b_attn (1 on real
# tokens), b_mask (1 on policy tokens), b_rewards (the Eq. 1 reward on each row's last policy token), and
# what `score` and `compute_gae` add: b_logp (old log-probs), b_values (old values), b_adv, b_returns.
# B is this rank's share of the batch; `n_global` the batch size over all ranks.


def _pad(rows: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """Right-pad 1-D tensors to (B, T_max)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def collate(ids: list[list[int]], masks: list[list[int]], rewards: list[float] | None, pad_id: int, device):
    """(b_ids, b_attn, b_mask, b_rewards), each (B, T) on `device`; the reward sits on each row's last policy
    token (§3, Eq. 1), 0 elsewhere (b_rewards is all zeros when `rewards` is None). A row with no policy token
    (every turn sampled 0 tokens) is kept with an all-zero mask: it adds nothing to any loss."""
    t_ids = [torch.as_tensor(x, dtype=torch.long) for x in ids]
    t_mask = [torch.as_tensor(m, dtype=torch.float32) for m in masks]
    rew = []
    for i, m in enumerate(t_mask):
        r = torch.zeros_like(m)
        if m.sum() > 0:  # a trajectory whose turns sampled no token has no step to credit: it trains nothing
            r[int(m.nonzero()[-1])] = float(rewards[i]) if rewards is not None else 0.0
        rew.append(r)
    out = (_pad(t_ids, pad_id), _pad([torch.ones_like(i) for i in t_ids]), _pad(t_mask), _pad(rew))
    return tuple(x.to(device) for x in out)


def collate_sampler(logprobs: list[list[float] | None], b_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b_sampler_logp, b_sampler_mask), each (B, T) like collate's and on b_mask's device: the log-probs the
    rollout sampler recorded for each row's tokens (Trajectory.logprobs, 0 off the policy tokens), and b_mask
    kept only on the rows that have them (None: a replayed demonstration, which no sampler drew)."""
    B, T = b_mask.shape
    lp = torch.zeros(B, T, device=b_mask.device)
    has = torch.zeros(B, 1, device=b_mask.device)
    for i, row in enumerate(logprobs):
        if row:
            lp[i, :len(row)] = torch.as_tensor(row, dtype=torch.float32)
            has[i] = 1.0
    return lp, b_mask * has


def micro_batches(idx: list[int], size: int, b_attn: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Row indices in chunks of `size`, each with its own padded length (the longest row in the chunk), so
    a micro-batch costs what its own rows cost, not what the longest row of the batch costs."""
    out = []
    for i in range(0, len(idx), size):
        rows = torch.as_tensor(idx[i:i + size], device=b_attn.device)
        out.append((rows, int(b_attn[rows].sum(-1).max())))
    return out


@torch.no_grad()
def score(model, head, b_ids: torch.Tensor, b_attn: torch.Tensor, micro_batch_size: int, temperature: float,
          need_logp: bool = True, need_ref: bool = False, b_mask: torch.Tensor | None = None):
    """Old values (critic), old log-probs (actor) and reference log-probs (for the KL), each (B, T), computed
    micro-batch by micro-batch; b_logp / b_ref_logp are None when not asked for. With b_mask, log-probs are
    computed at policy tokens only (0 elsewhere). The KL reference is the "ref" adapter when the model has one
    (train.py snapshots the actor into it at the start of a PPO stage), else the base with adapters off."""
    b_values = torch.zeros(b_ids.shape, device=b_ids.device)
    b_logp = torch.zeros(b_ids.shape, device=b_ids.device) if need_logp else None
    b_ref = torch.zeros(b_ids.shape, device=b_ids.device) if need_ref else None
    ref = REF if REF in model.peft_config else None
    for rows, T in micro_batches(list(range(len(b_ids))), micro_batch_size, b_attn):
        ids, attn = b_ids[rows, :T], b_attn[rows, :T]
        mask = b_mask[rows, :T] if b_mask is not None else None
        b_values[rows, :T] = critic_values(model, head, ids, attn)
        if need_logp:
            b_logp[rows, :T] = actor_logprobs(model, ids, attn, temperature, mask=mask)[0]
        if need_ref:
            b_ref[rows, :T] = actor_logprobs(model, ids, attn, temperature, adapter=ref, mask=mask)[0]
    model.set_adapter("actor")
    return b_values, b_logp, b_ref


def score_stats(b_values: torch.Tensor, b_returns: torch.Tensor, b_adv: torch.Tensor, b_mask: torch.Tensor) -> dict:
    """The critic's explained variance (paper Fig. 5), mean value, return and (raw) advantage over policy tokens."""
    on = b_mask > 0
    v, r, a = b_values[on], b_returns[on], b_adv[on]
    return {"explained_variance": explained_variance(v, r, torch.ones_like(v)) if v.numel() > 1 else float("nan"),
            "value_mean": v.mean().item(), "return_mean": r.mean().item(), "adv_mean": a.mean().item()}


def global_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over data-parallel ranks (identity on one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def whiten_advantages(b_adv: torch.Tensor, b_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / std over the policy tokens of the whole batch, all ranks together (ours: the paper does
    not say); 0 off the mask. (B, T) -> (B, T)."""
    a = b_adv[b_mask > 0]
    s = global_sum(torch.stack([a.sum(), (a * a).sum(), torch.tensor(float(a.numel()), device=a.device)]))
    mean = s[0] / s[2]
    std = (s[1] / s[2] - mean ** 2).clamp(min=0).sqrt()
    return (b_adv - mean) / (std + eps) * b_mask


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Data parallel: sum LoRA/head gradients over ranks (losses are already divided by the global count).
    One flat all-reduce, not one per parameter: a parameter can have a gradient on one rank and none on
    another (an unrouted expert), and per-parameter calls would then pair different tensors across ranks.
    A parameter no rank touched keeps grad None, so the optimizer skips it as it would on one process."""
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


def _note_offload(stats: dict, off: dict, on: bool) -> None:
    """One forward's offloaded GiB (offload_activations' byte count, reset) into the update's stats."""
    if on:
        stats.setdefault("offload_GiB", []).append(off.pop("offload_bytes", 0) / 2 ** 30)


def ppo_update(model, head, opt: dict, cfg: PPOConfig, temperature: float, b_ids, b_attn, b_mask, b_logp,
               b_values, b_adv, b_returns, b_ref_logp=None, n_global: int | None = None, train_actor: bool = True,
               train_critic: bool = True, b_tis=None) -> dict:
    """PPO epochs (Eq. 5): clipped policy loss (+ optional KL to the reference policy, `snapshot_reference`, +
    optional entropy bonus) on the actor, value loss on the critic; log-probs at the sampling `temperature`.
    All tensors (B, T); b_tis: optional truncated importance weights on the policy loss (`tis_weights`,
    --ppo.tis-cap). One optimizer step per
    minibatch; micro-batches accumulate gradients with the full-minibatch trajectory count (§4.1: mean over
    each trajectory's tokens, then over trajectories), so the update does not depend on the micro-batch size.
    A micro-batch with no policy token adds nothing to any loss and is skipped (its log-probs would carry no
    graph to differentiate). With cfg.offload_activations each forward's saved tensors wait in host memory
    for its backward (`offload_activations`; stats["offload_GiB"]: GiB copied per forward, the mean)."""
    B = len(b_ids)
    n_all = int(global_sum(torch.tensor(float(B), device=b_ids.device)).item())
    assert n_global is None or n_global == n_all, f"n_global {n_global} != {n_all} trajectories over all ranks"
    stats: dict[str, list[float]] = {}
    off = {}  # bytes copied to host by the forwards of this update (--ppo.offload-activations)
    actor_ps, critic_ps = adapter_params(model, "actor"), adapter_params(model, "critic") + list(head.parameters())
    model.train()  # gradient checkpointing (if enabled) is active in train mode; LoRA dropout is 0
    for _epoch in range(cfg.epochs):
        # exactly num_minibatches per rank (some may be empty), so every rank takes the same optimizer steps
        # and all-reduces in step even when ranks hold different counts (1024 trajectories on 6 GPUs)
        for mb in (m.tolist() for m in torch.tensor_split(torch.randperm(B), cfg.num_minibatches)):
            n_traj = int(global_sum(torch.tensor(float(len(mb)), device=b_ids.device)).item())  # over all ranks
            if n_traj == 0:
                continue
            for o in opt.values():
                o.zero_grad(set_to_none=True)
            for rows, T in micro_batches(mb, cfg.micro_batch_size, b_attn):
                ids, attn, mask = b_ids[rows, :T], b_attn[rows, :T], b_mask[rows, :T]  # (b, T) each
                if not mask.any():  # rows whose turns sampled no token: 0 in every loss
                    continue
                scale = n_traj / len(rows)  # per-micro-batch loss -> its own mean, for the logs
                if train_actor:
                    with offload_activations(cfg.offload_activations, off):
                        logp, ent = actor_logprobs(model, ids, attn, temperature, with_entropy=True, mask=mask,
                                                   entropy_grad=cfg.entropy_coef > 0)                  # (b, T)
                    pg, st = ppo_policy_loss(logp, b_logp[rows, :T], b_adv[rows, :T], mask, cfg.eps_low,
                                             cfg.eps_high, num_traj=n_traj,
                                             is_weight=b_tis[rows, :T] if b_tis is not None else None)
                    loss = pg
                    if cfg.kl_coef > 0:
                        kl = kl_penalty(logp, b_ref_logp[rows, :T], mask, num_traj=n_traj)
                        loss = loss + cfg.kl_coef * kl
                        stats.setdefault("kl_ref", []).append(kl.item() * scale)
                    ent_mean = _per_trajectory_then_batch(ent, mask, n_traj)
                    if cfg.entropy_coef > 0:
                        loss = loss - cfg.entropy_coef * ent_mean
                    loss.backward()
                    for k, v in (("pg_loss", pg.item() * scale), ("clipfrac", st["clipfrac"]),
                                 ("approx_kl", st["approx_kl"]), ("entropy", ent_mean.item() * scale)):
                        stats.setdefault(k, []).append(v)
                    _note_offload(stats, off, cfg.offload_activations)
                if train_critic:
                    with offload_activations(cfg.offload_activations, off):
                        v = critic_values(model, head, ids, attn)                                      # (b, T)
                    vl, _ = value_loss(v, b_returns[rows, :T], mask, b_values[rows, :T], cfg.vf_clip, num_traj=n_traj)
                    vl.backward()
                    stats.setdefault("v_loss", []).append(vl.item() * scale)
                    _note_offload(stats, off, cfg.offload_activations)
            for name, ps, on in (("actor", actor_ps, train_actor), ("critic", critic_ps, train_critic)):
                if on:
                    all_reduce_grads(ps)
                    gn = torch.nn.utils.clip_grad_norm_(ps, cfg.max_grad_norm)
                    stats.setdefault(f"grad_norm_{name}", []).append(gn.item())
                    opt[name].step()
    return {k: sum(v) / len(v) for k, v in stats.items()}


def sft_update(model, opt_actor, cfg: PPOConfig, temperature: float, b_ids, b_attn, b_mask,
               n_global: int | None = None) -> dict:
    """One RFT step (§3.3 stage 2): next-token NLL on the action tokens only (b_mask == 1), averaged per
    trajectory then over trajectories; one optimizer step over the batch (micro-batched). cfg.offload_activations:
    as in `ppo_update`."""
    B = len(b_ids)
    n_all = n_global or B  # trajectories in this step over all ranks (ranks may hold different counts)
    model.train()
    opt_actor.zero_grad(set_to_none=True)
    nll_sum = 0.0
    for rows, T in micro_batches(list(range(B)), cfg.micro_batch_size, b_attn):
        if not b_mask[rows, :T].any():  # nothing to imitate (and no graph to differentiate)
            continue
        with offload_activations(cfg.offload_activations):
            logp, _ = actor_logprobs(model, b_ids[rows, :T], b_attn[rows, :T], temperature,
                                     mask=b_mask[rows, :T])                                            # (b, T)
        loss = _per_trajectory_then_batch(-logp, b_mask[rows, :T], n_all)
        loss.backward()
        nll_sum += loss.item()
    ps = adapter_params(model, "actor")
    all_reduce_grads(ps)
    gn = torch.nn.utils.clip_grad_norm_(ps, cfg.max_grad_norm)
    opt_actor.step()
    return {"sft_nll": nll_sum * n_all / max(B, 1), "grad_norm_actor": gn.item()}  # this rank's mean NLL
