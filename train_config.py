"""The training run's configuration: `TrainConfig` (every flag of `cuda_agent.py train`), nested by who reads each
setting, and the two presets, `tiny` (CPU, offline, minutes) and `paper` (§4.1).

  TrainConfig       the run: model, tasks, output, devices, logging
    .demos          demonstrations mixed into stage-1/2 rollouts (tiny preset)
    .lora           the actor and critic adapters (ppo.add_actor_critic_adapters)
    .sampler        how rollouts are sampled (policy.HFPolicy); the updates' log-probs use its temperature
    .ppo            the updates and advantages (ppo.PPOConfig: make_optimizers, ppo_update, sft_update, GAE)
    .warmup         stage 1, single-turn PPO warm-up
    .rft            stage 2, rejection fine-tuning
    .value          stage 3, value pretraining
    .agent          stage 4, agentic PPO
    .env            the agent environment of stages 1, 2 and 4 (env.EnvConfig)
    .sandbox        how candidates are compiled, verified and timed (sandbox.SandboxConfig)
    .pool           the sandbox pool that runs those checks: its GPUs, CPU slots, prewarm

Why the tiny preset's values (docs/RESULTS.md §1 has the runs):
  * sampler.temperature 1: the RFT actor passes some tasks sometimes but not always; at 0.5 each task's outcome
    is nearly fixed and stage 4 has no contrast to learn from.
  * ppo.lr_actor 2e-4 with ppo.epochs 4 and ppo.num_minibatches 2: eight small AdamW steps per PPO step, each
    inside the clip range of its batch; at 1e-3 one update collapses the RFT actor. rft.lr 2e-3 (40x): learns
    the demonstrations in ~80 SFT steps; PPO at that rate collapses a policy that already reproduces them.
  * ppo.lam and value.lam 1 (Monte-Carlo returns): a tiny episode's correctness is decided by its first turn,
    20-70 policy tokens before the reward, where 0.95^k leaves mostly the noise of a 4-step critic.
  * ppo.kl_coef 0.1 keeps stage 4 near the RFT actor; ppo.lr_critic 4e-3: the critic has 4 stage-3 steps.
  * rft.target 0.2: a fixed 65 SFT steps left one run's actor passing 0 of 16 probe episodes and another's 10
    of 16; at 0.2 SFT took 68-81 steps and stage 4 passed 3-5 of 8 episodes in its first step.
  * agent.steps 24 (192 episodes): at 12 stage 4 rose above a frozen-actor control in 2 of 5 seeds.
    agent.batch_size 8: each task the probe keeps, 2-8 times a step, with both outcomes more often than in 4.
  * agent.mixed_probe 4 (ours; the paper's 6K tasks are not filtered this way): like DAPO's dynamic sampling,
    which drops prompts whose samples all pass or all fail, since such a batch gives PPO nothing to contrast.
  * sandbox warmup 2 / iters 10 (default 5 / 50): on the CPU the 55 timed calls were 5.3 s of a profiled
    check's 8.1 s, and checks ~90% of stage 4's time.
  * sampler.kv_budget_gib 40 (paper preset): an H200 keeps ~75 GB for weights, adapters and optimizer state;
    64 episodes of 16k tokens hold 96 GiB of KV at Qwen3-30B-A3B's shape.
  * ppo.offload_activations (ours; the paper does not say how its 128k-token trajectories fit): with
    --grad-checkpointing each decoder layer's input, 24 GiB at 131,072 tokens on Qwen3-30B-A3B.

Flags the run sets itself are not shown: --env.single-turn, --env.work-dir and --env.final-check (each stage's
rollout sets them) and --sandbox.seed (it is --seed); `cli_registry` hides them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated

import tyro
from tyro.constructors import ConstructorRegistry, StructConstructorSpec, StructTypeInfo
from tyro.constructors._struct_spec_dataclass import dataclass_rule

import env
import policy
import sandbox
from ppo import PPOConfig


@dataclass
class DemoConfig:
    dir: str | None = "data/demos"
    """demo solutions (dir of <task hash>/<backend>/) mixed into stage 1/2 rollouts; None = off"""
    fraction: float = 0.5
    """share of each stage-1 and stage-2 rollout batch filled with demonstration trajectories"""


@dataclass
class LoraConfig:
    rank: int = 8
    """LoRA rank of both adapters"""
    alpha: float = 16.0
    """LoRA alpha (scale = alpha / rank)"""
    targets: str = "attention,experts"
    """comma-separated subset of attention | experts (fused 3-D MoE params) | mlp (dense MLP)"""


@dataclass
class WarmupConfig:
    steps: int = 2
    """single-turn PPO steps"""
    batch_size: int = 4
    """trajectories per PPO step, summed over ranks (paper: 1024)"""


@dataclass
class RFTConfig:
    rollouts: int = 16
    """agent trajectories collected with the warm-up policy (before filtering)"""
    steps: int = 200
    """SFT steps on the filtered trajectories (with --rft.target: at most); 0 = no RFT (ablation)"""
    target: float | None = 0.2
    """stop once every kept task's likeliest trajectory has this probability (`train.reproduction`)"""
    batch_size: int = 2
    """trajectories per SFT step"""
    lr: float | None = 2e-3
    """actor LoRA learning rate of the SFT (None = --ppo.lr-actor; paper: not stated)"""
    drop_truncated: bool = False
    """also drop trajectories that hit the turn, context or token limit (not in the paper's filter)"""
    drop_no_call_turns: bool = True
    """no SFT on agent turns that made no tool call (the paper's "redundant turns"); single-turn exempt"""


@dataclass
class ValueConfig:
    steps: int = 4
    """critic-only steps on the stage-2 trajectories; 0 = no value pretraining (ablation)"""
    batch_size: int = 4
    """trajectories per critic step, summed over ranks"""
    heldout: float = 0.25
    """share of the stage-2 trajectories held out to report explained variance"""
    lam: float = 1.0
    """GAE lambda of the critic's targets (paper: 0.95, from the current critic; 1 = Monte-Carlo)"""


@dataclass
class AgentConfig:
    steps: int = 24
    """agentic PPO steps (paper: 150)"""
    batch_size: int = 8
    """trajectories per PPO step, summed over ranks (paper: 1024)"""
    mixed_probe: int = 4
    """probe the RFT actor this many times per task, train on tasks it passed sometimes; 0 = all tasks"""
    permute_rewards: bool = False
    """control, not training: deal each step's rewards out among its trajectories (`permuted_rewards`)"""


@dataclass
class PoolConfig:
    gpus: list[int] = field(default_factory=list)
    """GPU ids set aside for the sandbox pool (never used for training)"""
    cpu_slots: int = 2
    """concurrent checks when --sandbox.device is cpu (timing is noisier above 1)"""
    prewarm: int = 8
    """cuda: before stage 1, compile uncached tasks' torch.compile baselines this many at a time; 0 = off"""


@dataclass
class TrainConfig:
    preset: str = "tiny"
    """preset the other defaults came from: tiny (CPU, offline, minutes) | paper (the paper's recipe, GPU node)"""
    out: str = "runs/tiny"
    """run directory: checkpoints, metrics.jsonl, rollouts/*.jsonl, curves.png"""
    resume: bool = False
    """pick up the last checkpoint in --out (stage and step included)"""
    seed: int = 0
    """the one seed (python, numpy, torch, sampling, the sandbox's inputs)"""
    model: str = "tiny"
    """tiny = random tiny Qwen3-MoE + local tokenizer (offline); else a HF hub id or local path"""
    tasks: str = "data/tasks_tiny4.jsonl"
    """training tasks, anything tasks.load_tasks accepts (synth JSONL, Ops-6K parquet, HF id)"""
    device: str = "auto"
    """training device: auto | cpu | cuda (with accelerate launch: the local rank's GPU)"""
    cpu_threads: int = 1
    """torch CPU threads; 1 avoids OpenMP oversubscription next to sandbox jobs"""
    bf16: bool = False
    """bf16 weights and activations (GPU)"""
    grad_checkpointing: bool = False
    """gradient checkpointing of the base model (GPU, long contexts)"""
    rollout_engine: bool = True
    """sample rollouts with engine.Engine (KV cache reused across turns); off: plain model.generate"""
    checkpoint_every: int = 1
    """write a checkpoint every N steps (and at the end of each stage)"""
    verbose: bool = False
    """print every step's full metric line and, every --sample-every steps, one decoded sample trajectory"""
    sample_every: int = 1
    """with --verbose: print one decoded sample trajectory every N steps"""
    tensorboard: bool = False
    """also log to TensorBoard (OUT/tb)"""
    demos: DemoConfig = field(default_factory=DemoConfig)
    """demonstrations replayed through the env in stages 1 and 2 (tiny preset: its random model writes none)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """the actor and critic LoRA adapters on one frozen base"""
    sampler: policy.SamplerConfig = field(default_factory=lambda: policy.SamplerConfig(max_new_tokens=96,
                                                                                       temperature=1.0))
    """rollout sampling (paper: temperature not stated, 1.0)"""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO and SFT updates, advantages (stages 1-4)"""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """stage 1: single-turn PPO warm-up"""
    rft: RFTConfig = field(default_factory=RFTConfig)
    """stage 2: rejection fine-tuning"""
    value: ValueConfig = field(default_factory=ValueConfig)
    """stage 3: value pretraining"""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """stage 4: agentic PPO"""
    env: env.EnvConfig = field(default_factory=lambda: env.EnvConfig(max_turns=4, max_context_tokens=4096,
                                                                     tool_workers=4))
    """the agent environment of stages 1, 2 and 4 (--env.max-turns 1: single-turn ablation)"""
    sandbox: sandbox.SandboxConfig = field(default_factory=lambda: sandbox.SandboxConfig(device="auto", warmup=2,
                                                                                          iters=10))
    """compiles, verifies and times candidates (--sandbox.device auto: cuda when torch lists a GPU, else cpu)"""
    pool: PoolConfig = field(default_factory=PoolConfig)
    """the sandbox pool that runs the checks"""


# The paper's recipe (§4.1) where it states one; ours (marked) where it does not.
PRESETS = {
    "tiny": TrainConfig(),
    "paper": TrainConfig(
        preset="paper", out="runs/paper", model="Qwen/Qwen3-Coder-30B-A3B-Instruct",
        tasks="BytedTsinghua-SIA/CUDA-Agent-Ops-6K", demos=DemoConfig(dir=None, fraction=0.0),
        env=env.EnvConfig(max_turns=150, max_context_tokens=131072, tool_workers=4),
        sandbox=sandbox.SandboxConfig(device="cuda"), bf16=True, grad_checkpointing=True,
        sampler=policy.SamplerConfig(max_new_tokens=8192, temperature=1.0, kv_budget_gib=40.0,
                                     experts="fused"),  # ours: the Triton decode experts (docs/RESULTS.md §3)
        lora=LoraConfig(rank=16, alpha=32.0),  # ours: ~0.63B parameters per adapter on Qwen3-30B-A3B (r = 16)
        ppo=PPOConfig(lr_actor=3e-5, lr_critic=6e-5, lr_head=1e-4, kl_coef=0.0,  # ours: ~10x the paper's rates
                      micro_batch_size=1, epochs=1, num_minibatches=1,  # "one update per batch"
                      lam=0.95),                       # GAE of stages 1 and 4 (§4.1)
        warmup=WarmupConfig(steps=50, batch_size=1024),  # ours: steps
        rft=RFTConfig(rollouts=1024, steps=200, target=None, batch_size=64, lr=None),  # ours
        value=ValueConfig(steps=50, batch_size=1024, lam=0.95),  # ours: steps; lambda of its targets (§3.3)
        agent=AgentConfig(steps=150, batch_size=1024, mixed_probe=0),  # the paper trains on all its tasks
        checkpoint_every=1, sample_every=10),
}

# Fields of nested configs that the run sets itself: not flags of `train`.
SET_BY_THE_RUN = {env.EnvConfig: ("single_turn", "work_dir", "final_check"), sandbox.SandboxConfig: ("seed",)}


def cli_registry(hidden: dict | None = None) -> ConstructorRegistry:
    """tyro's constructors for a command: dataclasses as usual, the fields in `hidden` ({config class: names};
    train's SET_BY_THE_RUN by default) left out of its flags, because the command sets them itself."""
    registry, hidden = ConstructorRegistry(), SET_BY_THE_RUN if hidden is None else hidden

    @registry.struct_rule
    def hide_set_by_the_run(info: StructTypeInfo) -> StructConstructorSpec | None:
        names = hidden.get(info.type)
        spec = dataclass_rule(info) if names else None
        if spec is None:
            return None
        return dataclasses.replace(spec, fields=tuple(
            dataclasses.replace(f, type=Annotated[f.type, tyro.conf.Suppress]) if f.name in names else f
            for f in spec.fields))
    return registry


def updated(cfg, values: dict):
    """`cfg` with `values` ({"field": v, "group.field": v, ...}) in place of its own; nested groups are copied."""
    for key, v in values.items():
        name, _, rest = key.partition(".")
        cfg = dataclasses.replace(cfg, **{name: updated(getattr(cfg, name), {rest: v}) if rest else v})
    return cfg


def parse(argv: list[str], preset: str = "tiny", **tyro_kwargs) -> TrainConfig:
    """The TrainConfig that `train`'s flags `argv` give on top of the named preset."""
    base = dataclasses.replace(PRESETS[preset], preset=preset)
    return tyro.cli(TrainConfig, args=argv, default=base, registry=cli_registry(), **tyro_kwargs)
