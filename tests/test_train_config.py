"""The presets' values, flag by flag, against those recorded before TrainConfig was nested (old flat names
mapped to their groups), and the `train` command line: no flag the run overwrites, no setting declared twice."""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

import cuda_agent  # noqa: E402
import train_config  # noqa: E402

# Every value of both presets under the flat TrainConfig (sandbox: the fields the presets set, and its seed).
RECORDED = {
    'tiny': {
        'agent_batch_size': 8, 'agent_steps': 24, 'batch_size': 4, 'bf16': False, 'checkpoint_every': 1,
        'cpu_threads': 1, 'demo_fraction': 0.5, 'demos': 'data/demos', 'device': 'auto', 'entropy_coef': 0.0,
        'env.bash_timeout_s': 60.0, 'env.final_check': True, 'env.max_context_tokens': 4096,
        'env.max_obs_chars': 6000, 'env.max_turns': 4, 'env.ncu': True, 'env.overlap_turns': True,
        'env.reward': 'milestone', 'env.single_turn': False, 'env.tool_workers': 4,
        'env.work_dir': 'runs/workspaces', 'env.workspace': 'ctypes', 'eps_high': 0.28, 'eps_low': 0.2,
        'gamma': 1.0, 'grad_checkpointing': False, 'kl_coef': 0.1, 'kv_budget_gib': None, 'lam': 1.0,
        'lora_alpha': 16.0, 'lora_rank': 8, 'lora_targets': 'attention,experts', 'lr_actor': 0.0002,
        'lr_critic': 0.004, 'lr_head': 0.01, 'lr_rft': 0.002, 'max_grad_norm': 1.0, 'max_new_tokens': 96,
        'micro_batch_size': 2, 'mixed_probe': 4, 'model': 'tiny', 'num_minibatches': 2,
        'offload_activations': False, 'out': 'runs/tiny', 'permute_rewards': False, 'ppo_epochs': 4,
        'preset': 'tiny', 'resume': False, 'rft_batch_size': 2, 'rft_drop_no_call_turns': True,
        'rft_drop_truncated': False, 'rft_rollouts': 16, 'rft_steps': 200, 'rft_target': 0.2,
        'rollout_engine': True, 'rollout_experts': None, 'sample_every': 1, 'sandbox.device': 'auto',
        'sandbox.iters': 10, 'sandbox.seed': 0, 'sandbox.warmup': 2, 'sandbox_cpu_slots': 2, 'sandbox_gpus': [],
        'sandbox_prewarm': 8, 'seed': 0, 'tasks': 'data/tasks_tiny4.jsonl', 'temperature': 1.0,
        'tensorboard': False, 'tis_cap': None, 'value_heldout': 0.25, 'value_lam': 1.0, 'value_pretrain_steps': 4,
        'verbose': False, 'vf_clip': None, 'warmup_steps': 2, 'whiten_advantages': True,
    },
    'paper': {
        'agent_batch_size': None, 'agent_steps': 150, 'batch_size': 1024, 'bf16': True, 'checkpoint_every': 1,
        'cpu_threads': 1, 'demo_fraction': 0.0, 'demos': None, 'device': 'auto', 'entropy_coef': 0.0,
        'env.bash_timeout_s': 60.0, 'env.final_check': True, 'env.max_context_tokens': 131072,
        'env.max_obs_chars': 6000, 'env.max_turns': 150, 'env.ncu': True, 'env.overlap_turns': True,
        'env.reward': 'milestone', 'env.single_turn': False, 'env.tool_workers': 4,
        'env.work_dir': 'runs/workspaces', 'env.workspace': 'ctypes', 'eps_high': 0.28, 'eps_low': 0.2,
        'gamma': 1.0, 'grad_checkpointing': True, 'kl_coef': 0.0, 'kv_budget_gib': 40.0, 'lam': 0.95,
        'lora_alpha': 32.0, 'lora_rank': 16, 'lora_targets': 'attention,experts', 'lr_actor': 3e-05,
        'lr_critic': 6e-05, 'lr_head': 0.0001, 'lr_rft': None, 'max_grad_norm': 1.0, 'max_new_tokens': 8192,
        'micro_batch_size': 1, 'mixed_probe': 0, 'model': 'Qwen/Qwen3-Coder-30B-A3B-Instruct',
        'num_minibatches': 1, 'offload_activations': False, 'out': 'runs/paper', 'permute_rewards': False,
        'ppo_epochs': 1, 'preset': 'paper', 'resume': False, 'rft_batch_size': 64, 'rft_drop_no_call_turns': True,
        'rft_drop_truncated': False, 'rft_rollouts': 1024, 'rft_steps': 200, 'rft_target': None,
        'rollout_engine': True, 'rollout_experts': 'fused', 'sample_every': 10, 'sandbox.device': 'cuda',
        'sandbox.iters': 50, 'sandbox.seed': 0, 'sandbox.warmup': 5, 'sandbox_cpu_slots': 2, 'sandbox_gpus': [],
        'sandbox_prewarm': 8, 'seed': 0, 'tasks': 'BytedTsinghua-SIA/CUDA-Agent-Ops-6K', 'temperature': 1.0,
        'tensorboard': False, 'tis_cap': None, 'value_heldout': 0.25, 'value_lam': 0.95,
        'value_pretrain_steps': 50, 'verbose': False, 'vf_clip': None, 'warmup_steps': 50,
        'whiten_advantages': True,
    },
}

# old flat name -> where the value lives now (agent_batch_size None meant --batch-size)
RENAMED = {
    "demos": "demos.dir", "demo_fraction": "demos.fraction",
    "lora_rank": "lora.rank", "lora_alpha": "lora.alpha", "lora_targets": "lora.targets",
    "max_new_tokens": "sampler.max_new_tokens", "temperature": "sampler.temperature",
    "kv_budget_gib": "sampler.kv_budget_gib", "rollout_experts": "sampler.experts",
    "lr_actor": "ppo.lr_actor", "lr_critic": "ppo.lr_critic", "lr_head": "ppo.lr_head",
    "micro_batch_size": "ppo.micro_batch_size", "ppo_epochs": "ppo.epochs", "num_minibatches": "ppo.num_minibatches",
    "eps_low": "ppo.eps_low", "eps_high": "ppo.eps_high", "gamma": "ppo.gamma", "lam": "ppo.lam",
    "kl_coef": "ppo.kl_coef", "entropy_coef": "ppo.entropy_coef", "vf_clip": "ppo.vf_clip", "tis_cap": "ppo.tis_cap",
    "whiten_advantages": "ppo.whiten_advantages", "max_grad_norm": "ppo.max_grad_norm",
    "offload_activations": "ppo.offload_activations",
    "warmup_steps": "warmup.steps", "batch_size": ("warmup.batch_size", "value.batch_size"),
    "rft_rollouts": "rft.rollouts", "rft_steps": "rft.steps", "rft_target": "rft.target",
    "rft_batch_size": "rft.batch_size", "lr_rft": "rft.lr", "rft_drop_truncated": "rft.drop_truncated",
    "rft_drop_no_call_turns": "rft.drop_no_call_turns",
    "value_pretrain_steps": "value.steps", "value_heldout": "value.heldout", "value_lam": "value.lam",
    "agent_steps": "agent.steps", "agent_batch_size": "agent.batch_size", "mixed_probe": "agent.mixed_probe",
    "permute_rewards": "agent.permute_rewards",
    "sandbox_gpus": "pool.gpus", "sandbox_cpu_slots": "pool.cpu_slots", "sandbox_prewarm": "pool.prewarm",
}


def flatten(cfg, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out |= flatten(v, f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = v
    return out


@pytest.mark.parametrize("name", ["tiny", "paper"])
def test_preset_values_unchanged(name):
    now, old = flatten(train_config.PRESETS[name]), RECORDED[name]
    seen = set()
    for key, value in old.items():
        if key == "agent_batch_size" and value is None:
            value = old["batch_size"]
        new_keys = RENAMED.get(key, key)
        for new in new_keys if isinstance(new_keys, tuple) else (new_keys,):
            assert now[new] == value, (key, new, now[new], value)
            seen.add(new)
    # the sandbox fields the presets do not set and the rest of the new tree are defaults, nothing else
    rest = {k for k in now if k not in seen and not k.startswith("sandbox.")}
    assert not rest, rest


def test_nothing_declared_twice():
    """Each leaf setting of `train` has one name (the sampler's fields live in policy.SamplerConfig only)."""
    leaves = [k.rsplit(".", 1)[-1] for k in flatten(train_config.TrainConfig())]
    for name in ("temperature", "max_new_tokens", "kv_budget_gib", "experts", "offload_activations", "lr_actor",
                 "micro_batch_size", "cpu_slots"):
        assert leaves.count(name) == 1, name


def test_help_hides_what_the_run_sets(capsys):
    with pytest.raises(SystemExit):
        cuda_agent.main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--env.single-turn", "--env.work-dir", "--env.final-check", "--sandbox.seed"):
        assert flag not in out, flag
    for flag in ("--ppo.offload-activations", "--sampler.temperature", "--pool.gpus", "--rft.target",
                 "--agent.permute-rewards", "--sandbox.device", "--env.max-turns"):
        assert flag in out, flag
    with pytest.raises(SystemExit) as e:
        train_config.parse(["--env.work-dir", "x"])
    assert e.value.code == 2
    # the hidden fields keep the preset's values
    cfg = train_config.parse(["--seed", "3"], preset="paper")
    assert (cfg.env.work_dir, cfg.env.final_check, cfg.sandbox.seed, cfg.seed) == ("runs/workspaces", True, 0, 3)


def test_solve_hides_the_work_dir_it_sets(capsys):
    with pytest.raises(SystemExit):
        cuda_agent.main(["solve", "--help"])
    out = capsys.readouterr().out
    assert "--env.work-dir" not in out and "--env.max-turns" in out and "--env.final-check" in out
