"""env.py: workspace, tools and every error path, batched replay episodes through the REAL sandbox ending
in an honest OpenMP kernel (reward >= 1), single-turn mode, the tiny MoE driving the env, exact records."""
import json
import os

import pytest

import env
import sandbox
import tools
from env import EnvConfig, run_episodes, tokenize_conversation
from tasks import Task, Trajectory, load_trajectories, save_trajectories
from policy import HFPolicy, ReplayPolicy, build_tiny_model_and_tokenizer

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
KERNEL = '''extern "C" void relu_forward(const float* x, float* y, long n, void* stream) {
#pragma omp parallel for
    for (long i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
'''
MODEL_NEW = '''import ctypes

import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("relu")
lib.relu_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.relu_forward.restype = None


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = torch.empty_like(x)
        lib.relu_forward(ptr(x), ptr(y), x.numel(), stream())
        return y
'''
CHEAT = MODEL_NEW.replace("        y = torch.empty_like(x)\n        lib.relu_forward(ptr(x), ptr(y), x.numel(), stream())\n"
                          "        return y", "        return torch.relu(x)")


def call(name, **args):
    return {"name": name, "arguments": args}


def turn(*calls, content=""):
    return {"content": content, "tool_calls": [{"function": c} for c in calls]}


# one scripted episode that visits every tool and every error path, then solves the task honestly
TOUR = [
    turn(call("read_file", path="INSTRUCTIONS.md")),
    turn(call("read_file", path="model.py", offset=1, limit=3), call("glob", pattern="**/*.cpp"),
         call("glob", pattern="../*")),
    turn(call("grep", pattern="class Model"), call("grep", pattern="(["), content="looking around"),
    turn(call("write_file", path="kernels/relu.cpp", content=KERNEL.replace("0.f;", "0.f"))),   # syntax error
    turn(call("compile")),
    turn(call("edit_file", path="kernels/relu.cpp", old_str="0.f\n", new_str="0.f;\n"),
         call("edit_file", path="kernels/relu.cpp", old_str="no such text", new_str="x"),
         call("edit_file", path="kernels/relu.cpp", old_str="i", new_str="j")),
    turn(call("compile")),
    turn(call("write_file", path="model_new.py", content=CHEAT), call("verify")),            # rule violation
    turn(call("write_file", path="model.py", content="hacked"), call("write_file", path="../escape.txt", content="x"),
         call("read_file", path="/etc/passwd"), call("read_file", path="nothere.py")),
    turn(call("bash", command="ln -s /etc/hostname link && ls && python -c 'import sandbox_worker as w; print(w.ptr)'"),
         call("read_file", path="link")),
    turn(call("bash", command="ls " + tools.REPO + " | wc -l; rm link; echo x > model.py; python -c \"import socket; "
              "socket.create_connection(('1.1.1.1', 80), timeout=3)\" 2>&1 | tail -1"),
         call("bash", command="sleep 20", timeout=1)),
    '<tool_call>{"name": "verify", "arguments": {</tool_call>',                                 # malformed
    turn(call("rm_rf"), call("write_file", path="x.txt"), call("bash", command=5)),             # invalid calls
    "Let me think about the kernel.",                                                          # no tool call
    turn(call("write_file", path="model_new.py", content=MODEL_NEW), call("verify")),
    turn(call("verify")),                                                                       # repeated, cached
    turn(call("profile")),
    turn(call("finish", summary="relu with OpenMP")),
]
SHORT = [turn(call("write_file", path="kernels/relu.cpp", content=KERNEL),
              call("write_file", path="model_new.py", content=MODEL_NEW)), turn(call("finish"))]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_model_and_tokenizer(seed=0)[1]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    cfg = sandbox.SandboxConfig(device="cpu", n_trials=2, warmup=2, iters=10,
                                cache_dir=str(tmp_path_factory.mktemp("sbx_cache")))
    p = sandbox.SandboxPool(cfg, compile_workers=2)
    yield p
    p.close()


def _obs(traj, name):
    """Observations of every call to tool `name`, in order."""
    ids = {}
    for m in traj.messages:
        for tc in m.get("tool_calls") or []:
            ids[tc["id"]] = tc["function"]["name"]
    return [m["content"] for m in traj.messages if m["role"] == "tool" and ids.get(m["tool_call_id"]) == name]


# ---------------------------------------------------------------------------------------------- unit pieces
def test_workspace_layout_and_confinement(tmp_path):
    ws = tools.make_workspace(str(tmp_path / "ws"), TASK, "cuda")
    assert sorted(os.listdir(ws)) == ["INSTRUCTIONS.md", "kernels", "model.py", "model_new.py"]
    assert os.listdir(os.path.join(ws, "kernels")) == ["kernel.cu"]
    assert oct(os.stat(os.path.join(ws, "model.py")).st_mode & 0o777) == "0o444"
    text = open(os.path.join(ws, "INSTRUCTIONS.md")).read()
    assert "cuBLAS" in text and "torch.compile" in text and "0.01" in text
    assert set(tools.snapshot(ws)) == {"model_new.py", "kernels/kernel.cu"}
    for bad in ["../x", "/etc/passwd", "kernels/../../x", ""]:
        with pytest.raises(ValueError):
            tools.confine(ws, bad)
    os.symlink("/etc", os.path.join(ws, "out"))
    with pytest.raises(ValueError):
        tools.confine(ws, "out/passwd")
    assert tools.confine(ws, "kernels/a.cu") == os.path.join(os.path.realpath(ws), "kernels/a.cu")


def test_parse_solution_blocks():
    text = f"Here:\n```python model_new.py\n{MODEL_NEW}```\n```cpp\n// file: kernels/relu.cpp\n{KERNEL}```\n" \
           "```cpp ../evil.cpp\nx\n```"
    files, errors = tools.parse_solution_blocks(text)
    assert set(files) == {"model_new.py", "kernels/relu.cpp"} and files["model_new.py"] == MODEL_NEW
    assert errors == ["refused file name '../evil.cpp'"]
    assert tools.parse_solution_blocks("no code")[1] == ["no ```python model_new.py``` block in the response"]


def test_flat_logprobs_spreads_turns_over_mask_runs():
    assert env.flat_logprobs([0, 1, 1, 0, 0, 1], [[-1.0, -2.0], None]) == [0, -1.0, -2.0, 0, 0, 0]
    with pytest.raises(AssertionError):
        env.flat_logprobs([1, 1], [[-1.0]])


# ---------------------------------------------------------------------------------------------- real sandbox episodes
@pytest.mark.slow
def test_replay_episodes_every_tool_and_error_path_then_honest_solution(tmp_path, pool, tok):
    cfg = EnvConfig(work_dir=str(tmp_path / "ws"), max_turns=40, bash_timeout_s=10)
    trajs = run_episodes(ReplayPolicy({0: TOUR, 1: SHORT}), [Task(code=TASK, name="relu"), Task(code=TASK)], pool, cfg,
                         tokenizer=tok)
    t, s = trajs
    # the tour
    assert t.stop_reason == "finish" and len(t.turns) == len(TOUR)
    assert t.invalid_calls == 4, "1 malformed + unknown tool + missing argument + wrong type"
    assert t.repeated_calls == 3, "compile x2, verify x3"
    assert "## Rules" in _obs(t, "read_file")[0] and _obs(t, "read_file")[1].startswith("import torch")
    assert _obs(t, "glob")[0] == "kernels/kernel.cpp"
    assert "relative to the workspace" in _obs(t, "glob")[1]
    assert "model.py:5: class Model" in _obs(t, "grep")[0] and "bad regular expression" in _obs(t, "grep")[1]
    c1, c2 = _obs(t, "compile")
    assert c1.startswith("compile FAILED") and "error" in c1 and c2.startswith("compiled OK") and "relu" in c2
    e_ok, e_missing, e_multi = _obs(t, "edit_file")
    assert e_ok == "edited kernels/relu.cpp" and "not found" in e_missing and "not unique" in e_multi
    v_cheat, v_ok, v_again = _obs(t, "verify")
    assert "RULE VIOLATION" in v_cheat and "correct: True" in v_ok and v_again == v_ok
    w = _obs(t, "write_file")
    assert "read-only" in w[2] and "outside the workspace" in w[3]
    r = _obs(t, "read_file")
    assert "outside the workspace" in r[2] and "no such file" in r[3] and "outside the workspace" in r[4]
    b_link, b_hidden, b_sleep, b_bad = _obs(t, "bash")
    assert "<function ptr" in b_link, "model_new.py's runtime helpers must import inside bash"
    assert b_hidden.startswith("0\n"), "the repo must be invisible inside bash"
    assert "Read-only file system" in b_hidden and "Network is unreachable" in b_hidden
    assert "killed after 1 s" in b_sleep and "must be a string" in b_bad
    assert "reward this version would earn" in _obs(t, "profile")[0]
    errors = [m["content"] for m in t.messages if m["role"] == "user"][1:]
    assert errors[0].startswith("[error] malformed tool call") and "no tool call found" in errors[1]
    assert [c["error"] is not None for c in t.turns[12]["calls"]] == [True, True, True]
    assert t.turns[7]["calls"][1]["verdict"]["violation"], "per-turn metadata keeps the verdict"
    assert t.best_reward >= 1 and t.final_reward >= 1
    assert t.best_files["model_new.py"] == MODEL_NEW and t.best_files["kernels/relu.cpp"] == KERNEL
    ws0 = os.path.join(cfg.work_dir, os.listdir(cfg.work_dir)[0])
    assert open(os.path.join(ws0, "model.py")).read() == TASK
    assert not os.path.exists(tmp_path / "ws" / "escape.txt")
    # the short episode ran alongside and finished early
    assert s.stop_reason == "finish" and len(s.turns) == 2 and s.final_reward >= 1 and s.task == Task(code=TASK).hash
    # records: round trip and exact re-tokenisation
    path = str(tmp_path / "traj.jsonl")
    save_trajectories(path, trajs)
    back = load_trajectories(path)
    assert back == trajs
    for b in back:
        ids, mask = tokenize_conversation(b.messages, b.tools, tok)
        assert (ids, mask) == (b.ids, b.mask) and len(b.logprobs) == len(ids)
        n_assistant = sum(m["role"] == "assistant" for m in b.messages)
        assert tok.decode([i for i, k in zip(ids, mask) if k]).count("<|im_end|>") == n_assistant


@pytest.mark.slow
def test_single_turn_mode(tmp_path, pool):
    good = f"Solution:\n```python model_new.py\n{MODEL_NEW}```\n```cpp kernels/relu.cpp\n{KERNEL}```\n"
    cfg = EnvConfig(work_dir=str(tmp_path / "ws"), single_turn=True)
    g, b = run_episodes(ReplayPolicy({0: [good], 1: ["I cannot do it."]}), [Task(code=TASK)] * 2, pool, cfg)
    assert g.tools is None and "```python model_new.py" in g.messages[1]["content"]
    assert "## Tools" not in g.messages[1]["content"] and g.messages[0]["content"] == tools.prompt("system_single.md")
    assert g.stop_reason == "single_turn" and g.final_reward >= 1 and g.invalid_calls == 0
    assert b.final_reward == -1 and b.invalid_calls == 1


# ---------------------------------------------------------------------------------------------- tiny MoE
@pytest.mark.slow
def test_tiny_moe_drives_the_env_and_its_garbage_is_handled(tmp_path):
    model, tok = build_tiny_model_and_tokenizer(seed=0)
    pol = HFPolicy(model, tok, max_new_tokens=40, temperature=1.0, seed=0)
    cfg = EnvConfig(work_dir=str(tmp_path / "ws"), max_turns=4, final_check=False)
    trajs = run_episodes(pol, [Task(code=TASK)] * 2, None, cfg)     # pool unused: random text calls no tools
    for t in trajs:
        assert t.stop_reason == "max_turns" and len(t.turns) == 4
        assert all(m["content"].startswith("[error]") for m in t.messages[2:] if m["role"] == "user")
        sampled = [m["token_ids"] for m in t.messages if m["role"] == "assistant"]
        assert sum(t.mask) == sum(map(len, sampled)), "mask must cover exactly the sampled tokens"
        assert all(lp < 0 for lp, k in zip(t.logprobs, t.mask) if k) and not any(
            lp for lp, k in zip(t.logprobs, t.mask) if not k)
        back = Trajectory.from_dict(json.loads(t.to_json()))
        assert tokenize_conversation(back.messages, back.tools, tok) == (t.ids, t.mask)
    short = run_episodes(pol, [Task(code=TASK)], None, EnvConfig(work_dir=str(tmp_path / "w2"), max_context_tokens=100,
                                                      final_check=False))[0]
    assert short.stop_reason == "context" and short.turns == [], "the prompt alone is past the budget: no turn"


@pytest.mark.slow
@pytest.mark.parametrize("engine", [False, True])
def test_the_token_budget_holds_before_each_turn(tmp_path, engine):
    """HFPolicy samples at most what the prompt leaves of --env.max-context-tokens (one token kept for the
    end-of-turn that closes a cut turn), an episode with no room left stops ("context") without a turn, and
    observations past the budget stay out of the record: no record exceeds the budget. Plain `generate` and the
    engine's overlapped turns alike."""
    model, tok = build_tiny_model_and_tokenizer(seed=0)
    model = model.float()
    probe = env.Episode(0, Task(code=TASK), EnvConfig(work_dir=str(tmp_path / "probe")), None, sandbox.SandboxConfig())
    n0 = len(tokenize_conversation(probe.messages, probe.tools, tok, add_generation_prompt=True)[0])
    for k, budget in enumerate((n0 - 5, n0 + 1, n0 + 30, n0 + 150)):
        pol = HFPolicy(model, tok, max_new_tokens=40, temperature=1.0, seed=k, engine=engine or None)
        cfg = EnvConfig(work_dir=str(tmp_path / f"ws{k}"), max_turns=6, max_context_tokens=budget, final_check=False)
        for t in run_episodes(pol, [Task(code=TASK)] * 2, None, cfg):
            if budget <= n0 + 1:                                 # no room for one token and its end-of-turn
                assert t.turns == [] and t.stop_reason == "context"
                continue
            assert t.turns and len(t.ids) <= budget, (budget, len(t.ids))
            assert t.stop_reason == "context" or (budget == n0 + 150 and t.stop_reason == "max_turns")
            if t.turns[-1].get("observations_dropped"):
                assert t.messages[-1]["role"] == "assistant"
            assert tokenize_conversation(t.messages, t.tools, tok) == (t.ids, t.mask)


class OutOfRoom:
    """Scripted: the first turn from `first`, then no room left for a turn (what HFPolicy answers)."""
    def __init__(self, first):
        self.replay = ReplayPolicy([first])

    def act(self, states):
        return [env.Action(text="", token_ids=[], logprobs=[], finish_reason="context")
                if any(m["role"] == "assistant" for m in s.messages) else self.replay.act([s])[0] for s in states]


def test_observations_past_the_budget_stay_out_of_the_record(tmp_path, tok):
    first = turn(call("glob", pattern="*.md"))
    run = lambda budget, d: run_episodes(OutOfRoom(first), [Task(code=TASK)], None, EnvConfig(  # noqa: E731
        work_dir=str(tmp_path / d), max_context_tokens=budget, final_check=False), tokenizer=tok)[0]
    full = run(131072, "a")
    assert full.stop_reason == "context" and len(full.turns) == 1 and full.messages[-1]["role"] == "tool"
    assert "INSTRUCTIONS.md" in full.messages[-1]["content"]
    assert run(len(full.ids), "b").messages == full.messages                  # fits exactly: all recorded
    n = len(tokenize_conversation(full.messages[:3], full.tools, tok)[0])    # up to the end of the turn
    cut = run(n, "c")
    assert cut.stop_reason == "context" and cut.messages == full.messages[:3] and len(cut.ids) == n
    assert cut.turns[-1]["observations_dropped"] == 1 and cut.turns[-1]["calls"][0]["name"] == "glob"


@pytest.mark.slow
def test_overlapped_turns_equal_turn_by_turn(tmp_path):
    """run_episodes with a streaming policy (HFPolicy on engine.Engine): each episode's next turn starts when
    its tools finish, and the trajectories (messages, sampled ids, log-probs) equal turn-by-turn ones."""
    model, tok = build_tiny_model_and_tokenizer(seed=0)
    model = model.float()
    runs = {}
    for overlap in (False, True):
        pol = HFPolicy(model, tok, max_new_tokens=24, temperature=1.0, seed=0, engine=True, max_batch=3)
        cfg = EnvConfig(work_dir=str(tmp_path / f"ws{overlap}"), max_turns=3, final_check=False, overlap_turns=overlap)
        runs[overlap] = run_episodes(pol, [Task(code=TASK)] * 4, None, cfg)
        assert not pol.engine.episodes, "every episode's cache is released at its end"
        assert pol.calls == (0 if overlap else 3), "overlapped: no turn-by-turn act calls"
    for a, b in zip(runs[False], runs[True]):
        assert [m["content"] for m in a.messages] == [m["content"] for m in b.messages]
        assert (a.ids, a.mask, a.stop_reason) == (b.ids, b.mask, b.stop_reason) and len(a.turns) == 3
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


# ---------------------------------------------------------------------------------------------- solve (CLI)
def test_solve_through_the_cli_saves_transcript_trajectory_and_best(tmp_path, capsys):
    from cuda_agent import main
    task = tmp_path / "relu.py"
    task.write_text(TASK)
    script = tmp_path / "script.json"
    script.write_text(json.dumps([turn(call("write_file", path="model_new.py", content=CHEAT)),
                                  turn(call("verify")), turn(call("finish"))]))
    out = tmp_path / "out"
    rc = main(["solve", str(task), "--policy.kind", "replay", "--policy.script", str(script), "--out", str(out),
               "--sandbox.cache-dir", str(tmp_path / "cache"), "--env.max-turns", "5"])
    text = capsys.readouterr().out
    assert rc == 1, "a rule-breaking solution is not a solution"
    assert "RULE VIOLATION" in text and "write_file" in text and "best_reward=-1.0" in text
    (t,) = load_trajectories(str(out / "trajectory.jsonl"))
    assert t.stop_reason == "finish" and t.task == "relu" and len(t.turns) == 3
    assert open(out / "best" / "model_new.py").read() == CHEAT and open(out / "best" / "model.py").read() == TASK


def test_profile_ncu_summary_plumbing_with_a_stand_in_ncu(tmp_path, monkeypatch):
    """The ncu pass (cuda only) without a GPU: a stand-in `ncu` on PATH reports what it was given."""
    import concurrent.futures
    so = tmp_path / "relu.so"
    so.write_bytes(b"\x7fELF")

    class Pool:   # compile() only; the summary never runs a check
        def compile(self, ws):
            f = concurrent.futures.Future()
            f.set_result((True, "", {"relu": str(so)}))
            return f

    sb = sandbox.SandboxConfig(device="cuda", cache_dir=str(tmp_path / "cache"))
    ep = env.Episode(0, Task(code=TASK), EnvConfig(work_dir=str(tmp_path / "ws")), Pool(), sb)
    bindir = os.path.join(ep.ws, ".bin")      # inside the workspace: bash's sandbox hides the host's /tmp
    os.makedirs(bindir)
    with open(os.path.join(bindir, "ncu"), "w") as f:
        f.write('#!/bin/sh\necho "stand-in ncu args: $*"\n'
                'python -c "import json, os; [print(\'lib\', n, os.path.exists(p)) for n, p in '
                'json.loads(os.environ[\'CUDA_AGENT_KERNELS\']).items()]"\n')
    os.chmod(os.path.join(bindir, "ncu"), 0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    out = ep._ncu_summary()
    assert out.startswith("ncu kernel summary") and "--print-summary per-kernel" in out and "python .ncu/run.py" in out
    assert "lib relu True" in out, out
    assert ".ncu/relu.so" not in "".join(tools.snapshot(ep.ws)), "build products stay out of snapshots"


def test_a_turn_that_samples_no_token_keeps_the_others_aligned():
    """The k-th run of policy tokens belongs to the k-th turn that sampled anything."""
    mask = [0, 0, 1, 1, 0, 1, 1, 1, 1, 0]
    out = env.flat_logprobs(mask, [[-0.1, -0.2], [], [-0.3, -0.4, -0.5, -0.6]])
    assert out == [0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5, -0.6, 0]
