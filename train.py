"""RL training (paper §3.3, §4.1): the four stages in order, each resumable from OUT/checkpoint.pt.

  1) single-turn PPO warm-up;  2) agent trajectories + `rft_filter` + SFT on the action tokens (RFT);
  3) value pretraining (critic fitted on the stage-2 trajectories, actor frozen);  4) agentic PPO.
Stages 1, 3, 4 run `ppo_iteration`: rollout (env.run_episodes, policy.HFPolicy over the actor, the sandbox
pool) -> reward (reward.py, Eq. 1) -> score -> GAE -> PPO update -> log. Math and models: ppo.py; logs: runlog.py.

Ablations (one flag each; the default is the paper's recipe): --rft.steps 0, --value.steps 0,
--env.reward speedup, --env.max-turns 1 (stages 2 and 4 single-turn), --ppo.kl-coef, --lora.rank,
--lora.targets, --ppo.tis-cap (truncated importance sampling against the sampler-trainer gap; off, as in the
paper). A control, not an ablation: --agent.permute-rewards (stage 4 trains on its rewards dealt out by a random
permutation over the step's trajectories).

The stages are uniform, `stage(run, start)`, in STAGE_RUNNERS; `train` runs them in order from where a resumed
run stopped. Their settings are TrainConfig's groups (train_config.py): --warmup.*, --rft.*, --value.*, --agent.*.

Departures from the paper
  1. LoRA (rank 16 in the paper preset, both adapters on one frozen base) and hence our own learning rates,
     ~10x the paper's full fine-tuning 3e-6 / 6e-6, keeping its 1:2 actor:critic ratio.
  2. The paper's Seed1.6 is not public: `--preset paper` uses Qwen/Qwen3-Coder-30B-A3B-Instruct, an open
     MoE of the same family (3B active of 30B, agentic coding, 256k context).
  3. The tiny preset (default) starts from a random ~1.5M-parameter Qwen3-MoE that cannot write a kernel, so
     it mixes shipped demonstrations (data/demos, `--demos.fraction`) into stage-1/2 batches, replayed
     through the same env and flagged `source: demo`. After RFT on them (SFT until every task's kept trajectory
     has probability >= --rft.target under the actor) it writes the kernels of its four
     tasks (data/tasks_tiny4.jsonl) itself in stage 4: its tokenizer, trained on data/, spells a
     demonstration in ~50 tokens. Its stage 4 trains on the tasks a 4-episode probe of the RFT actor passes
     sometimes but not always (--agent.mixed-probe, `agent_tasks`). The paper preset has no demos and no probe.
  4. Not stated in the paper, so ours: stage lengths of stages 1-3, fresh AdamW per stage, one context
     budget (--env.max-context-tokens) for both modes, a per-turn token cap (--sampler.max-new-tokens, 8,192
     in the paper preset, stage 1's single answer included); stage 2's size (paper preset: 1,024 rollouts, 200 SFT
     steps of 64 trajectories = 12,800 samples drawn from the kept pool, ~12.5 epochs if all 1,024 are kept,
     more if fewer are); stage 3 fits its GAE targets (lambda 0.95 from the current critic, as the paper's
     value pretraining; the tiny preset: Monte-Carlo returns, --value.lam 1) on 75% of the stage-2
     trajectories (--value.heldout 0.25 held out to report explained variance); the KL reference
     (--ppo.kl-coef, off) is the actor as each PPO stage starts (stage 4: the RFT actor).
  5. RFT filter: reward > 0, no loops, no repeated or malformed calls (the paper's pattern filter), and the
     agent turns that called no tool are not imitated (--rft.drop-no-call-turns, the paper's "redundant
     turns"); trajectories cut by a limit are kept unless --rft.drop-truncated.
  6. Multi-GPU: one process per training GPU (data parallel over trajectories, a batch dealt round-robin, so
     ranks may hold one trajectory more than others); the sandbox gets its own GPUs.

OUT/adapter/ (every checkpoint and the end): the actor as a peft adapter folder, the critic and value head, and
the base model's name (the tiny preset's random base is saved in it); `cuda_agent.py solve TASK
--policy.adapter OUT/adapter` and `kernelbench_eval.py --policy.adapter OUT/adapter` load it.

Smoke: python cuda_agent.py train                  (tiny preset, CPU, offline)
Full:  accelerate launch --num_processes 6 cuda_agent.py train --preset paper --pool.gpus 6 7
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator

import env
import policy
import ppo
import reward
import runlog
import sandbox
import tasks as tasks_mod
from runlog import STAGES
from sandbox import ray as sandbox_ray
from train_config import RFTConfig, TrainConfig

# noise, not news: peft calls transformers' deprecated is_gradient_checkpointing on every adapter it adds
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning,
                        module="transformers.modeling_utils")


# ----------------------------------------------------------------------------------------------------------
# What every stage uses. Rank and world come from torch.distributed (1 process: 0 and 1).


@dataclass
class Run:
    cfg: TrainConfig
    model: object                 # PeftModel: frozen base + "actor" and "critic" LoRA adapters
    head: torch.nn.Module         # the critic's scalar value head
    tok: object
    pool: sandbox.SandboxPool
    tasks: list[tasks_mod.Task]
    demos: list[tuple[tasks_mod.Task, dict[str, str]]]
    logger: runlog.Logger
    opt: dict = field(default_factory=dict)   # {"actor": AdamW, "critic": AdamW}, fresh per stage

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else 0


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_ranks(xs: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (identity on one process). Uses
    torch.distributed directly: under torchrun on CPUs accelerate's gather_object saw one process only."""
    rank, world = rank_world()
    if world == 1:
        return xs
    parts = [None] * world
    dist.all_gather_object(parts, xs)
    return [x for part in parts for x in part]


def gather_mean(m: dict, totals: tuple = ()) -> dict:
    """Average per-rank metric dicts over ranks (equal shards) for rank 0's log line; keys in `totals` are
    summed instead (counts over the whole batch)."""
    ms = all_ranks([m])
    return {k: sum(d.get(k, 0.0) for d in ms) / (1 if k in totals else len(ms)) if isinstance(v, (int, float))
            else v for k, v in m.items()}


def local_share(n: int) -> int:
    """This rank's share of n items dealt round-robin: 1024 episodes on 6 ranks are 171 x 4 + 170 x 2 (not
    6 x 170 = 1020). The updates normalise by the count over all ranks, so unequal shares are exact."""
    rank, world = rank_world()
    return n // world + (rank < n % world)


def permuted_rewards(rewards: list[float], key: str) -> list[float]:
    """--agent.permute-rewards (stage 4 control): the step's rewards dealt out by a uniform random permutation,
    seeded by `key` ("seed:permute:stage:step", the same on every rank and after a resume): the same rewards and
    update sizes, and a reward that tells nothing of its trajectory's outcome (E[r_sigma(i)] is the step's mean
    for every i: covariance 0 with the trajectory's own reward). Not a derangement: forbidding fixed points makes
    E[r_sigma(i)] = (n * mean - r_i) / (n - 1), covariance -var / (n - 1) with the own reward, a push away from
    what passed (1/7 of the true signal at 8 episodes a step)."""
    rng = random.Random(key)
    return [rewards[p] for p in rng.sample(range(len(rewards)), len(rewards))]


def deal(tasks: list, demos: list, n: int, fraction: float, key: str) -> tuple[list, list]:
    """This rank's (policy tasks, demonstrations) of a global batch of n episodes, round(n * fraction) of them
    demonstrations. Each kind is drawn in shuffled passes over all of its items (every task appears
    floor(n / len) or ceil(n / len) times), so a batch's pass rate does not swing with which tasks it drew,
    and dealt round-robin over ranks (episode i to rank i % world; the demonstrations first). The draw is
    seeded by `key` ("seed:stage:step"): the same on every rank, and again after a resume."""
    rank, world = rank_world()
    n_demo = round(n * fraction) if demos else 0
    rng = random.Random(key)

    def passes(items: list, k: int) -> list:
        out = []
        while len(out) < k:
            out += rng.sample(items, len(items))
        return out[:k]
    demo_picks, task_picks = passes(demos, n_demo), passes(tasks, n - n_demo)
    mine = range(rank, n, world)
    return [task_picks[i - n_demo] for i in mine if i >= n_demo], [demo_picks[i] for i in mine if i < n_demo]


def checkpoint(run: Run, stage: int, step: int, force: bool = False) -> None:
    rank, world = rank_world()
    if world > 1:
        dist.barrier()
        # data parallel by hand (ppo.all_reduce_grads): every rank must hold the same weights, or rank 0's
        # checkpoint silently differs from what the others train. A checksum per role, compared to rank 0's.
        ps = [ppo.adapter_params(run.model, "actor"),
              ppo.adapter_params(run.model, "critic") + list(run.head.parameters())]
        mine = torch.stack([sum(p.detach().double().sum() for p in g) for g in ps]).to(run.device)
        ref = mine.clone()
        dist.broadcast(ref, 0)
        assert torch.allclose(mine, ref, rtol=1e-9, atol=0), f"rank {rank} diverged from rank 0: {mine} vs {ref}"
    if rank > 0 and (force or step % run.cfg.checkpoint_every == 0):
        save_rng(run.cfg.out, rank, stage, step)  # rank 0's RNG states go into checkpoint.pt
    if rank == 0 and (force or step % run.cfg.checkpoint_every == 0):
        cfg = run.cfg
        runlog.save_checkpoint(cfg.out, run.model, run.head, run.opt, stage, step, cfg)
        meta = {"base_model": cfg.model, "preset": cfg.preset, "stage": stage, "step": step, "seed": cfg.seed,
                "dtype": "bfloat16" if cfg.bf16 else "float32", "temperature": cfg.sampler.temperature,
                "max_new_tokens": cfg.sampler.max_new_tokens, "lora_rank": cfg.lora.rank,
                "lora_targets": cfg.lora.targets}
        tiny_base = os.path.join(cfg.out, "tiny_base")
        runlog.save_adapter(cfg.out, run.model, run.head, meta, tiny_base if cfg.model == "tiny" else None)


def save_rng(out: str, rank: int, stage: int, step: int) -> None:
    """This rank's RNG states (python, numpy, torch, CUDA) in OUT/rng_r{rank}.pt, stamped with the checkpoint's
    stage and step (rank 0's are in checkpoint.pt). Each rank draws its own numbers (its rollout sampler's seed,
    its minibatch orders, stage 3's batches), and a resume must give each rank its own back."""
    state = {"stage": stage, "step": step, "python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    path = os.path.join(out, f"rng_r{rank}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic, like checkpoint.pt


def restore_rng(out: str, rank: int, stage: int, step: int, seed: int) -> bool:
    """On resume, after runlog.load_checkpoint gave every rank rank 0's RNG states: rank > 0 takes back its own
    from OUT/rng_r{rank}.pt. A missing file or one stamped with another stage or step (a kill between the
    writes, or a rank the saved run did not have) reseeds from (seed, rank, stage, step) instead, so that ranks
    still draw different numbers. True if the saved states were restored."""
    path = os.path.join(out, f"rng_r{rank}.pt")
    st = torch.load(path, map_location="cpu", weights_only=False) if rank > 0 and os.path.exists(path) else None
    if st is None or (st["stage"], st["step"]) != (stage, step):
        s = random.Random(f"{seed}:{rank}:{stage}:{step}").randrange(2 ** 31)
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)  # CUDA generators included
        return False
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if st["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    return True


# ----------------------------------------------------------------------------------------------------------
# Rollouts through the real agent environment (env.run_episodes) and the sandbox pool.


def build_models(cfg: TrainConfig, device: torch.device):
    """(peft_model, value_head, tokenizer). cfg.model == "tiny": the random tiny Qwen3-MoE of policy.py
    (offline); else a hub id / local path loaded with the real HF code (policy.load_policy_model)."""
    if cfg.model == "tiny":
        base, tok = policy.build_tiny_model_and_tokenizer(seed=cfg.seed)
        if rank_world()[0] == 0:
            # saved once, copied into every OUT/adapter/: the adapter then loads onto these exact weights,
            # whatever later versions of torch's initialisation or of build_tiny_model_and_tokenizer do (~4 MB)
            transformers.utils.logging.disable_progress_bar()   # a 4 MB write needs no "Writing model shards" bar
            base.save_pretrained(os.path.join(cfg.out, "tiny_base"))
            transformers.utils.logging.enable_progress_bar()
            tok.save_pretrained(os.path.join(cfg.out, "tiny_base"))
    else:
        base, tok = policy.load_policy_model(cfg.model, dtype="bfloat16" if cfg.bf16 else "float32",
                                             device=str(device))
    base.to(device)
    for p in base.parameters():
        p.requires_grad_(False)
    if cfg.grad_checkpointing:
        # active in train mode only (the updates); rollouts run in eval mode and keep the KV cache
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, info = ppo.add_actor_critic_adapters(base, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
    print(f"[ppo] LoRA r={cfg.lora.rank} on {info['modules']} modules + {info['params']} fused expert "
          f"param kinds; trainable per adapter: {sum(p.numel() for p in ppo.adapter_params(model, 'actor')):,}")
    head = torch.nn.Linear(base.config.hidden_size, 1).to(device)  # critic's scalar value head
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return model, head, tok


def demo_script(files: dict[str, str], single_turn: bool) -> list[dict]:
    """The assistant messages that play a demonstration back through env + ReplayPolicy: single-turn, one
    response with a fenced block per file (the single-turn answer format); agentic, write every file +
    compile + verify in turn 1, profile in turn 2, finish in turn 3."""
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


def rollout(run: Run, n: int, demo_fraction: float, single_turn: bool, work_dir: str,
            key: str) -> list[tasks_mod.Trajectory]:
    """This rank's share of a global batch of n episodes (`deal`): tasks sampled from the actor and
    demonstrations replayed through the same env (flagged source="demo")."""
    cfg = run.cfg
    ecfg = dataclasses.replace(cfg.env, max_turns=1 if single_turn else cfg.env.max_turns, single_turn=single_turn,
                               work_dir=work_dir, final_check=True)
    task_picks, demo_picks = deal(run.tasks, run.demos, n, demo_fraction, f"{cfg.seed}:{key}")
    out = []
    run.model.eval()  # generation: KV cache on, gradient checkpointing off
    if task_picks:
        run.model.set_adapter("actor")
        sp = cfg.sampler
        pol = policy.HFPolicy(run.model, run.tok, max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                              seed=random.randrange(2 ** 31), engine=cfg.rollout_engine,  # fresh engine per update
                              kv_budget_gib=sp.kv_budget_gib, experts=sp.experts)
        out += env.run_episodes(pol, task_picks, run.pool, ecfg, tokenizer=run.tok)
    if demo_picks:
        scripts = {len(task_picks) + i: demo_script(files, single_turn) for i, (_, files) in enumerate(demo_picks)}
        demos = env.run_episodes(policy.ReplayPolicy(scripts), [t for t, _ in demo_picks], run.pool, ecfg,
                                 tokenizer=run.tok, id_offset=len(task_picks))
        out += [dataclasses.replace(t, source="demo") for t in demos]
    shutil.rmtree(work_dir, ignore_errors=True)  # trajectories keep the best workspace snapshot
    return out


def rollout_metrics(trajs: list[tasks_mod.Trajectory], rewards: list[float], seconds: float) -> dict:
    """Reward mean and -1/1/2/3 distribution, pass/faster rates, limit share, turns, generation tokens/s."""
    n = max(1, len(trajs))
    vs = [t.final_verdict or {} for t in trajs]
    m = {"reward_mean": sum(rewards) / n, "n": len(trajs), "n_demo": sum(t.source == "demo" for t in trajs)}
    for tier in (-1, 1, 2, 3):
        m[f"r{tier}"] = sum(1 for r in rewards if r == tier) / n
    m["pass_rate"] = sum(bool(v.get("correct")) for v in vs) / n
    m["faster_rate"] = sum(bool(v.get("correct")) and (v.get("speedup_compile") or 0) > 1 for v in vs) / n
    m["clipped_share"] = sum(ppo.truncated(t) for t in trajs) / n
    m["turns"] = sum(len(t.turns) for t in trajs) / n
    m["gen_tok_s"] = sum(sum(t.mask) for t in trajs if t.source == "policy") / max(seconds, 1e-9)
    return m


def print_sample(trajs: list[tasks_mod.Trajectory], tok, logger: runlog.Logger) -> None:
    """With --verbose, now and then a decoded sample: kernel RL fails in ways only samples show. ascii()
    escapes newlines, control characters and stray unicode, so random tokens cannot garble the terminal."""
    t = ([t for t in trajs if t.source == "policy"] or trajs)[0]
    text = tok.decode([i for i, m in zip(t.ids, t.mask) if m])[:300]
    logger.write(f"    sample [{t.source}] {t.task} reward {t.final_reward}: {ascii(text)}")


# ----------------------------------------------------------------------------------------------------------
# One PPO iteration (stages 1, 3, 4) and the two other stages.


def ppo_iteration(run: Run, stage: int, step: int, trajs: list | None = None, single_turn: bool = False,
                  demo_fraction: float = 0.0, train_actor: bool = True, heldout: list | None = None) -> None:
    """rollout -> reward -> score -> GAE -> PPO update -> log. Stage 3 passes stored `trajs` (no rollout),
    train_actor=False and a `heldout` split whose explained variance it reports."""
    cfg, rank, world = run.cfg, *rank_world()
    # 1) rollout: actor episodes (+ demonstrations in the tiny preset's warm-up), final sandbox verdicts included
    fresh = trajs is None
    if fresh:
        run.logger.phase("rollout")
        t0 = time.time()
        wd = os.path.join(cfg.out, "workspaces", f"s{stage}_{step}_r{rank}")
        n = cfg.agent.batch_size if stage == 4 else cfg.warmup.batch_size
        trajs = rollout(run, max(n, world), demo_fraction, single_turn, wd, key=f"{stage}:{step}")
        t_gen = time.time() - t0
        tasks_mod.save_trajectories(os.path.join(cfg.out, "rollouts", f"s{stage}_{step:04d}_r{rank}.jsonl"),
                                    trajs, stage=stage, step=step)
    # 2) reward: Eq. 1 milestone (or --env.reward speedup) of each final verdict, on the last policy token
    rewards = [reward.reward_from_verdict(t.final_verdict, cfg.env.reward) for t in trajs]
    learn = rewards  # what GAE sees; the logs and the rollouts keep each episode's own
    if stage == 4 and cfg.agent.permute_rewards:  # control: the step's rewards dealt out over all ranks' trajectories
        first = sum(all_ranks([len(rewards)])[:rank])
        learn = permuted_rewards(all_ranks(rewards), f"{cfg.seed}:permute:{stage}:{step}")[first:first + len(rewards)]
    b_ids, b_attn, b_mask, b_rewards = ppo.collate([t.ids for t in trajs], [t.mask for t in trajs], learn,
                                                   run.pad_id, run.device)                       # (B, T) each
    run.logger.phase("update")
    # 3) score: old values (critic), old log-probs (actor, recomputed by the trainer), reference log-probs
    pc, temperature = cfg.ppo, cfg.sampler.temperature
    b_values, b_logp, b_ref_logp = ppo.score(run.model, run.head, b_ids, b_attn, pc.micro_batch_size, temperature,
                                             need_logp=train_actor, need_ref=train_actor and pc.kl_coef > 0,
                                             b_mask=b_mask)                                       # (B, T)
    # the sampler-trainer gap on the tokens the rollout sampler drew (demonstrations have none), logged every
    # PPO step; --ppo.tis-cap corrects it with truncated importance weights (off: the paper corrects nothing). The
    # sampler records log-probs at temperature 1, so they compare with the trainer's only at temperature 1.
    b_tis, gap = None, {}
    if train_actor and temperature == 1.0:
        b_slp, b_smask = ppo.collate_sampler([t.logprobs if t.source == "policy" else None for t in trajs],
                                             b_mask)                                              # (B, T) each
        gap = ppo.sampler_gap(b_logp, b_slp, b_smask, pc.eps_low, pc.eps_high, pc.tis_cap)
        if pc.tis_cap is not None:
            b_tis = ppo.tis_weights(b_logp, b_slp, b_smask, pc.tis_cap)                         # (B, T)
    # 4) advantages: token-level GAE (Eq. 5, gamma 1, lambda 0.95); returns V + A are the critic's targets
    # (stage 3 fits them at --value.lam: the paper's 0.95 from the current critic; 1 = Monte-Carlo returns)
    lam = pc.lam if train_actor else cfg.value.lam
    b_adv, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask, pc.gamma, lam)               # (B, T) each
    m = {**rollout_metrics(trajs, rewards, t_gen)} if fresh else {}
    if learn is not rewards:
        m["reward_moved_share"] = sum(a != b for a, b in zip(learn, rewards)) / max(len(rewards), 1)
    m.update(ppo.score_stats(b_values, b_returns, b_adv, b_mask) | gap)
    if pc.whiten_advantages:
        b_adv = ppo.whiten_advantages(b_adv, b_mask)
    # 5) PPO update: clipped actor loss with clip-higher + critic loss, per-trajectory-then-batch means
    t1 = time.time()
    m.update(ppo.ppo_update(run.model, run.head, run.opt, pc, temperature, b_ids, b_attn, b_mask, b_logp, b_values,
                            b_adv, b_returns, b_ref_logp, train_actor=train_actor, b_tis=b_tis))
    n_tok = sum(len(t.ids) for t in trajs) * pc.epochs * (2 if train_actor else 1)  # actor + critic passes
    m["train_tok_s"] = n_tok / max(time.time() - t1, 1e-9)
    if heldout:
        m["heldout_explained_variance"], m["heldout_ev_final_reward"] = heldout_explained_variance(run, heldout)
    # 6) log (rank 0) and, now and then, one decoded sample (the caller checkpoints)
    run.logger.log(stage, step, gather_mean(m))
    if fresh and rank == 0 and cfg.verbose and cfg.sample_every and step % cfg.sample_every == 0:
        print_sample(trajs, run.tok, run.logger)


def heldout_explained_variance(run: Run, trajs: list) -> tuple[float, float]:
    """The critic's explained variance on trajectories it is not trained on (stage 3; paper Fig. 5), against
    its own training targets (GAE returns at --value.lam) and against the final reward (Monte-Carlo, lambda 1:
    what a critic must predict whatever lambda; with --value.lam 1 the two are the same)."""
    rewards = [reward.reward_from_verdict(t.final_verdict, run.cfg.env.reward) for t in trajs]
    b_ids, b_attn, b_mask, b_rewards = ppo.collate([t.ids for t in trajs], [t.mask for t in trajs], rewards,
                                                   run.pad_id, run.device)
    cfg = run.cfg
    b_values, _, _ = ppo.score(run.model, run.head, b_ids, b_attn, cfg.ppo.micro_batch_size, cfg.sampler.temperature,
                               need_logp=False)
    _, b_returns = ppo.compute_gae(b_rewards, b_values, b_mask, cfg.ppo.gamma, cfg.value.lam)           # (B, T)
    _, final = ppo.compute_gae(b_rewards, b_values, b_mask, cfg.ppo.gamma, 1.0)  # (B, T) Monte-Carlo returns
    on = b_mask > 0
    if on.sum() < 2:
        return float("nan"), float("nan")
    v = b_values[on]
    return (ppo.explained_variance(v, b_returns[on], torch.ones_like(v)),
            ppo.explained_variance(v, final[on], torch.ones_like(v)))


def mixed_tasks(tasks: list, outcomes: list[tuple[str, bool]]) -> tuple[list, dict[str, list[int]]]:
    """(the tasks passed in some but not all of their probe episodes, in `tasks` order; per task name
    [passed, episodes]). outcomes: (task name, correct) per probe episode. No task mixed: all tasks (a
    stage on them still shows whether the actor holds up)."""
    counts = {t.name: [0, 0] for t in tasks}
    for name, ok in outcomes:
        counts[name][0] += bool(ok)
        counts[name][1] += 1
    mixed = [t for t in tasks if 0 < counts[t.name][0] < counts[t.name][1]]
    return mixed or list(tasks), counts


def agent_tasks(run: Run, start: int) -> list:
    """Stage 4's tasks (--agent.mixed-probe): sample the actor --agent.mixed-probe times on every task (rollouts/
    probe_s4_r*.jsonl), keep `mixed_tasks`. The choice goes to OUT/stage4_tasks.json; a resumed stage 4
    reads it back."""
    cfg, (rank, world) = run.cfg, rank_world()
    path = os.path.join(cfg.out, "stage4_tasks.json")
    if cfg.agent.mixed_probe <= 0:
        if start == 0 and rank == 0 and os.path.exists(path):
            os.remove(path)  # an earlier run's choice in this --out
        return run.tasks
    if start > 0 and os.path.exists(path):
        with open(path) as f:
            names = set(json.load(f)["tasks"])
        return [t for t in run.tasks if t.name in names]
    t0 = time.time()
    run.logger.phase("rollout")
    trajs = rollout(run, cfg.agent.mixed_probe * len(run.tasks), 0.0, cfg.env.max_turns == 1,
                    os.path.join(cfg.out, "workspaces", f"probe_s4_r{rank}"), key="4:probe")
    tasks_mod.save_trajectories(os.path.join(cfg.out, "rollouts", f"probe_s4_r{rank}.jsonl"), trajs, stage=4,
                                step=-1)
    chosen, counts = mixed_tasks(run.tasks, all_ranks([(t.task, bool((t.final_verdict or {}).get("correct")))
                                                       for t in trajs]))
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            json.dump({"tasks": [t.name for t in chosen], "probe": counts, "seconds": time.time() - t0}, f)
        os.replace(path + ".tmp", path)
        run.logger.write(f"[ppo] stage-4 probe, {cfg.agent.mixed_probe} episodes per task: " +
                         ", ".join(f"{n} {a}/{b}" for n, (a, b) in counts.items()) +
                         f"; training on {len(chosen)} of {len(run.tasks)} tasks ({time.time() - t0:.0f} s)")
    if world > 1:
        dist.barrier()
    return chosen


def ppo_steps(run: Run, stage: int, n_steps: int, start: int, single_turn: bool, demo_fraction: float) -> None:
    """The steps of stage 1 (single-turn warm-up) or stage 4 (agentic PPO). With --ppo.kl-coef, the KL reference
    is the actor as this stage found it (stage 4: the RFT actor), snapshotted here; a resumed run restores the
    snapshot from the checkpoint."""
    if run.cfg.ppo.kl_coef > 0 and (start == 0 or ppo.REF not in run.model.peft_config):
        ppo.snapshot_reference(run.model)
    for step in range(start, n_steps):
        ppo_iteration(run, stage, step, single_turn=single_turn, demo_fraction=demo_fraction)
        checkpoint(run, stage, step + 1, force=step + 1 == n_steps)


def warmup_stage(run: Run, start: int) -> None:
    """Stage 1: single-turn PPO warm-up, demonstrations mixed in (--demos.fraction)."""
    ppo_steps(run, 1, run.cfg.warmup.steps, start, single_turn=True, demo_fraction=run.cfg.demos.fraction)


def _stage2_file(run: Run) -> str:
    return os.path.join(run.cfg.out, f"stage2_trajectories_r{rank_world()[0]}.jsonl")


def rft_stage(run: Run, start: int) -> None:
    """Stage 2: agent trajectories from the warm-up policy (+ demos), rft_filter, SFT on action tokens.
    Step 0 collects (its trajectories are saved for stage 3 and for resume); steps 1..rft.steps are SFT.
    Skipped when neither RFT nor value pretraining (which needs the trajectories) runs."""
    cfg, rc, (rank, world) = run.cfg, run.cfg.rft, rank_world()
    if rc.steps <= 0 and cfg.value.steps <= 0:
        return
    if start == 0:
        run.logger.phase("rollout")
        t0 = time.time()
        n = max(rc.rollouts, world)
        trajs = rollout(run, n, cfg.demos.fraction, cfg.env.max_turns == 1,
                        os.path.join(cfg.out, "workspaces", f"s2_r{rank}"), key="2:0")
        tasks_mod.save_trajectories(_stage2_file(run) + ".tmp", trajs, stage=2, step=0)
        os.replace(_stage2_file(run) + ".tmp", _stage2_file(run))
        kept = [t for t in trajs if rft_sample(t, rc) is not None]
        rewards = [reward.reward_from_verdict(t.final_verdict, cfg.env.reward) for t in trajs]
        m = {**rollout_metrics(trajs, rewards, time.time() - t0), "n_kept": len(kept),
             "n_kept_demo": sum(t.source == "demo" for t in kept)}
        run.logger.log(2, 0, gather_mean(m, totals=("n_kept", "n_kept_demo")))
        checkpoint(run, 2, 1, force=True)
        start = 1
    trajs = tasks_mod.load_trajectories(_stage2_file(run))
    # data parallel: the filter keeps different counts on different ranks, so every rank pools all ranks'
    # kept trajectories and each step deals out one global batch round-robin (a pool smaller than the
    # number of ranks is sampled with replacement, so that every rank has a row)
    kept = all_ranks([(*x, t.task) for t, x in ((t, rft_sample(t, rc)) for t in trajs) if x is not None])
    if not kept and rc.steps > 0:
        print("[ppo] RFT: no trajectory passed the filter (reward > 0, no loops/invalid calls): SFT skipped")
        return
    for step in range(start, rc.steps + 1):
        repro = reproduction(run, kept) if rc.target is not None else {}
        # every kept task within reach: stop here (rank 0 decides, so that no rank waits in a collective alone)
        if repro and all_ranks([min(repro.values()) >= rc.target])[0]:
            run.logger.write(f"[ppo] RFT: every kept task's trajectory has p >= {rc.target} (--rft.target; "
                             f"min {min(repro.values()):.2f}) after {step - 1} SFT steps")
            checkpoint(run, 2, step, force=True)
            return
        t1 = time.time()
        rng = random.Random(cfg.seed * 1_000_003 + step)  # the same global batch on every rank
        n = max(min(len(kept), rc.batch_size), world)
        batch = rng.sample(kept, n) if n <= len(kept) else rng.choices(kept, k=n)
        local = batch[rank::world]
        b_ids, b_attn, b_mask, _ = ppo.collate([x[0] for x in local], [x[1] for x in local], None, run.pad_id,
                                               run.device)
        st = ppo.sft_update(run.model, run.opt["actor"], cfg.ppo, cfg.sampler.temperature, b_ids, b_attn, b_mask,
                            n_global=n)
        st.update(n_kept=len(kept), train_tok_s=sum(len(x[0]) for x in local) / max(time.time() - t1, 1e-9))
        if repro:
            st["rft_repro_min"] = min(repro.values())
        run.logger.log(2, step, gather_mean(st))
        checkpoint(run, 2, step + 1, force=step == rc.steps)
    if rc.target is not None:
        run.logger.write(f"[ppo] RFT: --rft.steps {rc.steps} reached before --rft.target {rc.target}")


@torch.no_grad()
def reproduction(run: Run, kept: list) -> dict[str, float]:
    """Per kept task, the probability that the actor samples the action tokens of its likeliest kept
    trajectory, given that trajectory's observations: exp(sum of log pi over its mask) at the sampling
    temperature; how closely SFT has fitted the task, what --rft.target stops stage 2 on (a rollout sees other
    observations, so this is not its pass rate). kept: (ids, mask, task name), the same on every rank."""
    logp: dict[str, float] = {}
    for i in range(0, len(kept), run.cfg.ppo.micro_batch_size):
        rows = kept[i:i + run.cfg.ppo.micro_batch_size]
        b_ids, b_attn, b_mask, _ = ppo.collate([x[0] for x in rows], [x[1] for x in rows], None, run.pad_id,
                                               run.device)
        run.model.eval()
        lp, _ = ppo.actor_logprobs(run.model, b_ids, b_attn, run.cfg.sampler.temperature, mask=b_mask)
        for (_, _, name), s in zip(rows, (lp * b_mask).sum(-1).tolist()):
            logp[name] = max(logp.get(name, -float("inf")), s)
    return {k: float(np.exp(v)) for k, v in logp.items()}


def rft_sample(t: tasks_mod.Trajectory, cfg: RFTConfig) -> tuple[list[int], list[int]] | None:
    """What stage 2 imitates of one trajectory: (ids, mask), or None if `ppo.rft_filter` drops it. With
    --rft.drop-no-call-turns the agent turns that called no tool leave the mask (`ppo.drop_turns`); a
    trajectory with no policy token left is dropped."""
    if not ppo.rft_filter([t], drop_truncated=cfg.drop_truncated):
        return None
    mask = list(t.mask)
    if cfg.drop_no_call_turns and t.stop_reason != "single_turn":
        # one mask run per assistant turn that sampled tokens (a 0-token turn has none)
        sampled = [m.get("token_ids") != [] for m in t.messages if m["role"] == "assistant"]
        keep = [bool(turn["calls"]) for turn, s in zip(t.turns, sampled) if s]
        mask = ppo.drop_turns(mask, keep)
    return (list(t.ids), mask) if any(mask) else None


def value_stage(run: Run, start: int) -> None:
    """Stage 3: fit the critic to the returns at --value.lam (1: Monte-Carlo, the final reward; < 1: GAE
    returns recomputed from the current critic each step) on the stage-2 trajectories, actor frozen; report
    explained variance on a held-out split, against those targets and against the final reward."""
    cfg, vc = run.cfg, run.cfg.value
    if vc.steps <= 0:
        return
    trajs = tasks_mod.load_trajectories(_stage2_file(run))
    idx = list(range(len(trajs)))
    random.Random(cfg.seed).shuffle(idx)  # a fixed split, the same after resume
    n_held = max(1, int(round(len(trajs) * vc.heldout))) if len(trajs) > 1 else 0
    held, train_set = [trajs[i] for i in idx[:n_held]], [trajs[i] for i in idx[n_held:]]
    for step in range(start, vc.steps):
        batch = random.sample(train_set, min(len(train_set), local_share(max(vc.batch_size, rank_world()[1]))))
        ppo_iteration(run, 3, step, trajs=batch, train_actor=False, heldout=held)
        checkpoint(run, 3, step + 1, force=step + 1 == vc.steps)


def agent_stage(run: Run, start: int) -> None:
    """Stage 4: agentic PPO on the tasks the probe chose (`agent_tasks`); single-turn with --env.max-turns 1."""
    run.tasks = agent_tasks(run, start)
    ppo_steps(run, 4, run.cfg.agent.steps, start, single_turn=run.cfg.env.max_turns == 1, demo_fraction=0.0)


# The four stages of §3.3, in order; each runs its steps from `start` (a resumed run's step) on.
STAGE_RUNNERS = {1: warmup_stage, 2: rft_stage, 3: value_stage, 4: agent_stage}


def stage_steps(cfg: TrainConfig, stage: int) -> int:
    return {1: cfg.warmup.steps, 2: cfg.rft.steps, 3: cfg.value.steps, 4: cfg.agent.steps}[stage]


def begin_stage(run: Run, stage: int, start: int, ck: dict | None) -> None:
    """A fresh AdamW per stage (different objectives; stage 2's SFT at --rft.lr when set), its state from the
    checkpoint `ck` when resuming inside the stage; the stage's header and progress bar."""
    cfg = run.cfg
    lr = cfg.rft.lr if stage == 2 and cfg.rft.lr is not None else cfg.ppo.lr_actor
    run.opt = ppo.make_optimizers(run.model, run.head, dataclasses.replace(cfg.ppo, lr_actor=lr))
    if ck and start > 0:
        for k, o in run.opt.items():
            o.load_state_dict(ck["opt"][k])
    n = stage_steps(cfg, stage)
    upto = f"up to {n} steps, until --rft.target {cfg.rft.target}" if stage == 2 and cfg.rft.target else f"{n} steps"
    print(f"[ppo] ==== stage {stage}) {STAGES[stage]}: {upto} (from {start}) ====", flush=True)
    # bar length in logged rows: stage 2 logs its collection as step 0 (also run when only stage 3 needs the
    # trajectories), then SFT steps 1..rft.steps
    rows = (cfg.rft.steps + 1 if cfg.rft.steps > 0 or cfg.value.steps > 0 else 0) if stage == 2 else n
    run.logger.start_stage(stage, rows, start)


# ----------------------------------------------------------------------------------------------------------
# Entry point


def setup(cfg: TrainConfig) -> torch.device:
    """This process's device; with `accelerate launch` (WORLD_SIZE > 1) also the process group."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        acc = Accelerator()  # sets up the process group (NCCL on GPUs, gloo on CPUs) and this rank's device
        local = int(os.environ.get("LOCAL_RANK", acc.local_process_index))
        assert acc.device.type == "cpu" or local not in cfg.pool.gpus, "a training GPU is also a sandbox GPU"
        return acc.device
    return torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                        ("cpu" if cfg.device == "auto" else cfg.device))


def start_run(cfg: TrainConfig) -> tuple[Run, int, int, dict | None]:
    """(the run, the stage and step it starts at, the checkpoint it resumes from or None): devices and seeds,
    OUT/config.json, models, tasks, demonstrations and the sandbox pool; with --resume, OUT/checkpoint.pt."""
    # --sandbox.device auto (the default) -> cuda when torch lists a GPU, else cpu; resolved once, here
    sb = dataclasses.replace(cfg.sandbox, device=env.resolve_device(cfg.sandbox.device))
    cfg = dataclasses.replace(cfg, sandbox=sb)
    assert cfg.ppo.tis_cap is None or cfg.sampler.temperature == 1.0, \
        (f"--ppo.tis-cap needs --sampler.temperature 1 (got {cfg.sampler.temperature}): the rollout sampler "
         f"records log-probs at 1")
    device = setup(cfg)
    rank, world = rank_world()
    if cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    os.makedirs(cfg.out, exist_ok=True)
    if rank == 0:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
    model, head, tok = build_models(cfg, device)
    tasks = tasks_mod.load_tasks(cfg.tasks)
    assert tasks, f"no tasks in {cfg.tasks}"
    dc = cfg.demos
    demos = tasks_mod.load_demos(dc.dir, tasks, "cuda" if cfg.sandbox.device == "cuda" else "cpu") \
        if dc.fraction > 0 else []
    assert not (dc.dir and dc.fraction > 0) or demos, f"no demonstrations for these tasks in {dc.dir}"
    print(f"[ppo] {len(tasks)} tasks, {len(demos)} demonstrations ({dc.fraction:.0%} of stage-1/2 batches, "
          f"flagged source=demo), device {device}, rank {rank}/{world}", flush=True)
    gpus = cfg.pool.gpus[rank::world] if cfg.pool.gpus else None
    if cfg.sandbox.device == "cuda" and device.type == "cuda" and not gpus and not cfg.sandbox.ray_address:
        print("[ppo] WARNING: no --pool.gpus: kernels are timed on GPU 0 next to training (noisy rewards)")
    pool = sandbox_ray.make_pool(dataclasses.replace(cfg.sandbox, seed=cfg.seed), gpus=gpus,  # --sandbox.ray-address:
                                 cpu_slots=cfg.pool.cpu_slots)                               # the cluster's lanes
    if cfg.sandbox.device == "cuda" and cfg.pool.prewarm > 0:  # nothing is timed yet: compile in parallel
        t0 = time.time()
        warmed = pool.prewarm([t.code for t in tasks[rank::world]], cfg.pool.prewarm)
        print(f"[ppo] prewarmed {len(warmed)} uncached task baselines in {time.time() - t0:.0f} s", flush=True)
    stage, start, ck = 1, 0, None
    metrics = os.path.join(cfg.out, "metrics.jsonl")
    if cfg.resume:
        ck = runlog.load_checkpoint(cfg.out, model, head)
        if ck:
            stage, start = ck["stage"], ck["step"]
            if rank > 0:  # load_checkpoint restored rank 0's RNG states
                restore_rng(cfg.out, rank, stage, start, cfg.seed)
            print(f"[ppo] resumed from {cfg.out}/checkpoint.pt at stage {stage} ({STAGES.get(stage, 'done')}), "
                  f"step {start}", flush=True)
    if rank == 0:
        if ck:
            runlog.truncate_metrics(metrics, stage, start)
        elif os.path.exists(metrics):
            os.remove(metrics)  # a fresh run in an old --out
    logger = runlog.Logger(cfg.out, cfg.tensorboard, rank == 0, cfg.verbose)
    return Run(cfg, model, head, tok, pool, tasks, demos, logger), stage, start, ck


def train(cfg: TrainConfig) -> int:
    """Run the four stages in order (§3.3), resuming from OUT/checkpoint.pt with --resume."""
    run, stage, start, ck = start_run(cfg)
    try:
        for s in range(stage, 5):
            begin_stage(run, s, start, ck)
            STAGE_RUNNERS[s](run, start)
            run.logger.close()
            checkpoint(run, s + 1, 0, force=True)
            start, ck = 0, None  # later stages start at their first step
    finally:
        run.logger.close()
        run.pool.close()
    rank, world = rank_world()
    if world > 1:  # the last checkpoint was the last collective call
        dist.destroy_process_group()
    out, metrics = run.cfg.out, os.path.join(run.cfg.out, "metrics.jsonl")
    if rank == 0 and os.path.exists(metrics):
        print(f"\n{runlog.summary(out)}\n"
              f"good: reward rises and pass rate > 0 in stage 4, RFT keeps some trajectories, stage-3 explained "
              f"variance near 1 (Eq. 1: -1 fail, 1 correct, 2 beats eager, 3 beats torch.compile)\n"
              f"[ppo] done: {runlog.plot_curves(out)}, {metrics}, rollouts in {out}/rollouts",
              flush=True)
    return 0
