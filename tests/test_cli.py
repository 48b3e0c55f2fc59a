"""The command line (cuda_agent.py): nested tyro configs, presets, positional arguments, exit codes."""
import json
import os

import pytest

tyro = pytest.importorskip("tyro")

import cuda_agent  # noqa: E402
import train_config  # noqa: E402
from cuda_agent import main, pop_preset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_train(argv):
    """What `cuda_agent.py train ARGV` would run, without running it."""
    name, rest = pop_preset(argv, train_config.PRESETS)
    return train_config.parse(rest, name)


def test_field_docstrings_become_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "the one seed (python, numpy, torch, sampling," in out and "--env.max-turns" in out


def test_flags_types_nesting_and_defaults():
    c = parse_train(["--seed", "7", "--ppo.lr-actor", "0.5", "--pool.gpus", "0", "2", "--resume", "--demos.dir",
                     "None", "--env.max-turns", "1", "--env.reward", "speedup", "--sandbox.atol", "0.001"])
    assert (c.seed, c.ppo.lr_actor, c.pool.gpus, c.resume, c.demos.dir) == (7, 0.5, [0, 2], True, None)
    assert (c.env.max_turns, c.env.reward, c.sandbox.atol) == (1, "speedup", 0.001)
    assert parse_train([]) == train_config.PRESETS["tiny"]


def test_preset_then_override():
    assert parse_train([]).warmup.batch_size == 4                       # the first preset is the default
    c = parse_train(["--preset", "paper", "--warmup.batch-size", "16"])
    assert (c.warmup.batch_size, c.ppo.lr_actor, c.preset, c.env.max_turns) == (16, 3e-5, "paper", 150)  # flag > preset
    assert c.value.batch_size == c.agent.batch_size == 1024
    assert parse_train(["--preset=paper"]).sandbox.device == "cuda"


def test_positional():
    c = tyro.cli(cuda_agent.SolveConfig, args=["t.py", "--env.max-turns", "2", "--policy.kind", "hf"])
    assert (c.task, c.env.max_turns, c.policy.kind) == ("t.py", 2, "hf")


def test_bad_flag_unknown_preset_and_unknown_command_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_train(["--nope"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        parse_train(["--preset", "huge"])
    assert e.value.code == 2
    assert main(["frobnicate"]) == 2


def test_check_prints_the_reward_computed_by_reward_py(tmp_path, capsys):
    """`check` on a missing solution is a usage error; on a real one its JSON carries reward.py's reward."""
    task = os.path.join(ROOT, "tests", "fixtures", "kernelbench", "KernelBench", "level1", "1_Tiny_ReLU.py")
    assert main(["check", task, str(tmp_path / "nothing.py")]) == 2
    sol = tmp_path / "sol.py"
    sol.write_text("import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n"
                   "        return torch.relu(x)\n")
    rc = main(["check", task, str(sol), "--json", "--sandbox.no-profile", "--sandbox.cache-dir", str(tmp_path / "c"),
               "--reward", "speedup"])
    v = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and v["violation"] and v["reward"] == -1.0                 # FAIL: exit 1


def test_agent_budgets_follow_the_machine(monkeypatch):
    """solve and kernelbench_eval's agent mode: the paper's turns and 4096 tokens a turn with a GPU,
    20 turns, 32k tokens and 1024 tokens a turn without one; a flag still wins."""
    import torch

    import kernelbench_eval
    for gpu, want in ((True, (150, 200, 131072, 4096)), (False, (20, 20, 32768, 1024))):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        s = tyro.cli(cuda_agent.SolveConfig, args=["t.py"])
        k = tyro.cli(kernelbench_eval.EvalConfig, args=[])
        assert (s.env.max_turns, k.env.max_turns, s.env.max_context_tokens, k.policy.max_new_tokens) == want
        assert s.policy.max_new_tokens == want[3]
    assert tyro.cli(kernelbench_eval.EvalConfig, args=["--env.max-turns", "3"]).env.max_turns == 3
