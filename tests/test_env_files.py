"""The episode's tools never trust a workspace file: links to the harness, the cache or another episode, FIFOs
and /dev/zero, met by grep, glob, read_file, write_file, edit_file and verify. Each tool call runs in a
thread with a join timeout, so a hang fails in seconds; each must answer with one "error: ..." line (or a
failing verdict that names the file) and never with the linked file's content.
Run: python -m pytest tests/test_env_files.py -q
"""
import json
import os
import threading

import pytest

import env
import sandbox
from env import EnvConfig
from tasks import Task

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(128, 512)]


def get_init_inputs():
    return []
'''
CORE_PY = os.path.join(os.path.dirname(os.path.abspath(sandbox.__file__)), "core.py")


def tool(ep, name, timeout=30.0, **args) -> str:
    """The observation of one tool call, taken the way the agent's calls are (errors become text)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(obs=ep._run_call(
        {"function": {"name": name, "arguments": json.dumps(args)}})[0]), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{name} still running after {timeout:g} s (a hang or an unbounded read)"
    return out["obs"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    cfg = sandbox.SandboxConfig(device="cpu", n_trials=2, profile=False, run_timeout_s=60,
                                cache_dir=str(tmp_path_factory.mktemp("sbx_cache")))
    p = sandbox.SandboxPool(cfg, compile_workers=2)
    yield p
    p.close()


@pytest.fixture
def ep(tmp_path, pool):
    """An episode whose work_dir also holds another episode's workspace, and a cache with baselines."""
    cfg = EnvConfig(work_dir=str(tmp_path / "runs"), ncu=False)
    other = env.Episode(1, Task(code=TASK, name="other"), cfg, pool, pool.cfg)
    with open(os.path.join(other.ws, "model_new.py"), "w") as f:
        f.write("SECRET_OF_ANOTHER_EPISODE = 1\n")
    with open(os.path.join(pool.cfg.cache_dir, "baselines.json"), "w") as f:
        f.write('{"SECRET_BASELINE": 1}')
    e = env.Episode(0, Task(code=TASK, name="relu"), cfg, pool, pool.cfg)
    e.other_ws = other.ws
    return e


def secrets(ep) -> dict:
    return {"harness.txt": CORE_PY, "base.txt": os.path.join(ep.sb.cache_dir, "baselines.json"),
            "kernels/other.h": os.path.join(ep.other_ws, "model_new.py")}


@pytest.mark.parametrize("name", ["harness.txt", "base.txt", "kernels/other.h"])
def test_links_out_are_refused_not_followed(ep, name):
    os.symlink(secrets(ep)[name], os.path.join(ep.ws, name))
    for call, args in [("grep", {"pattern": "SECRET|def _wrap"}), ("read_file", {"path": name}),
                       ("glob", {"pattern": "**/*"}), ("edit_file", {"path": name, "old_str": "a", "new_str": "b"}),
                       ("write_file", {"path": name, "content": "OVERWRITTEN_BY_AN_AGENT"})]:
        obs = tool(ep, call, **args)
        assert "SECRET" not in obs and "def _wrap" not in obs, (call, obs)
        assert obs.startswith("error:") and ("symlink" in obs or "outside the workspace" in obs), (call, obs)
    assert "OVERWRITTEN_BY_AN_AGENT" not in open(secrets(ep)[name]).read()


def test_fifo_in_kernels_never_blocks_a_tool(ep):
    os.mkfifo(os.path.join(ep.ws, "kernels", "k.h"))
    for call, args in [("grep", {"pattern": "relu"}), ("glob", {"pattern": "kernels/*"}),
                       ("read_file", {"path": "kernels/k.h"}), ("write_file", {"path": "kernels/k.h", "content": "x"}),
                       ("edit_file", {"path": "kernels/k.h", "old_str": "a", "new_str": "b"})]:
        obs = tool(ep, call, **args)
        assert obs.startswith("error:") and "FIFO" in obs, (call, obs)
    for call in ("compile", "verify"):
        obs = tool(ep, call, timeout=60)
        assert "workspace file kernels/k.h is a FIFO: refused" in obs, (call, obs)


def test_dev_zero_named_like_a_header_fails_verify_fast(ep):
    os.symlink("/dev/zero", os.path.join(ep.ws, "kernels", "x.h"))
    obs = tool(ep, "verify", timeout=60)
    assert "workspace file kernels/x.h is a symlink: refused" in obs, obs
    obs = tool(ep, "grep", pattern="x")
    assert obs.startswith("error:") and "symlink" in obs, obs
