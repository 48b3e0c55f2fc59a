"""The CLI's dataclass -> argparse layer (cuda_agent.parse_config)."""
import dataclasses

import pytest

from cuda_agent import field_docs, main, parse_config


@dataclasses.dataclass
class Cfg:
    task: str = ""
    """the task file"""
    steps: int = 3
    """number of steps"""
    lr: float = 1e-3
    """learning rate"""
    name: str | None = None
    """optional name"""
    gpus: list[int] = dataclasses.field(default_factory=list)
    """comma-separated GPU ids"""
    resume: bool = False
    """pick up the last checkpoint"""
    preset: str = "tiny"
    """preset name"""


PRESETS = {"tiny": Cfg(steps=1), "big": Cfg(steps=100, lr=0.5)}


def test_field_docs_read_from_source():
    d = field_docs(Cfg)
    assert d["steps"] == "number of steps" and d["gpus"] == "comma-separated GPU ids"


def test_flags_types_and_defaults():
    c = parse_config(Cfg, ["--steps", "7", "--lr", "0.5", "--gpus", "0,2", "--resume", "--name", "none"])
    assert (c.steps, c.lr, c.gpus, c.resume, c.name) == (7, 0.5, [0, 2], True, None)
    assert parse_config(Cfg, []) == Cfg()


def test_preset_then_override():
    assert parse_config(Cfg, [], presets=PRESETS).steps == 1          # first preset is the default
    c = parse_config(Cfg, ["--preset", "big", "--steps", "5"], presets=PRESETS)
    assert (c.steps, c.lr, c.preset) == (5, 0.5, "big")                 # flag beats preset, preset beats default


def test_positional():
    c = parse_config(Cfg, ["t.py", "--steps", "2"], positional=("task",))
    assert (c.task, c.steps) == ("t.py", 2)


def test_bad_flag_and_unknown_command_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(Cfg, ["--nope"])
    assert e.value.code == 2
    assert main(["frobnicate"]) == 2
