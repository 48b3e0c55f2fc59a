"""Ctrl-C: `check` stops within 5 s, kills every sandbox child, prints one line and exits 130 (no traceback)."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # a CLI check in a subprocess, interrupted (~25 s on 2 shared cores)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "sandbox")
SLOW = """
import torch
import torch.nn as nn
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        while True:  # a candidate that hangs while the check waits for it
            pass
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    kids, tree = {}, [pid]
    for line in out:
        if line.strip():
            p, pp = map(int, line.split())
            kids.setdefault(pp, []).append(p)
    for p in tree:
        tree += kids.get(p, [])
    return tree[1:]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:  # the process ended between `ps` and here
        return ""


def _as_from_a_terminal():
    """A shell started in the background (`cmd &`, nohup, some CI runners) hands its children SIGINT ignored,
    and an ignored SIGINT stays ignored in Python: such a `check` rightly cannot be Ctrl-C'd. Start it as
    a terminal would, with SIGINT at its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_kills_sandbox_children_and_exits_130(tmp_path):
    sol = tmp_path / "slow.py"
    sol.write_text(SLOW)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "cuda_agent.py"), "check",
                             os.path.join(FIX, "relu_task.py"), str(sol), "--sandbox.device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=_as_from_a_terminal, env={**os.environ, "CUDA_AGENT_CACHE": str(tmp_path / "cache")})
    # Wait until one sandbox child has lived 3 s: reference children come and go, the candidate stays
    # (it spins in ModelNew's __init__), so a snapshot taken between two children cannot pass for it.
    seen, kids, t_end = {}, [], time.time() + 400
    while time.time() < t_end and proc.poll() is None:
        now = time.time()
        workers = [p for p in _children(proc.pid) if "sandbox_worker" in _cmdline(p)]
        seen = {p: seen.get(p, now) for p in workers}
        if any(now - t >= 3 for t in seen.values()):
            kids = _children(proc.pid)
            break
        time.sleep(0.5)
    assert kids, f"no sandbox child was started: {proc.poll()} {proc.stderr.read() if proc.poll() is not None else ''}"
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 5, f"took {time.time() - t0:.1f} s to stop"
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted"), err[-2000:]
    time.sleep(0.5)
    alive = [p for p in kids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    assert not alive, f"sandbox children still alive after Ctrl-C: {alive}"
