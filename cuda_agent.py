"""cuda-agent: the command line. One command per stage of the paper, each parsed by tyro from one config.

    python cuda_agent.py train                          # all four training stages, tiny preset (CPU, offline)
    python cuda_agent.py train --preset paper           # the paper's recipe on a real MoE (GPU node)
    python cuda_agent.py check TASK SOLUTION [--sandbox.device auto|cpu|cuda] [--reward speedup] [--json]
    python cuda_agent.py solve TASK --policy.kind replay|hf|openai [--env.max-turns N] [--out DIR]
    python cuda_agent.py solve TASK --policy.adapter runs/tiny/adapter   # a trained run's actor on its base
    python cuda_agent.py synth [--n-candidates N] [--out data/synth.jsonl]
    python kernelbench_eval.py --level 2                # KernelBench evaluation (its own entry point)

Configs nest the configs of the parts they drive (`--env.max-turns`, `--sandbox.atol`, `--policy.model`; train's
groups in train_config.py: `--ppo.lr-actor`, `--rft.steps`, `--pool.gpus`, ...); the string under each dataclass
field is its `--help`. `python cuda_agent.py CMD --help` lists them.
--sandbox.device auto (the default of train, check, solve, synth and kernelbench_eval, and train's --device) is
cuda when torch lists a GPU, else cpu. solve's budgets follow the machine too: the paper's 150 turns with a GPU,
20 turns, 32k tokens and 1024 tokens per turn without one.

Exit codes: check 0 correct (PASS), 1 not correct (FAIL); solve 0 a correct solution was found, 1 none;
train and synth 0 finished; every command 2 on bad arguments or an infrastructure error (one line, no traceback).

Departures from the paper: none here; this file parses flags, dispatches, and runs `solve`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Annotated

import tyro

import env
import policy
import reward
import sandbox
import synth
import tasks
import tools
import train
import train_config

# --------------------------------------------------------------------------------------------------
# check: the sandbox's contract with every other tool. Keep its output stable.
# --------------------------------------------------------------------------------------------------

CHECK_KEYS = ("compiled", "correct", "violation", "error", "eager_ms", "compile_ms", "candidate_ms",
              "speedup_eager", "speedup_compile", "reward")


@dataclass
class CheckConfig:
    task: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="TASK")]
    """KernelBench-format task file (class Model, get_inputs, get_init_inputs)"""
    solution: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="SOLUTION")]
    """single-file ModelNew (.py) or a workspace directory"""
    json: bool = False
    """print one JSON verdict as the last stdout line"""
    reward: str = "milestone"
    """reward kind reported with the verdict (reward.py): milestone (Eq. 1) | speedup"""
    sandbox: sandbox.SandboxConfig = field(default_factory=lambda: sandbox.SandboxConfig(device="auto"))
    """how the solution is compiled, verified and timed (--sandbox.device auto | cpu | cuda)"""


def _fmt_ms(x):
    return "-" if x is None else f"{x:.4f} ms"


def print_verdict(v: dict) -> None:
    """A readable summary of a verdict (with its reward from reward.py) for a terminal."""
    ok = v["compiled"] and v["correct"] and not v["violation"]
    print(f"verdict   : {'PASS' if ok else 'FAIL'}   reward {v['reward']:+.2f}   (stage {v.get('stage')})")
    print(f"compiled  : {v['compiled']}")
    print(f"correct   : {v['correct']}")
    if v["violation"]:
        print(f"violation : {v['violation']}")
    if v["error"]:
        print(f"error     : {v['error']}")
    for t in v.get("trials") or []:
        mark = "ok " if t.get("ok") else "BAD"
        print(f"  trial {t.get('trial')} {mark} max_abs={t.get('max_abs_err')} "
              f"rel_l2={t.get('rel_l2')} {t.get('reason') or ''}".rstrip())
    if v.get("form"):
        print(f"form      : {v['form']}")
    print(f"device    : {v.get('device')}   precision: {v.get('precision')}")
    if lane := (v.get("timings") or {}).get("lane"):  # --sandbox.ray-address: the lane that checked and timed it
        print(f"lane      : {lane.get('lane')} on node {lane.get('node')} ({lane.get('node_id')})"
              + (f", GPU {lane['gpu']}" if lane.get("gpu") else ""))
    print(f"eager     : {_fmt_ms(v['eager_ms'])}")
    print(f"compile   : {_fmt_ms(v['compile_ms'])}")
    print(f"candidate : {_fmt_ms(v['candidate_ms'])}")
    if v["speedup_eager"] is not None:
        se, sc = v["speedup_eager"], v["speedup_compile"]
        print(f"speedup   : {se:.3f}x vs eager, " + ("-" if sc is None else f"{sc:.3f}x vs torch.compile"))
    if not ok and v.get("compile_log"):
        print("compile log (trimmed):\n" + textwrap.indent(v["compile_log"][-3000:], "  "))


def check(cfg: CheckConfig) -> int:
    """Compile, verify and profile one solution: 0 correct (PASS), 1 not correct (FAIL), 2 bad input or a
    sandbox failure (one line on stderr)."""
    for what, path in (("task file", cfg.task), ("solution", cfg.solution)):
        if not os.path.exists(path):
            raise env.UsageError(f"{what} not found: {path}")
    if cfg.reward not in ("milestone", "speedup"):
        raise env.UsageError(f"--reward must be milestone | speedup, got {cfg.reward!r}")
    # One check: no warm spares (a spare only ever serves a later check), and the task is validated by the
    # check's own driver, so a refusal the host can answer (syntax, static scan) starts no child at all.
    spares = cfg.sandbox.warm_spares if cfg.sandbox.warm_spares >= 0 else 0
    sb = dataclasses.replace(cfg.sandbox, device=env.resolve_device(cfg.sandbox.device), warm_spares=spares)
    try:
        # both arguments name an existing file or directory (checked above): locations, never source text;
        # with --sandbox.ray-address the check runs on a lane there
        verdict = sandbox.ray.check(pathlib.Path(cfg.task), pathlib.Path(cfg.solution), sb).to_dict()
    except sandbox.TaskError as e:  # a bad task, or the reference itself failed on this device
        raise sandbox.TaskError(f"bad task {cfg.task}: {e}") from None
    verdict["reward"] = reward.reward_from_verdict(verdict, cfg.reward)
    missing = [k for k in CHECK_KEYS if k not in verdict]
    assert not missing, f"sandbox verdict lacks contract keys {missing}"
    if cfg.json:
        print(json.dumps(verdict, default=str))
    else:
        print_verdict(verdict)
    return 0 if verdict["compiled"] and verdict["correct"] and not verdict["violation"] else 1


# --------------------------------------------------------------------------------------------------
# solve: one episode from the command line, with a live transcript
# --------------------------------------------------------------------------------------------------


@dataclass
class SolveConfig:
    task: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="TASK")]
    """path to a task .py (KernelBench format: Model, get_inputs, get_init_inputs)"""
    out: str = "runs/solve"
    """output directory: trajectory.jsonl, best/ (best solution workspace), workspaces/"""
    seed: int = 0
    """the one seed: sampling and the sandbox's inputs"""
    quiet: bool = False
    """do not print the live transcript"""
    policy: policy.PolicyConfig = field(default_factory=policy.sized_policy)
    """who acts (--policy.max-new-tokens sized for this machine, see policy.sized_policy)"""
    env: env.EnvConfig = field(default_factory=env.sized_env)
    """the episode (its work_dir is OUT/workspaces; budgets sized for this machine, see env.sized_env)"""
    sandbox: sandbox.SandboxConfig = field(default_factory=lambda: sandbox.SandboxConfig(device="auto"))
    """where and how candidates run (--sandbox.device auto: cuda kernels with a GPU, C++ without)"""


def print_event(eid: int, kind: str, text: str) -> None:
    """The live transcript: one block per assistant turn, tool result and verdict."""
    color = {"assistant": "\033[36m", "tool": "\033[33m", "error": "\033[31m", "verdict": "\033[32m"}[kind]
    reset = "\033[0m"
    if not sys.stdout.isatty() or os.environ.get("NO_COLOR"):  # a file or a pipe gets plain text
        color = reset = ""
    body = text if kind == "assistant" else tools.truncate(text, 1500)
    print(f"{color}[{eid}] {kind}{reset} {body}", flush=True)


def solve(cfg: SolveConfig) -> int:
    """One episode on one task. Returns 0 if a correct solution was found, 1 if not; bad input (checked
    before any model is loaded) and sandbox failures raise, and main() turns them into one line and 2."""
    if not os.path.isfile(cfg.task):
        raise env.UsageError(f"task file not found: {cfg.task}")
    if why := policy.policy_problem(cfg.policy):
        raise env.UsageError(why)
    sb = dataclasses.replace(cfg.sandbox, seed=cfg.seed, device=env.resolve_device(cfg.sandbox.device))
    try:
        sandbox.load_task(pathlib.Path(cfg.task))
        task = tasks.task_from_file(cfg.task)
    except (sandbox.TaskError, OSError) as e:
        raise sandbox.TaskError(f"bad task {cfg.task}: {e}") from None
    pol = policy.make_policy(cfg.policy, device=sb.device, seed=cfg.seed)
    ecfg = dataclasses.replace(cfg.env, work_dir=os.path.join(cfg.out, "workspaces"))
    pool = sandbox.make_pool(sb)  # this machine's, or with --sandbox.ray-address the Ray cluster's lanes
    try:
        traj = env.run_episodes(pol, [task], pool, ecfg, log=None if cfg.quiet else print_event)[0]
    finally:
        pool.close()
    tasks.save_trajectories(os.path.join(cfg.out, "trajectory.jsonl"), [traj])
    best = tools.restore_best(os.path.join(cfg.out, "best"), task.code, sb.device, traj.best_files,
                              layout=cfg.env.workspace)
    print(f"\n{traj.task}: stop={traj.stop_reason} turns={len(traj.turns)} invalid_calls={traj.invalid_calls} "
          f"repeated_calls={traj.repeated_calls} best_reward={traj.best_reward} final_reward={traj.final_reward}")
    print(f"saved {os.path.join(cfg.out, 'trajectory.jsonl')} and {best}/")
    return 0 if traj.best_reward >= 1 else 1


# --------------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------------


def pop_preset(argv: list[str], presets: dict) -> tuple[str, list[str]]:
    """(preset name, argv without `--preset NAME`); the first preset is the default."""
    name, rest, i = next(iter(presets)), [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--preset" and i + 1 < len(argv):
            name, i = argv[i + 1], i + 2
            continue
        if a.startswith("--preset="):
            name = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if name not in presets:
        print(f"error: unknown --preset {name!r}; choose from {', '.join(presets)}", file=sys.stderr)
        raise SystemExit(2)
    return name, rest


def cmd_train(argv: list[str]) -> int:
    name, argv = pop_preset(argv, train_config.PRESETS)
    cfg = train_config.parse(argv, name, prog="cuda_agent.py train",
                             description="RL training: warm-up, RFT, value pretraining, agentic PPO (paper §3.3). "
                                         f"--preset {'|'.join(train_config.PRESETS)} picks the defaults (first: "
                                         "default).")
    return train.train(cfg)


def cmd_check(argv: list[str]) -> int:
    return check(tyro.cli(CheckConfig, args=argv, prog="cuda_agent.py check",
                          description="Compile, verify and profile one solution in the sandbox."))


def cmd_solve(argv: list[str]) -> int:
    return solve(tyro.cli(SolveConfig, args=argv, prog="cuda_agent.py solve",  # its work_dir is OUT/workspaces
                          description="Run one agent episode on one task and save the best solution.",
                          registry=train_config.cli_registry({env.EnvConfig: ("work_dir",)})))


def cmd_synth(argv: list[str]) -> int:
    return synth.main(tyro.cli(synth.SynthConfig, args=argv, prog="cuda_agent.py synth",
                               description="Synthesize training tasks: mine operators, compose, filter by running."))


COMMANDS = {"train": cmd_train, "check": cmd_check, "solve": cmd_solve, "synth": cmd_synth}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # torch.compile's cache goes under the project cache, not $TMPDIR/torchinductor_$USER
    cache = os.path.expanduser(os.environ.get("CUDA_AGENT_CACHE", "~/.cache/cuda_agent"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "inductor"))
    try:
        return COMMANDS[cmd](rest)
    except (env.UsageError, sandbox.TaskError, sandbox.SandboxError, FileNotFoundError) as e:
        # bad input or the sandbox's own failure: one line, no traceback (argument errors: tyro, also 2)
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(sandbox.interruptible(main))  # Ctrl-C: every sandbox child killed, one line, exit 130
