"""The host never trusts a workspace file: one attack per test (links, FIFOs, devices, sockets, huge files,
nested headers against the compile cache, compile floods, children that read what they must not), each
bounded by a thread join timeout so a regression fails in seconds instead of hanging, next to honest
controls. The first half tests workspace.py on its own, the second half sandbox.check/compile_workspace.
Run: python -m pytest tests/test_sandbox_files.py -q
"""
import dataclasses
import os
import pathlib
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import threading

import pytest

import reward
import sandbox
import sandbox.build
import sandbox.child
import workspace
from sandbox import SandboxConfig, TaskError
from workspace import WorkspaceError

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sandbox")
RELU_TASK = pathlib.Path(FIX, "relu_task.py")
RELU_WS = pathlib.Path(FIX, "relu_ws")
BWRAP = pytest.mark.skipif(sandbox.isolation() != "bwrap", reason="needs bubblewrap (apt-get install bubblewrap)")


def score(v) -> float:
    """The training reward of a verdict (Eq. 1)."""
    return reward.reward_from_verdict(v.to_dict())


def within(fn, timeout: float = 30.0):
    """fn() in a daemon thread; fails (instead of hanging the suite) if it has not returned after timeout."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout:g} s (a hang or an unbounded read)"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def ws(tmp_path):
    """A fresh copy of the honest OpenMP relu workspace, inside an episodes dir with a sibling workspace."""
    root = tmp_path / "episodes"
    shutil.copytree(RELU_WS, root / "ep00000_relu")
    shutil.copytree(RELU_WS, root / "ep00001_other")
    return root / "ep00000_relu"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return SandboxConfig(cache_dir=str(tmp_path_factory.mktemp("sbx_cache")), profile=False, n_trials=2,
                         run_timeout_s=60, compile_timeout_s=60)


def special(kind: str, path) -> pathlib.Path:
    """Create a FIFO, socket, /dev/zero link or char device at path; skip the test where that is impossible."""
    path = str(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(path)
        except OSError as e:
            pytest.skip(f"cannot bind a unix socket here: {e}")
        s.close()
    else:
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # a second /dev/zero
        except (PermissionError, OSError) as e:
            pytest.skip(f"cannot create a device node here: {e}")
    return pathlib.Path(path)


# ----------------------------------------------------------------------------- workspace.py on its own
@pytest.mark.parametrize("kind,what", [("zero", "a symlink"), ("fifo", "a FIFO"), ("socket", "a socket"),
                                       ("device", "a character device")])
def test_workspace_refuses_special_files(tmp_path, kind, what):
    shutil.copytree(RELU_WS, tmp_path / "w")
    p = special(kind, tmp_path / "w" / "kernels" / "impl" / "x.h")
    line = f"workspace file kernels/impl/x.h is {what}: refused"
    for fn in (lambda: workspace.walk(tmp_path / "w"), lambda: workspace.snapshot(tmp_path / "w"),
               lambda: workspace.tree_digest(tmp_path / "w"),
               lambda: workspace.copy_tree(tmp_path / "w", tmp_path / "copy")):
        with pytest.raises(WorkspaceError, match=line):
            within(fn, 10)
    with pytest.raises(WorkspaceError, match=f"file {p} is {what}"):  # a socket: "is a socket or FIFO"
        within(lambda: workspace.read_bytes(p), 10)


def test_workspace_caps(tmp_path, monkeypatch):
    (tmp_path / "big.bin").write_bytes(b"x" * 5000)
    with pytest.raises(WorkspaceError, match="more than the cap of 4096"):
        workspace.read_bytes(str(tmp_path / "big.bin"), cap=4096)
    assert workspace.read_bytes(str(tmp_path / "big.bin"), cap=5000) == b"x" * 5000
    assert workspace.snapshot(str(tmp_path), file_cap=4096) == {}  # large files are left out, like today
    with pytest.raises(WorkspaceError, match="more than 8000 bytes"):
        for i in range(3):
            (tmp_path / f"f{i}.txt").write_bytes(b"y" * 3000)
        workspace.copy_tree(str(tmp_path), str(tmp_path / ".out"), total_cap=8000)
    monkeypatch.setattr(workspace, "MAX_FILES", 3)
    with pytest.raises(WorkspaceError, match="more than 3 files"):
        workspace.tree_digest(str(tmp_path))


def test_workspace_walk_copy_snapshot_digest(tmp_path):
    w = tmp_path / "w"
    shutil.copytree(RELU_WS, w)
    (w / "kernels" / "impl").mkdir()
    (w / "kernels" / "impl" / "x.h").write_text("#define X 1\r\n")
    (w / "kernels" / "relu.so").write_bytes(b"\x7fELF")
    for d in (".git", "__pycache__", ".ncu"):
        (w / d).mkdir()
        special("zero", w / d / "link")  # never descended into, so never refused either
    (w / "INSTRUCTIONS.md").write_text("read me")
    assert workspace.walk(str(w)) == ["INSTRUCTIONS.md", "kernels/impl/x.h", "kernels/relu.cpp", "kernels/relu.so",
                                      "model.py", "model_new.py"]
    snap = workspace.snapshot(str(w))
    assert sorted(snap) == ["kernels/impl/x.h", "kernels/relu.cpp", "model_new.py"]
    assert snap["kernels/impl/x.h"] == "#define X 1\n"  # universal newlines, as open() reads it
    copied = workspace.copy_tree(str(w), str(tmp_path / "c"))
    assert "kernels/relu.so" not in copied and (tmp_path / "c" / "kernels" / "impl" / "x.h").is_file()
    d0 = workspace.tree_digest(str(w / "kernels"))
    (w / "kernels" / "impl" / "x.h").write_text("#error nested\n")
    assert workspace.tree_digest(str(w / "kernels")) != d0  # nested headers are part of the digest


def test_workspace_confine(tmp_path):
    w = tmp_path / "w"
    shutil.copytree(RELU_WS, w)
    os.symlink("kernels/relu.cpp", w / "inside_link")
    os.symlink("/etc", w / "etc")
    special("fifo", w / "pipe")
    assert workspace.confine(str(w), "kernels/relu.cpp") == os.path.join(os.path.realpath(w), "kernels/relu.cpp")
    assert workspace.confine(str(w), "kernels/new.cpp").endswith("kernels/new.cpp")  # to be created
    assert workspace.confine(str(w), "kernels") == os.path.join(os.path.realpath(w), "kernels")
    for bad, why in [("../x", "outside"), ("/etc/passwd", "outside"), ("etc/passwd", "outside"),
                     ("inside_link", "symlink"), ("pipe", "FIFO"), ("", "non-empty")]:
        with pytest.raises(WorkspaceError, match=why):
            workspace.confine(str(w), bad)
    with pytest.raises(ValueError):  # env's existing `except ValueError` still catches it
        workspace.confine(str(w), "../x")
    with pytest.raises(WorkspaceError, match="FIFO"):
        within(lambda: workspace.write_text(str(w / "pipe"), "x"), 10)
    workspace.write_text(str(w / "kernels" / "relu.cpp"), "// new\n")
    assert workspace.read_text(str(w / "kernels" / "relu.cpp")) == "// new\n"


# ----------------------------------------------------------------------------- check(): refused workspaces
@pytest.mark.parametrize("kind,rel,what", [
    ("zero", "kernels/x.h", "a symlink"),           # was: read whole to hash it (host out of memory)
    ("zero", "model_new.py", "a symlink"),          # was: read whole by the static scan
    ("zero", "kernels/sub/blob", "a symlink"),      # was: followed by copytree (host /tmp filled)
    ("fifo", "kernels/k.h", "a FIFO"),              # was: the hash loop blocked forever
    ("socket", "kernels/s.h", "a socket"),
    ("device", "data/zero", "a character device"),
])
def test_check_refuses_special_files(ws, cfg, kind, rel, what):
    if rel == "model_new.py":
        os.remove(ws / rel)
    special(kind, ws / rel)
    v = within(lambda: sandbox.check(RELU_TASK, ws, cfg), 30)
    assert v.error == f"workspace file {rel} is {what}: refused" and score(v) == -1 and not v.correct, v.to_dict()


def test_fifo_or_device_as_task_is_a_task_error(tmp_path, cfg):
    for kind in ("fifo", "zero"):
        p = special(kind, tmp_path / f"{kind}_task.py")
        with pytest.raises(TaskError, match=f"task file {p} is a (FIFO|character device): refused"):
            within(lambda: sandbox.check(p, RELU_WS, cfg), 10)


def test_fifo_as_form_a_solution_is_refused(tmp_path, cfg):
    p = special("fifo", tmp_path / "solution.py")
    v = within(lambda: sandbox.check(RELU_TASK, p, cfg), 10)
    assert v.error == f"solution file {p} is a FIFO: refused" and score(v) == -1, v.to_dict()


# ----------------------------------------------------------------------------- compile: cache key and budget
def test_nested_header_is_part_of_the_cache_key(tmp_path, cfg):
    """Two workspaces that differ only in kernels/impl/x.h: the broken one must not reuse the good one's .so."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    for w, header in ((good, "#define RELU_ZERO 0.f\n"), (bad, "#error this header does not compile\n")):
        shutil.copytree(RELU_WS, w)
        (w / "kernels" / "impl").mkdir()
        (w / "kernels" / "impl" / "x.h").write_text(header)
        src = (w / "kernels" / "relu.cpp").read_text()
        (w / "kernels" / "relu.cpp").write_text('#include "impl/x.h"\n' + src)
    ok, log, sos = within(lambda: sandbox.compile_workspace(str(good), cfg), 60)
    assert ok and set(sos) == {"relu"}, log
    ok, log, sos = within(lambda: sandbox.compile_workspace(str(bad), cfg), 60)
    assert not ok and "this header does not compile" in log and sos == {}, log


def test_an_edit_of_one_kernel_does_not_rebuild_another(tmp_path, cfg):
    w = tmp_path / "w"
    shutil.copytree(RELU_WS, w)
    shutil.copy(w / "kernels" / "relu.cpp", w / "kernels" / "relu2.cpp")
    ok, _, sos = within(lambda: sandbox.compile_workspace(str(w), cfg), 60)
    (w / "kernels" / "relu2.cpp").write_text((w / "kernels" / "relu2.cpp").read_text() + "// edit\n")
    ok2, _, sos2 = within(lambda: sandbox.compile_workspace(str(w), cfg), 60)
    assert ok and ok2 and sos2["relu"] == sos["relu"] and sos2["relu2"] != sos["relu2"]


def test_more_kernels_than_max_kernels_is_an_error(ws, cfg):
    for i in range(20):
        shutil.copy(ws / "kernels" / "relu.cpp", ws / "kernels" / f"k{i:02d}.cpp")
    v = within(lambda: sandbox.check(RELU_TASK, ws, cfg), 20)
    assert v.error == "compile failed: 21 kernel sources in kernels/, more than max_kernels=16", v.to_dict()
    assert score(v) == -1


def test_compiles_share_one_workspace_budget(ws, cfg, monkeypatch):
    """A compile that outlasts the workspace's budget is stopped there (not at compile_timeout_s per kernel)."""
    monkeypatch.setattr(sandbox.build, "_compile_cmd", lambda src, so, text="": ["sleep", "30"])  # a slow compiler
    shutil.copy(ws / "kernels" / "relu.cpp", ws / "kernels" / "relu2.cpp")
    (ws / "kernels" / "relu2.cpp").write_text("// another kernel\n")
    c = dataclasses.replace(cfg, compile_budget_s=1.5, compile_timeout_s=60)
    ok, log, sos = within(lambda: sandbox.compile_workspace(str(ws), c, workers=1), 20)
    assert not ok and sos == {} and "compile budget of 1.5 s" in log, log
    assert "is spent" in log.splitlines()[-1], log  # the second kernel never starts


# ----------------------------------------------------------------------------- children see only what they need
def secrets_for(ws, cfg) -> list[str]:
    """Files a child must not read: the harness source, the cache's baselines, another episode's solution."""
    cache = os.path.expanduser(cfg.cache_dir)
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, "baselines.json"), "w") as f:
        f.write("{}")
    out = [os.path.join(os.path.dirname(os.path.abspath(sandbox.__file__)), "core.py"),
           os.path.join(cache, "baselines.json"), os.path.join(os.path.dirname(ws), "ep00001_other", "model_new.py")]
    assert all(os.path.exists(p) for p in out)
    return out


@BWRAP
def test_compile_child_sees_no_cache_repo_or_siblings(ws, cfg, monkeypatch):
    probe = " ".join(f"if test -e {p}; then echo LEAK {p}; exit 1; fi;" for p in secrets_for(str(ws), cfg))
    monkeypatch.setattr(sandbox.build, "_compile_cmd", lambda src, so, text="": ["sh", "-c", f"{probe} : > {so}"])
    ok, log, _ = within(lambda: sandbox.compile_workspace(str(ws), cfg), 30)
    assert ok and "LEAK" not in log, log


@BWRAP
def test_hidden_child_still_runs_the_worker(ws, cfg, tmp_path):
    """With the repo hidden the worker runs from HARNESS_DIR, and the interpreter's prefixes come back."""
    jobdir = sandbox.child.new_jobdir()
    try:
        os.makedirs(os.path.join(jobdir, "w"))
        args = os.path.join(jobdir, "w", "args.pkl")
        probe = "; ".join(f"test -e {p} && echo LEAK {p}" for p in secrets_for(str(ws), cfg))
        with open(args, "wb") as f:
            pickle.dump({"cmd": f"{probe}; ls {sandbox.HARNESS_DIR}"}, f)
        job = {"kind": "call", "fn": "subprocess:getoutput", "args_path": args, "device": "cpu"}
        r = within(lambda: sandbox.run_child(job, jobdir, device="cpu", timeout_s=60, mem_limit_mb=4096,
                                             hide=sandbox.hidden(cfg, str(ws))), 60)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    assert r.result is not None, (r.error, r.stderr)
    assert "LEAK" not in r.result["value"] and "sandbox_worker.py" in r.result["value"], r.result


@BWRAP
def test_a_venv_inside_a_hidden_dir_keeps_working(tmp_path, monkeypatch):
    """The host's interpreter may live in a venv inside the repository: it comes back read-only, the rest
    of the hidden dir does not."""
    repo = tmp_path / "repo"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(repo / ".venv")],
                   check=True, timeout=60)
    (repo / "secret.txt").write_text("SECRET")
    for name in ("prefix", "exec_prefix"):
        monkeypatch.setattr(sys, name, str(repo / ".venv"))
    code = f"import sys, ctypes; print('prefix', sys.prefix); print(open({str(repo / 'secret.txt')!r}).read())"
    jobdir = sandbox.child.new_jobdir()
    try:
        r = within(lambda: sandbox.run_child({}, jobdir, device="cpu", timeout_s=30, mem_limit_mb=2048,
                                             hide=(str(repo),), cmd=[str(repo / ".venv" / "bin" / "python"),
                                                                     "-c", code]), 40)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    assert f"prefix {repo / '.venv'}" in r.stdout and "SECRET" not in r.stdout, (r.stdout, r.stderr)
    assert "FileNotFoundError" in r.stderr, r.stderr


PROBE_MODEL_NEW = '''
for _p in {paths!r}:
    try:
        open(_p).close()
    except OSError:
        continue
    raise RuntimeError("LEAK " + _p)
'''


@pytest.mark.slow
@BWRAP
def test_candidate_child_sees_no_cache_repo_or_siblings(ws, cfg):
    """Needs the candidate child to be run with hide=sandbox.hidden(cfg, workspace)."""
    src = (ws / "model_new.py").read_text()
    (ws / "model_new.py").write_text(src + PROBE_MODEL_NEW.format(paths=secrets_for(str(ws), cfg)))
    v = within(lambda: sandbox.check(RELU_TASK, ws, cfg), 90)
    assert v.correct and v.error is None, v.to_dict()


@pytest.mark.slow
def test_honest_workspace_still_correct(ws, cfg):
    v = within(lambda: sandbox.check(RELU_TASK, ws, cfg), 90)
    assert v.compiled and v.correct and v.error is None and v.violation is None and score(v) >= 1, v.to_dict()
