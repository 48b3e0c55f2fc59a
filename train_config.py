"""The training run's configuration: `TrainConfig` (every flag of `cuda_agent.py train`, with what the paper
states and what is ours) and the two presets, `tiny` (CPU, offline, minutes) and `paper` (§4.1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import env
import sandbox


@dataclass
class TrainConfig:
    preset: str = "tiny"
    """preset the other defaults came from: tiny (CPU, offline, minutes) | paper (the paper's recipe, GPU node)"""
    out: str = "runs/tiny"
    """run directory: checkpoints, metrics.jsonl, rollouts/*.jsonl, curves.png"""
    resume: bool = False
    """pick up the last checkpoint in --out (stage and step included)"""
    seed: int = 0
    """the one seed (python, numpy, torch, sampling)"""
    model: str = "tiny"
    """tiny = random tiny Qwen3-MoE + local tokenizer (offline); else a HF hub id or local path"""
    tasks: str = "data/tasks_tiny4.jsonl"
    """training tasks, anything tasks.load_tasks accepts (synth JSONL, Ops-6K parquet, HF id); tiny: 4 pointwise
    tasks of data/tasks_tiny.jsonl, each with a demonstration, few enough for the tiny model to learn them all"""
    demos: str | None = "data/demos"
    """demo solutions (dir of <task hash>/<backend>/) mixed into stage 1/2 rollouts; none = off"""
    demo_fraction: float = 0.5
    """share of each stage-1 and stage-2 rollout batch filled with demonstration trajectories"""
    device: str = "auto"
    """training device: auto | cpu | cuda (with accelerate launch: the local rank's GPU)"""
    cpu_threads: int = 1
    """torch CPU threads; 1 avoids OpenMP oversubscription next to sandbox jobs"""
    sandbox_gpus: list[int] = field(default_factory=list)
    """GPU ids set aside for the sandbox pool (never used for training)"""
    sandbox_cpu_slots: int = 2
    """concurrent verify/profile jobs when sandbox_device is cpu (timing is noisier above 1)"""
    sandbox_prewarm: int = 8
    """cuda sandbox: before stage 1, compile the torch.compile baselines of uncached tasks this many at a time
    (sandbox.prewarm), instead of one at a time inside timed checks; 0 = off"""
    bf16: bool = False
    """bf16 weights and activations (GPU)"""
    grad_checkpointing: bool = False
    """gradient checkpointing of the base model (GPU, long contexts)"""
    offload_activations: bool = False
    """PPO and SFT updates: keep what each forward saves for its backward in host memory, pinned, until the
    backward (`ppo.offload_activations`; the scoring pass saves nothing). With --grad-checkpointing that is each
    decoder layer's input, T x hidden per layer: 24 GiB at 131,072 tokens on Qwen3-30B-A3B. Ours (the paper
    does not say how its 128k-token trajectories fit); off: on the GPU"""
    max_new_tokens: int = 96
    """tokens sampled per assistant turn"""
    temperature: float = 1.0
    """sampling temperature (log-probs in the loss use the same temperature); tiny: 1.0, so that the RFT actor
    passes some tasks sometimes but not always (at 0.5 each task's outcome is nearly fixed and stage 4 has no
    contrast to learn from); paper: 1.0 (not stated)"""
    rollout_engine: bool = True
    """sample rollouts with generate.Engine (per-episode KV cache reused across turns); off: the plain
    model.generate loop that re-encodes each conversation every turn"""
    rollout_experts: str | None = None
    """MoE experts implementation for the rollout engine's forwards (generate.Engine(experts=)): "fused" =
    moe_kernel.py's Triton decode kernels (H200, A3B shape: 1.6x transformers' grouped GEMM per layer at 32
    rows, docs/RESULTS.md §3); None: the model's default"""
    kv_budget_gib: float | None = None
    """GPU memory for the rollout engine's KV caches; beyond it idle episodes' caches go to pinned host memory
    (generate.Engine; None: no limit). paper: 40 (ours: an H200 keeps ~75 GB for weights, adapters and
    optimizer state; 64 episodes of 16k tokens hold 96 GiB of KV at that shape)"""
    lora_rank: int = 8
    """LoRA rank of both adapters"""
    lora_alpha: float = 16.0
    """LoRA alpha (scale = alpha / rank)"""
    lora_targets: str = "attention,experts"
    """comma-separated subset of attention | experts (fused 3-D MoE params) | mlp (dense MLP)"""
    lr_actor: float = 2e-4
    """actor LoRA learning rate of the PPO stages 1 and 4 (paper full fine-tuning: 3e-6; LoRA needs ~10x more);
    tiny: 2e-4 with --ppo-epochs 4 (at 1e-3 one update collapses the RFT actor)"""
    lr_rft: float | None = 2e-3
    """actor LoRA learning rate of stage 2's SFT (none = --lr-actor; paper: not stated). Tiny: 40x the PPO rate,
    to learn the demonstrations in 80 steps; PPO at that rate makes one Adam step of the same size out of
    the near-zero gradients of a policy that already reproduces them, and collapses it"""
    lr_critic: float = 4e-3
    """critic LoRA learning rate (paper full fine-tuning: 6e-6; the paper preset keeps the paper's 2:1
    critic:actor ratio; tiny: the critic has 4 stage-3 steps to fit)"""
    lr_head: float = 1e-2
    """learning rate of the freshly initialised scalar value head"""
    batch_size: int = 4
    """trajectories per PPO step, summed over ranks (paper: 1024); tiny: 4, each task once a step"""
    agent_batch_size: int | None = 8
    """stage 4: trajectories per PPO step, summed over ranks (none = --batch-size). Tiny: 8, each task the probe
    keeps 2-8 times a step: samples of one task to compare, with both outcomes more often than in 4"""
    micro_batch_size: int = 2
    """trajectories per forward/backward (gradient accumulation; the loss is invariant to it)"""
    ppo_epochs: int = 4
    """passes over each batch (paper: "one update per batch" -> 1); tiny: 4, so that a batch of a few episodes
    moves the actor within the clip range instead of by one unclipped step (updates cost little next to
    rollouts)"""
    num_minibatches: int = 2
    """optimizer steps per epoch (paper: 1); tiny: 2, eight smaller AdamW steps per PPO step instead of four,
    each of them inside the clip range of the batch it was computed on"""
    eps_low: float = 0.2
    """lower clip range of the ratio (Eq. 5)"""
    eps_high: float = 0.28
    """upper clip range of the ratio, clip-higher (Eq. 5)"""
    gamma: float = 1.0
    """GAE discount (paper: 1)"""
    lam: float = 1.0
    """GAE lambda of stages 1 and 4 (paper: 0.95). Tiny: 1, advantages R - V(s_t): the correctness of a tiny
    episode is decided by its first turn, 20-70 policy tokens before the reward, where 0.95^k leaves
    mostly the noise of a 4-step critic"""
    kl_coef: float = 0.1
    """KL penalty coefficient, k3 estimator, against the actor as each PPO stage found it (stage 4: the RFT
    actor) (paper: not stated; 0 = off); tiny: 0.1, to keep stage 4 near the RFT actor"""
    entropy_coef: float = 0.0
    """entropy bonus (paper: not stated; 0 = off)"""
    vf_clip: float | None = None
    """value-loss clip range around the old values (none = unclipped)"""
    tis_cap: float | None = None
    """truncated importance sampling against the sampler-trainer gap: each policy token's loss is weighted by
    min(pi_old / pi_sampler, C) (ppo.tis_weights, token-level TIS as in verl's rollout correction; C = 2 is a
    common choice); none = off, the paper (which corrects nothing). Needs --temperature 1: the sampler records
    its log-probs at temperature 1"""
    whiten_advantages: bool = True
    """whiten advantages over the batch (paper: not stated)"""
    max_grad_norm: float = 1.0
    """gradient-norm clip per optimizer (paper: not stated)"""
    warmup_steps: int = 2
    """stage 1: single-turn PPO warm-up steps"""
    rft_rollouts: int = 16
    """stage 2: agent trajectories collected with the warm-up policy (before filtering)"""
    rft_steps: int = 200
    """stage 2: SFT steps on the filtered trajectories (with --rft-target: at most); 0 = no RFT (ablation)"""
    rft_target: float | None = 0.2
    """stage 2: stop SFT once the actor samples the action tokens of every kept task's likeliest kept
    trajectory with at least this probability (`train.reproduction`, one forward over the kept pool per
    step); none = exactly --rft-steps (paper preset). Ours, for the tiny preset: a fixed 65 steps left one run's
    actor passing 0 of 16 probe episodes and another's 10 of 16; at 0.2 SFT took 68-81 steps and stage 4
    passed 3-5 of 8 episodes in its first step (docs/RESULTS.md §1)"""
    rft_batch_size: int = 2
    """stage 2: trajectories per SFT step"""
    rft_drop_truncated: bool = False
    """stage 2: also drop trajectories that hit the turn, context or token limit (not in the paper's filter)"""
    rft_drop_no_call_turns: bool = True
    """stage 2: no SFT on agent turns that made no tool call (the paper's "redundant turns"); single-turn exempt"""
    value_pretrain_steps: int = 4
    """stage 3: critic-only steps on the stage-2 trajectories; 0 = no value pretraining (ablation)"""
    value_heldout: float = 0.25
    """stage 3: share of the stage-2 trajectories held out to report explained variance"""
    value_lam: float = 1.0
    """stage 3: GAE lambda of the critic's targets, recomputed from the current critic each step (paper: 0.95,
    its value pretraining fits GAE targets; the paper preset's); tiny: 1, Monte-Carlo returns (the final reward
    at every token, independent of the critic being fitted), for the reason given under --lam"""
    agent_steps: int = 24
    """stage 4: agentic PPO steps (paper: 150). The tiny preset's 24 (192 episodes): at 12 its stage 4 rose
    above a frozen-actor control in 2 of 5 seeds (docs/RESULTS.md)"""
    mixed_probe: int = 4
    """stage 4: before its first step, sample the RFT actor this many times on every task and train stage 4 on
    the tasks it passed in some but not all of them (`mixed_tasks`; none such: all tasks); 0 = all tasks.
    Ours (the paper's 6K tasks are not filtered this way); like DAPO's dynamic sampling, which drops prompts
    whose samples all pass or all fail: such a batch gives PPO no contrast to learn from"""
    permute_rewards: bool = False
    """stage 4 control, not training: before GAE, deal each step's Eq. 1 rewards out among its trajectories at
    random, no trajectory keeping its own (`permuted_rewards`, seeded by --seed and the step): the same rewards
    and batch statistics, none tied to the episode that earned it. Beside --lr-actor 0 (a frozen actor) it
    separates learning from the reward from drift of the update itself (scripts/stage4_control.sh); off: the
    paper"""
    checkpoint_every: int = 1
    """write a checkpoint every N steps (and at the end of each stage)"""
    verbose: bool = False
    """print every step's full metric line and, every sample_every steps, one decoded sample trajectory"""
    sample_every: int = 1
    """with --verbose: print one decoded sample trajectory every N steps"""
    tensorboard: bool = False
    """also log to TensorBoard (OUT/tb)"""
    env: env.EnvConfig = field(default_factory=lambda: env.EnvConfig(max_turns=4, max_context_tokens=4096,
                                                                     tool_workers=4))
    """the agent environment of stages 1, 2 and 4: --env.max-turns 1 = no agent loop (single-turn ablation),
    --env.reward speedup (ablation), --env.max-context-tokens (paper: 32k single-turn, 128k agentic)"""
    sandbox: sandbox.SandboxConfig = field(default_factory=lambda: sandbox.SandboxConfig(device="auto", warmup=2,
                                                                                          iters=10))
    """the sandbox that compiles, verifies and times candidates: --sandbox.device auto | cpu | cuda (auto: cuda
    when torch lists a GPU, else cpu; its seed is --seed). Tiny: 2 warm-up and 10 timed calls (default 5 and
    50): on the CPU the 55 timed calls were 5.3 s of a profiled check's 8.1 s, and checks ~90% of stage 4's
    time (docs/RESULTS.md §1)"""


# The paper's recipe (§4.1) where it states one; ours (marked) where it does not.
PRESETS = {
    "tiny": TrainConfig(),
    "paper": TrainConfig(
        preset="paper", out="runs/paper", model="Qwen/Qwen3-Coder-30B-A3B-Instruct", temperature=1.0,
        tasks="BytedTsinghua-SIA/CUDA-Agent-Ops-6K", demos=None, demo_fraction=0.0,
        env=env.EnvConfig(max_turns=150, max_context_tokens=131072, tool_workers=4),
        sandbox=sandbox.SandboxConfig(device="cuda"), bf16=True, grad_checkpointing=True, max_new_tokens=8192,
        lora_rank=16, lora_alpha=32.0,       # ours: ~0.63B parameters per adapter on Qwen3-30B-A3B (r = 16)
        lr_actor=3e-5, lr_rft=None, lr_critic=6e-5, lr_head=1e-4, kl_coef=0.0,  # ours: ~10x the paper's rates
        batch_size=1024, agent_batch_size=None, micro_batch_size=1,
        ppo_epochs=1, num_minibatches=1,     # "one update per batch"
        lam=0.95, value_lam=0.95,            # GAE of stages 1 and 4, and of stage 3's targets (§4.1, §3.3)
        warmup_steps=50, rft_rollouts=1024, rft_steps=200, rft_target=None, rft_batch_size=64,  # ours
        value_pretrain_steps=50, agent_steps=150, checkpoint_every=1, sample_every=10, kv_budget_gib=40.0,
        rollout_experts="fused",             # ours: the Triton decode experts (docs/RESULTS.md §3)
        mixed_probe=0),                      # the paper trains on all its tasks
}
