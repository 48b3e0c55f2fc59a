"""The commands as a new user meets them: through the real entry points, on CPU, with the README's flags.

Each test runs `kernelbench_eval.py` or `cuda_agent.py` in a child process (as a shell would) and checks the
exit code and stderr: bad input is one line and exit 2, found before any work (no Traceback, no run folder);
check's 0 / 1 / 2; an eval folder refuses another run's resume; device "auto" as every command's default; solve's
budgets sized for the machine; the eval's labelled speedup plot; the ANSI-free transcript.
"""
import json
import os
import subprocess
import sys
import time

import pytest

import cuda_agent
import env
import policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "kernelbench")
TASK = os.path.join(FIX, "KernelBench", "level1", "1_Tiny_ReLU.py")
HONEST = os.path.join(FIX, "samples", "level_1_problem_1_sample_0_kernel.py")   # C++ ReLU: passes
HACKED = os.path.join(FIX, "samples", "level_1_problem_1_sample_1_kernel.py")   # torch.relu fallback: fails


def run(script, *args, cwd, env_extra=None, timeout=240):
    """(exit code, stdout, stderr) of `python SCRIPT ARGS` from `cwd`, without $KERNELBENCH_DIR."""
    e = {k: v for k, v in os.environ.items() if k != "KERNELBENCH_DIR"}
    e.update({"HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}, **(env_extra or {}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=cwd, env=e,
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def one_line_error(rc, err, *words):
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], lines[0]


# --------------------------------------------------------------------------------------------------
# kernelbench_eval.py
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eval_without_kernelbench_says_where_to_get_it(tmp_path):
    """The README's command on a machine with no KernelBench: one line naming the flag, before any work."""
    t0 = time.time()
    rc, _, err = run("kernelbench_eval.py", "--level", "2", cwd=tmp_path)
    one_line_error(rc, err, "no KernelBench found", "--kernelbench-dir", "$KERNELBENCH_DIR", "--hf-dataset")
    assert time.time() - t0 < 60                              # imports only: no hub retries, no sandbox
    assert not (tmp_path / "runs").exists()                   # no run folder for a run that never started


@pytest.mark.slow
def test_eval_finds_kernelbench_dir_from_the_environment(tmp_path):
    """$KERNELBENCH_DIR is the documented default location; the next missing piece (a policy) is named."""
    rc, _, err = run("kernelbench_eval.py", "--level", "2", cwd=tmp_path, env_extra={"KERNELBENCH_DIR": FIX})
    one_line_error(rc, err, "--policy.script", "--samples-dir")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, words", [
    (["--sandbox.device", "gpu"], ["--sandbox.device"]),
    (["--level", "7"], ["--level"]),
    (["--samples-dir", "/nonexistent"], ["--samples-dir"]),
    (["--kernelbench-dir", "/nonexistent"], ["--kernelbench-dir"]),
    (["--hf-dataset", "someone/nothing"], ["--hf-dataset"]),
    (["--policy.kind", "hf"], ["--policy.model"]),
])
def test_eval_bad_arguments_are_one_line(tmp_path, monkeypatch, capsys, args, words):
    """In-process (the same main() the script calls, parsed by the same tyro config), to keep the suite fast."""
    import tyro
    import kernelbench_eval as kb
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    base = ["--kernelbench-dir", FIX, "--samples-dir", os.path.join(FIX, "samples"), "--out", tmp_path / "o"]
    if args[0] == "--policy.kind":
        base = base[:2] + base[4:]                            # agent mode
    if args[0] == "--hf-dataset":
        base = base[2:]                                       # the hub, named; here unreachable
    rc = kb.main(tyro.cli(kb.EvalConfig, args=[str(a) for a in base + args]))
    one_line_error(rc, capsys.readouterr().err, *words)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.skipif(bool(__import__("torch").cuda.is_available()), reason="checks the no-GPU message")
def test_eval_cuda_without_gpu_is_refused_before_work(tmp_path):
    rc, _, err = run("kernelbench_eval.py", "--kernelbench-dir", FIX, "--samples-dir", os.path.join(FIX, "samples"),
                     "--sandbox.device", "cuda", "--out", tmp_path / "o", cwd=tmp_path)
    one_line_error(rc, err, "--sandbox.device")


@pytest.mark.slow
def test_eval_runs_then_refuses_another_runs_resume(tmp_path):
    """Fixtures + samples mode runs (exit 0, config.json records the run); an agent run into the same folder
    is refused instead of reporting the old run's numbers; --no-resume starts afresh."""
    out = tmp_path / "out"
    common = ["--kernelbench-dir", FIX, "--level", "1", "--problems", "1", "--sandbox.no-profile",
              "--sandbox.cache-dir", tmp_path / "cache", "--out", out]
    rc, stdout, err = run("kernelbench_eval.py", *common, "--samples-dir", os.path.join(FIX, "samples"), cwd=tmp_path)
    assert rc == 0, err
    assert json.load(open(out / "config.json"))["run"]["mode"] == "samples"
    before = (out / "results.jsonl").read_text()
    assert json.loads(before)["correct"] is True
    script = tmp_path / "script.json"
    script.write_text("[]")
    rc, _, err = run("kernelbench_eval.py", *common, "--policy.script", script, cwd=tmp_path)
    one_line_error(rc, err, "another run", "mode samples -> agent", "--out", "--no-resume")
    assert (out / "results.jsonl").read_text() == before
    rc, _, err = run("kernelbench_eval.py", *common, "--level", "2", "--samples-dir", os.path.join(FIX, "samples"),
                     cwd=tmp_path)
    one_line_error(rc, err, "level [1] -> [2]")


# --------------------------------------------------------------------------------------------------
# cuda_agent.py check / solve
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_check_exit_codes(tmp_path, capsys):
    """0 correct, 1 not correct, 2 bad input: in-process for the verdicts, a child for the one-line error."""
    flags = ["--sandbox.device", "cpu", "--sandbox.no-profile", "--sandbox.cache-dir", str(tmp_path / "c")]
    assert cuda_agent.main(["check", TASK, HONEST, *flags]) == 0
    assert cuda_agent.main(["check", TASK, HACKED, *flags]) == 1
    assert cuda_agent.main(["check", TASK, str(tmp_path / "missing.py"), *flags]) == 2
    one_line_error(2, capsys.readouterr().err, "missing.py")
    bad = tmp_path / "bad_task.py"
    bad.write_text("class Model(:\n")
    rc, _, err = run("cuda_agent.py", "check", bad, HONEST, *flags, cwd=tmp_path)
    one_line_error(rc, err, "bad_task.py")
    rc = cuda_agent.main(["check", TASK, HONEST, "--sandbox.device", "tpu"])
    one_line_error(rc, capsys.readouterr().err, "--sandbox.device")


@pytest.mark.slow
def test_solve_refuses_a_policy_without_its_argument(tmp_path, capsys):
    rc, _, err = run("cuda_agent.py", "solve", TASK, "--out", tmp_path / "o", cwd=tmp_path)
    one_line_error(rc, err, "--policy.script")
    rc = cuda_agent.main(["solve", TASK, "--policy.kind", "hf", "--out", str(tmp_path / "o")])
    one_line_error(rc, capsys.readouterr().err, "--policy.model")
    rc = cuda_agent.main(["solve", str(tmp_path / "nope.py"), "--policy.script", HONEST])
    one_line_error(rc, capsys.readouterr().err, "nope.py")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_help_documents_exit_codes(tmp_path):
    rc, out, _ = run("kernelbench_eval.py", "--help", cwd=tmp_path)
    assert rc == 0 and "Exit codes" in out and "$KERNELBENCH_DIR" in out
    rc, out, _ = run("cuda_agent.py", "--help", cwd=tmp_path)
    assert rc == 0 and "Exit codes" in out and "1 not correct" in out


# --------------------------------------------------------------------------------------------------
# defaults shared by every command
# --------------------------------------------------------------------------------------------------


def test_device_auto_and_policy_validation():
    assert env.resolve_device("auto") in ("cpu", "cuda") and env.resolve_device("cpu") == "cpu"
    with pytest.raises(env.UsageError, match="auto | cpu | cuda"):
        env.resolve_device("gpu")
    assert policy.policy_problem(policy.PolicyConfig()) is not None            # replay needs a script
    assert policy.policy_problem(policy.PolicyConfig(kind="hf", model="tiny")) is None
    assert "replay | hf | openai" in policy.policy_problem(policy.PolicyConfig(kind="gpt"))
    assert cuda_agent.CheckConfig("t", "s").sandbox.device == "auto"


def test_transcript_has_no_ansi_colours_when_not_a_terminal(capsys):
    cuda_agent.print_event(0, "tool", "hello")
    assert capsys.readouterr().out == "[0] tool hello\n"


def test_every_command_defaults_to_device_auto():
    """train (model and sandbox), check, solve, synth and kernelbench_eval all start from auto; the paper preset
    names its GPU sandbox."""
    import kernelbench_eval
    import synth
    import train_config
    tiny = train_config.PRESETS["tiny"]
    assert (tiny.device, tiny.sandbox.device, train_config.TrainConfig().sandbox.device) == ("auto", "auto", "auto")
    assert train_config.PRESETS["paper"].sandbox.device == "cuda"
    assert cuda_agent.SolveConfig("t").sandbox.device == "auto"
    assert synth.SynthConfig().sandbox.device == "auto"
    assert kernelbench_eval.EvalConfig().sandbox.device == "auto"


@pytest.mark.parametrize("cmd", ["train", "synth"])
def test_bad_device_is_one_line_before_any_output(tmp_path, capsys, cmd):
    """train and synth resolve --sandbox.device themselves (auto -> cpu | cuda) before writing anything."""
    out = tmp_path / ("run" if cmd == "train" else "tasks.jsonl")
    rc = cuda_agent.main([cmd, "--sandbox.device", "gpu", "--out", str(out)])
    one_line_error(rc, capsys.readouterr().err, "--sandbox.device")
    assert not os.path.exists(out) and not os.listdir(tmp_path)


@pytest.mark.parametrize("gpu", [False, True])
def test_solve_budgets_follow_the_machine(monkeypatch, gpu):
    """solve never starts a CPU-only machine on paper-scale budgets (150 turns, 128k context, 4096 tokens/turn)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: gpu)
    c = cuda_agent.SolveConfig("t")
    if gpu:
        assert (c.env.max_turns, c.env.max_context_tokens, c.policy.max_new_tokens) == (150, 131072, 4096)
    else:
        assert (c.env.max_turns, c.env.max_context_tokens, c.policy.max_new_tokens) == (20, 32768, 1024)


def test_speedup_plot_is_labelled_like_training_curves(tmp_path, monkeypatch):
    """kernelbench_eval's speedup_distribution.png: per-level title with the correct count, axis labels that
    say what x and y are, a legend for each line (baselines and the 1x mark), a figure title."""
    import kernelbench_eval as kb
    figs = []
    monkeypatch.setattr(kb.plt, "close", lambda fig: figs.append(fig))
    recs = [{"level": 1, "correct": True, "speedup_eager": 2.0, "speedup_compile": 1.5},
            {"level": 1, "correct": False, "speedup_eager": None, "speedup_compile": None},
            {"level": 2, "correct": True, "speedup_eager": 0.8, "speedup_compile": 0.5}]
    kb.plot_speedups(str(tmp_path / "s.png"), recs)
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = figs
    a1, a2 = fig.axes
    assert a1.get_title() == "KernelBench level 1: 1/2 problems correct" and "1/1" in a2.get_title()
    assert "t_baseline / t_candidate" in a1.get_xlabel() and "log" in a1.get_xlabel()
    assert a1.get_ylabel() == "correct problems per bin"
    legend = [t.get_text() for t in a1.get_legend().get_texts()]
    assert legend == ["vs eager (n=1)", "vs torch.compile (n=1)", "1x: as fast as the baseline"], legend
    assert "correct solution" in fig._suptitle.get_text()


def test_tiny_preset_fits_its_demonstrations_and_paper_keeps_the_recipe(tmp_path):
    """The tiny preset trains on tasks that all have demos, and a demo's first agentic turn fits in one sampled
    turn of the tiny tokenizer (so the actor can reproduce it); the paper preset is the paper's recipe."""
    import sandbox
    import tasks
    import train
    import train_config
    tiny, paper = train_config.PRESETS["tiny"], train_config.PRESETS["paper"]
    assert (paper.ppo.lam, paper.sampler.temperature, paper.rft.lr, paper.ppo.kl_coef, paper.ppo.epochs,
            paper.ppo.num_minibatches) == (0.95, 1.0, None, 0.0, 1, 1)
    assert tiny.rft.lr > tiny.ppo.lr_actor                          # SFT learns the demos, PPO does not undo them
    ts = tasks.load_tasks(tiny.tasks)
    demos = tasks.load_demos(tiny.demos.dir, ts, "cpu")
    assert len(demos) == len(ts) == 4
    tok = policy.build_tiny_tokenizer()
    ecfg = env.EnvConfig(work_dir=str(tmp_path))
    for t, files in demos:
        ep = env.Episode(0, t, ecfg, None, sandbox.SandboxConfig())
        turn = {"role": "assistant", **train.demo_script(files, single_turn=False)[0]}
        _, mask = env.tokenize_conversation(ep.messages + [turn], ep.tools, tok)
        assert 0 < sum(mask) < tiny.sampler.max_new_tokens, (t.name, sum(mask))
