"""Tasks and trajectories: the two records every stage passes around, and every loader for them.

A `Task` is one PyTorch reference program in KernelBench format (`class Model`, `get_inputs`,
`get_init_inputs`) plus where it came from. Loaders, all returning `list[Task]`:
  * `load_tasks(source)`: training tasks (paper §3.1) from our synth JSONL, a local CUDA-Agent-Ops-6K dump
    (.jsonl/.json or .parquet, columns code, ops, data_source), a folder of such files, or an HF dataset id;
  * `load_kernelbench(source, levels)`: KernelBench problems (paper §4.1) from a checkout
    (`KernelBench/level{N}/{id}_{Name}.py`), a .jsonl in the HF schema (code, level, name, problem_id),
    a `save_to_disk` folder, or the HF hub id `ScalingIntelligence/KernelBench`;
  * `find_kernelbench(dir, hf)`: where KernelBench is (flag, $KERNELBENCH_DIR, ./KernelBench), failing fast;
  * `task_from_file(path)`: one task .py (the `check` and `solve` commands).
A `Trajectory` is one agent episode as the environment recorded it (messages, token ids, policy mask,
verdicts); `save_trajectories` / `load_trajectories` round-trip it through JSONL exactly. `load_demos`
reads the shipped demonstration solutions (data/demos/<task hash>/<backend>/).

This module imports nothing else of the project, so the trainer, the environment, the evaluator and the
synthesizer can all use it.

Departures from the paper: none; this file only reads and writes records.

Smoke: python -m pytest -q tests/test_tasks.py
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field

KERNELBENCH_ID = "ScalingIntelligence/KernelBench"  # splits level_1..level_4; columns code, level, name, problem_id


@dataclass
class Task:
    code: str                            # the reference program (class Model, get_inputs, get_init_inputs)
    name: str = ""                       # short id used for workspaces and logs (default: the hash)
    level: int | None = None             # KernelBench level, if it is a KernelBench problem
    problem_id: int | None = None        # KernelBench problem id
    path: str | None = None              # the file it was read from, if any
    ops: list[str] = field(default_factory=list)   # the operators it composes (synth / Ops-6K)
    data_source: str = "unknown"         # "torch#k" | "transformers" | "kernelbench" | "file" | ...
    hash: str = ""                       # source_hash(code): the task's identity (demos are keyed by it)
    extra: dict = field(default_factory=dict)      # the row's other columns (synth: spec, eager_ms, ...)

    def __post_init__(self):
        assert isinstance(self.code, str) and self.code.strip(), f"task {self.name!r} has no code"
        self.hash = self.hash or source_hash(self.code)
        self.name = str(self.name or self.hash)

    def to_row(self) -> dict:
        """The task as one flat JSON row (extra columns first, so the named fields win)."""
        d = dataclasses.asdict(self)
        return {**d.pop("extra"), **d}


def normalize_source(code: str) -> str:
    """Canonical text: parsed and unparsed (comments/whitespace gone), docstrings dropped."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def source_hash(code: str) -> str:
    """16 hex digits of sha256 over the normalized source (the raw text if it does not parse)."""
    try:
        text = normalize_source(code)
    except SyntaxError:
        text = code
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Training tasks: synth JSONL, CUDA-Agent-Ops-6K (local or hub)
# --------------------------------------------------------------------------------------------------


def _ops_list(v) -> list[str]:
    """The `ops` column as a list of names (Ops-6K stores it as a JSON or Python list literal string)."""
    if v is None:
        return []
    if isinstance(v, str):
        for parse in (json.loads, ast.literal_eval):
            try:
                got = parse(v)
                return [str(o) for o in got] if isinstance(got, (list, tuple)) else [str(got)]
            except (ValueError, SyntaxError):
                continue
        return [v]
    return [str(o) for o in list(v)]


def task_from_row(r: dict, i: int = 0) -> Task:
    """One dataset row -> Task; columns other than Task's fields are kept in `extra`."""
    assert isinstance(r.get("code"), str) and r["code"].strip(), f"row {i} has no 'code' string"
    names = {f.name for f in dataclasses.fields(Task)} - {"extra"}
    return Task(code=r["code"], name=str(r.get("name") or ""), level=r.get("level"), problem_id=r.get("problem_id"),
                path=r.get("path"), ops=_ops_list(r.get("ops")), data_source=str(r.get("data_source") or "unknown"),
                hash=str(r.get("hash") or ""), extra={k: v for k, v in r.items() if k not in names})


def _read_rows(path: str) -> list[dict]:
    """Rows of a .jsonl/.json or .parquet file (parquet needs pandas or pyarrow, optional dependencies)."""
    if path.endswith((".jsonl", ".json")):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    try:
        import pandas as pd   # optional dependency: parquet files only
        return pd.read_parquet(path).to_dict("records")
    except ImportError:
        import pyarrow.parquet as pq   # optional dependency: parquet files only
        return pq.read_table(path).to_pylist()


def _is_hub_id(source: str) -> bool:
    return not os.path.exists(os.path.expanduser(source)) and re.fullmatch(r"[\w.-]+/[\w.-]+", source) is not None


def load_tasks(source: str, split: str = "train", limit: int | None = None) -> list[Task]:
    """Training tasks from our synth JSONL, a local Ops-6K dump (.jsonl/.json/.parquet), a folder holding
    such files (resume files `*.progress*` skipped), or an HF dataset id (needs `datasets`)."""
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith((".jsonl", ".parquet")) and ".progress" not in f)
        rows = [t.to_row() for f in files for t in load_tasks(os.path.join(path, f), split)]
    elif path.endswith((".jsonl", ".json", ".parquet")):
        rows = _read_rows(path)
    elif _is_hub_id(source):
        import datasets   # optional dependency: the HF hub dataset
        rows = list(datasets.load_dataset(source, split=split))
    else:
        raise FileNotFoundError(f"no tasks at {source!r} (want .jsonl, .parquet, a directory or an HF dataset id)")
    tasks = [task_from_row(r, i) for i, r in enumerate(rows)]
    return tasks[:limit] if limit else tasks


def task_from_file(path: str) -> Task:
    """One task .py file; its name is the file stem."""
    with open(path) as f:
        code = f.read()
    return Task(code=code, name=os.path.splitext(os.path.basename(path))[0], path=path, data_source="file")


# --------------------------------------------------------------------------------------------------
# KernelBench: checkout, .jsonl in the HF schema, save_to_disk folder, hub id
# --------------------------------------------------------------------------------------------------


def _kernelbench_root(root: str) -> str | None:
    """The folder holding level{N}/ of a KernelBench checkout (root/KernelBench or root), or None."""
    for base in (os.path.join(root, "KernelBench"), root):
        if os.path.isdir(base) and any(re.fullmatch(r"level\d+", d) for d in os.listdir(base)):
            return base
    return None


def _checkout_level(base: str, level: int) -> list[Task]:
    d = os.path.join(base, f"level{level}")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"no KernelBench/level{level} (nor level{level}) under {base}")
    out = []
    for fn in sorted(os.listdir(d)):
        m = re.match(r"^(\d+)_(.+)\.py$", fn)
        if m:
            path = os.path.join(d, fn)
            with open(path) as f:
                out.append(Task(code=f.read(), name=m.group(2), level=level, problem_id=int(m.group(1)), path=path,
                                data_source="kernelbench"))
    return out


def _hf_rows(source: str, level: int) -> list[dict]:
    """Rows {code, level, name, problem_id} of split level_{N}, from a .jsonl, a save_to_disk folder or the hub."""
    if source.endswith((".jsonl", ".json")):                      # local file in the HF schema, no dependency
        return [r for r in _read_rows(source) if int(r["level"]) == level]
    try:
        import datasets                                             # optional dependency: only this path needs it
    except ImportError as e:
        raise RuntimeError(f"reading {source!r} needs the `datasets` package (pip install datasets), "
                           "or pass a KernelBench checkout / a .jsonl in the same schema") from e
    split = f"level_{level}"
    if os.path.isdir(source):
        ds = datasets.load_from_disk(source)
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        ds = datasets.load_dataset(source, split=split)
    return [r for r in ds if int(r["level"]) == level]


def _hf_level(source: str, level: int) -> list[Task]:
    out = []
    for r in _hf_rows(source, level):
        missing = {"code", "level", "name", "problem_id"} - set(r)
        assert not missing, f"{source}: row lacks KernelBench columns {sorted(missing)}"
        # names in the dataset are file names ("19_ReLU.py"); keep the part after the id, as a checkout does
        out.append(Task(code=r["code"], name=re.sub(r"^\d+_", "", str(r["name"])).removesuffix(".py"), level=level,
                        problem_id=int(r["problem_id"]), data_source="kernelbench"))
    return out


# KernelBench's file naming of generated samples (its scripts write runs/<name>/level_{L}_problem_{P}_sample_{S}_kernel.py)
SAMPLE_RE = re.compile(r"^level_(\d+)_problem_(\d+)_sample_(\d+)_kernel\.py$")


def find_samples(samples_dir: str) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """{(level, problem_id): [(sample_id, path), ...]} from KernelBench's file naming; other files are ignored."""
    found: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for fn in sorted(os.listdir(samples_dir)):
        m = SAMPLE_RE.match(fn)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            found.setdefault(key, []).append((int(m.group(3)), os.path.join(samples_dir, fn)))
    return {k: sorted(v) for k, v in found.items()}


NO_KERNELBENCH = ("no KernelBench found: pass --kernelbench-dir PATH to a clone of "
                  "github.com/ScalingIntelligence/KernelBench, set $KERNELBENCH_DIR, clone it to ./KernelBench, or "
                  f"pass --hf-dataset {KERNELBENCH_ID} (needs `pip install datasets` and the hub)")


def _hub_reachable(timeout_s: float = 5.0) -> bool:
    """One TCP connect to the hub (HF_ENDPOINT) on a daemon thread, so a hanging DNS lookup costs timeout_s."""
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    ok = []

    def probe():
        try:
            socket.create_connection((host, 443), timeout_s).close()
            ok.append(True)
        except OSError:
            pass
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout_s + 1)
    return bool(ok)


def find_kernelbench(kernelbench_dir: str | None = None, hf_dataset: str | None = None) -> str:
    """The source load_kernelbench should read: kernelbench_dir, else hf_dataset, else $KERNELBENCH_DIR, else
    ./KernelBench; the hub only when named. Fails fast with one line naming the flag that fixes it:
    FileNotFoundError when nothing is there, RuntimeError when a hub id lacks `datasets` or the hub."""
    if kernelbench_dir:
        if not os.path.isdir(os.path.expanduser(kernelbench_dir)):
            raise FileNotFoundError(f"--kernelbench-dir: no such directory {kernelbench_dir}")
        return kernelbench_dir
    if hf_dataset:
        if os.path.exists(os.path.expanduser(hf_dataset)) or not _is_hub_id(hf_dataset):
            return hf_dataset
        if importlib.util.find_spec("datasets") is None:   # optional: only a hub id needs it
            raise RuntimeError(f"--hf-dataset {hf_dataset} needs `pip install datasets` (or pass "
                               "--kernelbench-dir PATH to a KernelBench clone)")
        if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "") and not _hub_reachable():
            raise RuntimeError(f"--hf-dataset {hf_dataset}: the hub is not reachable (HF_HUB_OFFLINE=1 reads the "
                               "local cache; or pass --kernelbench-dir PATH to a KernelBench clone)")
        return hf_dataset
    for path in (os.environ.get("KERNELBENCH_DIR"), "KernelBench"):
        if path and os.path.isdir(os.path.expanduser(path)):
            return path
    raise FileNotFoundError(NO_KERNELBENCH)


def load_kernelbench(source: str = KERNELBENCH_ID, levels: list[int] | None = None) -> list[Task]:
    """KernelBench problems of `levels` (None: every level the source has), sorted by (level, problem_id).

    source: a checkout (a folder holding KernelBench/level{N}/ or level{N}/), a .jsonl in the HF schema, a
    `save_to_disk` folder, or a hub id. FileNotFoundError if a checkout lacks a level; RuntimeError if the
    source needs `datasets` and it is not installed."""
    source = os.path.expanduser(source)
    base = _kernelbench_root(source) if os.path.isdir(source) else None
    if base is not None:
        found = sorted(int(d[5:]) for d in os.listdir(base) if re.fullmatch(r"level\d+", d))
        out = [t for lv in (levels or found) for t in _checkout_level(base, lv)]
    else:
        if os.path.isdir(source) and not os.path.exists(os.path.join(source, "dataset_dict.json")) \
                and not os.path.exists(os.path.join(source, "dataset_info.json")):
            raise FileNotFoundError(f"no KernelBench/level{{N}} (nor level{{N}}) under {source}")
        out = [t for lv in (levels or [1, 2, 3, 4]) for t in _hf_level(source, lv)]
    return sorted(out, key=lambda t: (t.level, t.problem_id))


# --------------------------------------------------------------------------------------------------
# Trajectories and demonstrations
# --------------------------------------------------------------------------------------------------


@dataclass
class Trajectory:
    task: str                                   # task name
    task_source: str                            # the pristine reference (what verdicts were computed on)
    messages: list[dict]                        # chat format; assistant messages may carry "token_ids"
    tools: list[dict] | None
    ids: list[int] = field(default_factory=list)        # env.tokenize_conversation(messages, tools, tok)[0]
    mask: list[int] = field(default_factory=list)       # 1 on policy-sampled tokens
    logprobs: list[float] = field(default_factory=list)  # sampler's log-prob at temperature 1 before top-p/top-k
    # on mask==1 tokens, 0.0 elsewhere
    turns: list[dict] = field(default_factory=list)     # per turn: finish_reason, n_context, calls[...]
    final_verdict: dict | None = None           # the sandbox's verdict on the workspace as left
    final_reward: float = -1.0                  # reward.from_verdict(final_verdict, kind)
    best_verdict: dict | None = None            # the best verdict seen during the episode
    best_reward: float = -1.0
    best_files: dict[str, str] = field(default_factory=dict)   # workspace snapshot at the best verdict
    invalid_calls: int = 0
    repeated_calls: int = 0
    stop_reason: str = ""                       # "finish" | "max_turns" | "context" | "single_turn"
    source: str = "policy"                      # who acted: "policy" | "demo" (a replayed demonstration)

    def to_json(self, **extra) -> str:
        return json.dumps({**dataclasses.asdict(self), **extra})

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        """Ignores keys that are not fields (rollout files add stage and step)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def save_trajectories(path: str, trajs: list[Trajectory], append: bool = False, **extra) -> None:
    """One JSON line per trajectory; `extra` keys (e.g. stage, step) are added to every line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for t in trajs:
            f.write(t.to_json(**extra) + "\n")


def load_trajectories(path: str) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]


def load_demos(demos_dir: str | None, tasks: list[Task], backend: str) -> list[tuple[Task, dict[str, str]]]:
    """[(task, {relative path: text})] for every task with a shipped demo at demos_dir/<task hash>/<backend>/."""
    out = []
    if not demos_dir or not os.path.isdir(demos_dir):
        return out
    for t in tasks:
        root = os.path.join(demos_dir, t.hash, backend)
        if not os.path.isdir(root):
            continue
        files = {}
        for d, _, names in os.walk(root):
            for n in sorted(names):
                with open(os.path.join(d, n)) as f:
                    files[os.path.relpath(os.path.join(d, n), root)] = f.read()
        out.append((t, files))
    return out
