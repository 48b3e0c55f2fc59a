"""cuda-agent: the command line. One command per stage of the paper, each backed by one dataclass config.

    python cuda_agent.py train                      # all four training stages, tiny preset (CPU, offline)
    python cuda_agent.py train --preset paper       # the paper's recipe on a real MoE (GPU node)
    python cuda_agent.py check TASK SOLUTION [--device cpu|cuda] [--json]
    python cuda_agent.py solve TASK --policy replay|hf|openai [--max-turns N] [--device cpu|cuda]
    python cuda_agent.py synth [--n-candidates N] [--out data/synth.jsonl]
    python kernelbench_eval.py --level 2            # KernelBench evaluation (its own entry point)

Every flag comes from a dataclass field; the string literal under each field is its `--help` text
(CleanRL's `Args`, without the tyro dependency). `python cuda_agent.py CMD --help` lists them.

Departures from the paper: none here; this file only parses flags and dispatches.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import sys
import textwrap
import types
import typing

# --------------------------------------------------------------------------------------------------
# dataclass -> argparse
# --------------------------------------------------------------------------------------------------


def field_docs(cls) -> dict[str, str]:
    """The string literal written right under each field of a dataclass (CleanRL style) -> {field: doc}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp):
    """Reduce `X | None` / Optional[X] to (X, nullable)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(args) == 1, f"only `X | None` unions are supported, got {tp}"
        return args[0], True
    return tp, False


def _converter(tp):
    base, nullable = _base_type(tp)
    if typing.get_origin(base) is list:
        (elem,) = typing.get_args(base)

        def conv(s, elem=elem):
            return [elem(x) for x in s.split(",") if x.strip() != ""]
    else:
        conv = base
    if not nullable:
        return conv
    return lambda s: None if s.lower() in ("none", "null", "") else conv(s)


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                    positional: tuple[str, ...] = ()) -> None:
    """Add one `--flag` per dataclass field (snake_case -> kebab-case); fields named in `positional` become
    positional arguments. Defaults are applied later, from the dataclass or the preset."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = hints[f.name]
        default = (f.default if f.default is not dataclasses.MISSING
                   else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_ = f"{docs.get(f.name, '')} (default: {default!r})"
        if f.name in positional:
            parser.add_argument(f.name, type=_converter(tp), help=docs.get(f.name, ""))
        elif tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=_converter(tp), default=argparse.SUPPRESS,
                                metavar=f.name.upper(), help=help_)


def config_from_namespace(cls, ns: argparse.Namespace, base=None):
    """Build `cls` from parsed flags; flags given on the command line override `base` (a preset)."""
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    if base is None:
        return cls(**given)
    return dataclasses.replace(base, **given)


def parse_config(cls, argv: list[str] | None = None, presets: dict | None = None, prog: str | None = None,
                 description: str | None = None, positional: tuple[str, ...] = ()):
    """Parse argv into an instance of dataclass `cls`. With `presets`, `--preset NAME` picks the base config
    (named config instances, style principle 3) and explicit flags override its fields."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if presets:
        parser.add_argument("--preset", default=next(iter(presets)), choices=sorted(presets),
                            help="named base config; other flags override its fields")
    add_config_args(parser, cls, skip=("preset",), positional=positional)
    ns = parser.parse_args(argv)
    base = presets[ns.preset] if presets else None
    cfg = config_from_namespace(cls, ns, base)
    if presets and any(f.name == "preset" for f in dataclasses.fields(cls)):
        cfg = dataclasses.replace(cfg, preset=ns.preset)
    return cfg


# --------------------------------------------------------------------------------------------------
# check: the sandbox's contract with every other tool (issue 2 §9). Keep its output stable.
# --------------------------------------------------------------------------------------------------

CHECK_KEYS = ("compiled", "correct", "violation", "error", "eager_ms", "compile_ms", "candidate_ms",
              "speedup_eager", "speedup_compile", "reward")


def _fmt_ms(x):
    return "-" if x is None else f"{x:.4f} ms"


def print_verdict(v: dict) -> None:
    """A readable summary of a verdict for a terminal."""
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
        print(f"  trial seed={t.get('seed')} {mark} max_abs={t.get('max_abs_err')} "
              f"rel_l2={t.get('rel_l2')} {t.get('reason') or ''}".rstrip())
    print(f"device    : {v.get('device')}   precision: {v.get('precision')}")
    print(f"eager     : {_fmt_ms(v['eager_ms'])}")
    print(f"compile   : {_fmt_ms(v['compile_ms'])}")
    print(f"candidate : {_fmt_ms(v['candidate_ms'])}")
    if v["speedup_eager"] is not None:
        se, sc = v["speedup_eager"], v["speedup_compile"]
        print(f"speedup   : {se:.3f}x vs eager, " + ("-" if sc is None else f"{sc:.3f}x vs torch.compile"))
    if not ok and v.get("compile_log"):
        print("compile log (trimmed):\n" + textwrap.indent(v["compile_log"][-3000:], "  "))


def cmd_check(argv: list[str]) -> int:
    import sandbox
    parser = argparse.ArgumentParser(prog="cuda_agent.py check",
                                     description="Compile, verify and profile one solution in the sandbox.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", help="KernelBench-format task file (class Model, get_inputs, get_init_inputs)")
    parser.add_argument("solution", help="single-file ModelNew (.py) or a workspace directory")
    parser.add_argument("--json", action="store_true", help="last stdout line is one JSON verdict")
    add_config_args(parser, sandbox.SandboxConfig)
    ns = parser.parse_args(argv)
    cfg = config_from_namespace(sandbox.SandboxConfig, ns)
    if not os.path.exists(ns.task):
        print(f"error: task file not found: {ns.task}", file=sys.stderr)
        return 2
    if not os.path.exists(ns.solution):
        print(f"error: solution not found: {ns.solution}", file=sys.stderr)
        return 2
    try:
        task = sandbox.load_task(ns.task, device=cfg.device)
    except sandbox.TaskError as e:
        print(f"error: bad task {ns.task}: {e}", file=sys.stderr)
        return 2
    try:
        verdict = sandbox.check(task, ns.solution, cfg).to_dict()
    except sandbox.TaskError as e:  # the reference itself failed on this device (e.g. it times out)
        print(f"error: bad task {ns.task}: {e}", file=sys.stderr)
        return 2
    missing = [k for k in CHECK_KEYS if k not in verdict]
    assert not missing, f"sandbox verdict lacks contract keys {missing}"
    if ns.json:
        print(json.dumps(verdict, default=str))
    else:
        print_verdict(verdict)
    return 0


# --------------------------------------------------------------------------------------------------
# train / solve / synth: thin wrappers over each module's config and entry function
# --------------------------------------------------------------------------------------------------


def cmd_train(argv: list[str]) -> int:
    import ppo
    cfg = parse_config(ppo.TrainConfig, argv, presets=ppo.PRESETS, prog="cuda_agent.py train",
                       description="RL training: warm-up, RFT, value pretraining, agentic PPO (paper §3.3).")
    return ppo.train(cfg)


def cmd_solve(argv: list[str]) -> int:
    import env
    cfg = parse_config(env.SolveConfig, argv, prog="cuda_agent.py solve", positional=("task",),
                       description="Run one agent episode on one task and save the best solution.")
    return env.solve(cfg)


def cmd_synth(argv: list[str]) -> int:
    import synth
    cfg = parse_config(synth.SynthConfig, argv, prog="cuda_agent.py synth",
                       description="Synthesize training tasks: mine operators, compose, filter by running.")
    return synth.main(cfg)


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
    return COMMANDS[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
