"""The agent environment: a kernel workspace per episode, function-calling tools, batched episodes and
exact trajectory records (issue 3; paper §3.2).

What it does
  * The Policy interface (EpisodeState, Action, Policy) and the token format of a conversation,
    tokenize_conversation(messages, tools, tokenizer) -> (ids, mask): the ids are the concatenation of
    chat-template segments (mask 0) and each assistant turn's sampled ids (message["token_ids"], mask 1,
    end-of-turn token included). The policy builds its prompts with the same function, so a stored
    trajectory re-tokenises to exactly the ids the model saw and sampled. They live here, not in
    policy.py, because env.py never imports policy.py (policy.py re-exports them).
  * make_workspace: model.py (the reference, read-only), a model_new.py + kernels/ scaffold in the
    sandbox's workspace format (cpu: kernels/*.cpp with OpenMP; cuda: kernels/*.cu), INSTRUCTIONS.md.
    Verdicts always come from sandbox.check on the pristine task source held by the env, never from the
    workspace copy; the agent's shell cannot see the repo, the sandbox cache or other workspaces.
  * Tools (OpenAI function-calling schemas, TOOLS): bash, read_file, write_file, edit_file, glob, grep,
    compile, verify, profile, finish. Paths are confined to the workspace (no ../, no symlink escapes).
    Every tool failure is an observation string, never an exception.
  * run_episodes(policy, tasks, pool, cfg): all active episodes advance together, one policy.act per turn
    over the active set; each episode's tool calls then run on a thread pool (compiles and checks go to
    the SandboxPool), so episodes overlap their compiles. An episode stops on finish, the turn limit or
    the token budget; it keeps the best verdict seen with a snapshot of its files, then runs a final check.
  * Trajectory: messages (standard chat format), tools, token ids, policy mask, sampled log-probs, per-turn
    metadata, verdicts, rewards, invalid and repeated call counts. JSONL save/load round-trips exactly:
    tokenize_conversation(messages, tools, tok) on a reloaded record gives the same ids and mask.
  * SolveConfig + solve(cfg): one episode with a live transcript (`python cuda_agent.py solve`).

Departures from the paper
  1. Kernels are plain C++/CUDA with extern "C" launchers loaded through ctypes (the sandbox's format),
     not torch extensions with *_binding.cpp; the compile/verify/profile scripts are tools, not files.
  2. The agent's bash runs under bubblewrap (no network, read-only root, the repo/cache/other workspaces
     hidden, a time limit); the paper ran agents in containers.
  3. Tool calls of one turn run after the whole batch has acted (a per-turn barrier), so a slow episode
     delays the next generate call; continuous batching (issue 7) would remove the barrier.
  4. At the end of an episode the final workspace is checked once more (profiled); "final" reward is that
     check, "best" is the best verdict seen during the episode (the paper's evaluation counts the best).
  5. The rules are enforced by the sandbox's checks (no torch compute in forward, fresh inputs per trial),
     and `profile` can add an Nsight Compute summary (`ncu`) that the released harness does not have.

Smoke: python -m pytest -q tests/test_env.py
Full:  python cuda_agent.py solve TASK.py --policy openai --model NAME --endpoint URL --device cuda
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from typing import Protocol

REPO = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------------


@dataclass
class EpisodeState:
    episode_id: int                   # stable across the episode's turns (KV-cache key, issue 7)
    messages: list[dict]              # chat so far, OpenAI format; assistant messages may carry "token_ids"
    tools: list[dict] | None = None   # function-calling schemas ({"type": "function", "function": {...}})
    cache: dict | None = None         # the episode's scratch for incremental tokenize_conversation (opaque)


@dataclass
class Action:
    text: str                                  # raw assistant text, tool-call markup included
    content: str = ""                          # text with the well-formed tool-call blocks removed
    tool_calls: list[dict] = field(default_factory=list)   # OpenAI format, arguments as a JSON string
    errors: list[str] = field(default_factory=list)        # one line per malformed call
    token_ids: list[int] | None = None         # sampled ids, end-of-turn token included (local policies)
    logprobs: list[float] | None = None        # log-prob of each sampled id (same length)
    finish_reason: str = "stop"                # "stop" | "length"
    n_context: int | None = None               # prompt + completion tokens after this turn, if known

    def message(self) -> dict:
        """The assistant message to append to the conversation (standard chat format + token_ids)."""
        m = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.token_ids is not None:
            m["token_ids"] = list(self.token_ids)
        return m


class Policy(Protocol):
    """One method. (A policy may also have `release(episode_id)`; run_episodes calls it when an episode
    ends, so a policy holding per-episode state, such as a KV cache, can free it.)"""
    def act(self, states: list[EpisodeState]) -> list[Action]: ...


# --------------------------------------------------------------------------------------------------
# Exact tokenisation of a conversation (render deltas)
# --------------------------------------------------------------------------------------------------


def end_of_turn(tokenizer) -> str:
    """The token that ends an assistant turn: ChatML's <|im_end|> if the vocabulary has it, else EOS."""
    return "<|im_end|>" if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token


def _for_template(m: dict) -> dict:
    """A copy of a message as chat templates expect it: no token_ids, tool arguments as dicts."""
    m = {k: v for k, v in m.items() if k not in ("token_ids", "logprobs")}
    if m.get("tool_calls"):
        m["tool_calls"] = copy.deepcopy(m["tool_calls"])
        for tc in m["tool_calls"]:
            f = tc.get("function", tc)
            if isinstance(f.get("arguments"), str):
                try:
                    f["arguments"] = json.loads(f["arguments"])
                except json.JSONDecodeError:
                    pass
    if m.get("content") is None:
        m["content"] = ""
    return m


def render(messages: list[dict], tools: list[dict] | None, tokenizer, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template([_for_template(m) for m in messages], tools=tools or None,
                                         tokenize=False, add_generation_prompt=add_generation_prompt)


def _after_nth(text: str, sub: str, n: int) -> int:
    """Index just after the n-th occurrence of sub in text (0 when n == 0)."""
    pos = 0
    for _ in range(n):
        k = text.find(sub, pos)
        assert k >= 0, f"chat template rendered fewer than {n} {sub!r} markers"
        pos = k + len(sub)
    return pos


def tokenize_conversation(messages: list[dict], tools: list[dict] | None, tokenizer,
                          add_generation_prompt: bool = False, cache: dict | None = None
                          ) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation; mask is 1 exactly on tokens the policy sampled.

    Segments: the template text before each assistant turn (mask 0), then the turn's sampled ids
    (message["token_ids"], mask 1) or, for messages without ids (scripted or API policies), the
    template's rendering of the turn up to and including the end-of-turn token (mask 1). Text between
    turns is located by counting end-of-turn markers, so templates that re-render earlier assistant
    turns differently (e.g. Qwen3 dropping empty <think> blocks) still give consistent segments.

    cache: an episode's scratch dict (EpisodeState.cache). It remembers the ids up to the last assistant
    turn, so each call renders only the new turns (a from-scratch call renders once per assistant turn,
    which is quadratic in turns). It is used only if its messages are still a prefix of `messages`.
    """
    eot = end_of_turn(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False) if s else []  # noqa: E731
    ids, mask, n_eot, start = [], [], 0, 0   # n_eot: end-of-turn markers already covered by ids
    if cache and cache.get("tok") == id(tokenizer) and cache.get("tools") == tools \
            and messages[:len(cache["prefix"])] == cache["prefix"]:
        ids, mask, n_eot, start = list(cache["ids"]), list(cache["mask"]), cache["n_eot"], len(cache["prefix"])
    for i in range(start, len(messages)):
        m = messages[i]
        if m["role"] != "assistant":
            continue
        r = render(messages[:i], tools, tokenizer, True)
        seg = enc(r[_after_nth(r, eot, n_eot):])
        ids += seg
        mask += [0] * len(seg)
        if m.get("token_ids") is not None:
            a = list(m["token_ids"])
        else:
            full = render(messages[:i + 1], tools, tokenizer, False)
            assert full.startswith(r), "chat template: the generation prompt is not a prefix of the turn"
            k = full.find(eot, len(r))
            assert k >= 0, f"chat template did not end the assistant turn with {eot!r}"
            a = enc(full[len(r):k + len(eot)])
        ids += a
        mask += [1] * len(a)
        if not a or a[-1] != eot_id:      # cut by the token limit: close the turn, not trained on
            ids.append(eot_id)
            mask.append(0)
        n_eot = r.count(eot) + 1
        if cache is not None:
            cache.update(tok=id(tokenizer), tools=tools, prefix=messages[:i + 1], ids=list(ids), mask=list(mask),
                         n_eot=n_eot)
    if messages and (messages[-1]["role"] != "assistant" or add_generation_prompt):
        r = render(messages, tools, tokenizer, add_generation_prompt)
        seg = enc(r[_after_nth(r, eot, n_eot):])
        ids += seg
        mask += [0] * len(seg)
    return ids, mask




def _fn(name: str, desc: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


_S = {"type": "string"}
TOOLS = [
    _fn("bash", "Run a shell command in the workspace (no network, time-limited, output truncated).",
        {"command": {**_S, "description": "the command"}, "timeout": {"type": "integer", "description": "seconds"}},
        ["command"]),
    _fn("read_file", "Read a text file of the workspace.",
        {"path": _S, "offset": {"type": "integer", "description": "first line (1-based)"},
         "limit": {"type": "integer", "description": "number of lines"}}, ["path"]),
    _fn("write_file", "Create or overwrite a file in the workspace.", {"path": _S, "content": _S},
        ["path", "content"]),
    _fn("edit_file", "Replace one exact occurrence of old_str with new_str in a file.",
        {"path": _S, "old_str": _S, "new_str": _S}, ["path", "old_str", "new_str"]),
    _fn("glob", "List workspace files matching a glob pattern, e.g. kernels/*.cu.", {"pattern": _S}, ["pattern"]),
    _fn("grep", "Search workspace files for a regular expression.",
        {"pattern": _S, "glob": {**_S, "description": "only files matching this glob"}}, ["pattern"]),
    _fn("compile", "Compile every kernel in kernels/ and report errors.", {}, []),
    _fn("verify", "Check ModelNew against Model on fresh random inputs (correctness only).", {}, []),
    _fn("profile", "Verify, then time eager PyTorch, torch.compile and ModelNew; reports the reward.", {}, []),
    _fn("finish", "End the episode; the workspace as it is now is the final answer.",
        {"summary": {**_S, "description": "optional note"}}, []),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]

INSTRUCTIONS = """# Task: write a faster ModelNew

`model.py` (read-only) defines `Model`, `get_inputs()` and `get_init_inputs()`. Write `ModelNew` in
`model_new.py`: same constructor arguments as `Model`, same outputs, computed by your own kernels in
`kernels/`.

## Rules
- In `ModelNew.forward`, torch may only allocate tensors (`torch.empty`, `empty_like`, ...) and make views
  (`view`, `reshape`, `transpose`, `contiguous`, ...). All arithmetic happens in your kernels. Calls into
  `torch.nn.functional`, torch math ops, or the reference `Model` are rejected.
- {kernel_rule}
- Kernels are plain {lang} files `kernels/NAME.{ext}` with `extern "C"` functions and no torch headers.
  Each compiles on its own into NAME.so; load it in `model_new.py` with
  `from sandbox_worker import load_kernel, ptr, stream`, then `lib = load_kernel("NAME")` (a ctypes
  library), pass tensors as `ptr(t)` and the stream as `stream()`.
- Parameters: create them in `__init__` the way `Model` does, so the state_dict matches.

## Goal
Outputs must match `Model` within atol = rtol = {tol} on fresh random inputs, and ModelNew should run
more than 5% faster than both eager PyTorch and `torch.compile`. Reward: -1 wrong, 1 correct, 2 faster
than eager, 3 faster than eager and torch.compile.

## Tools
bash, read_file, write_file, edit_file, glob, grep: work on files inside this workspace only.
compile: build kernels/. verify: correctness only. profile: correctness + timings + the reward it would
earn. finish: stop; the best verified version and the final one are both kept.
"""

SCAFFOLD_PY = '''import ctypes

import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("{name}")   # kernels/{name}.{ext}, compiled by the harness
# lib.my_op.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]


class ModelNew(nn.Module):
    def __init__(self, *args):   # TODO: the same arguments as Model.__init__
        super().__init__()

    def forward(self, *inputs):
        raise NotImplementedError("TODO: allocate outputs and call your kernels")
'''
SCAFFOLD_KERNEL = {
    "cpp": '// Plain C++ with OpenMP (g++ -O3 -fopenmp). Export launchers with extern "C"; no torch headers.\n'
           '#include <cstdint>\n\nextern "C" void my_op(const float* x, float* y, long n, void* stream) {\n'
           '    // TODO\n}\n',
    "cu": '// Plain CUDA C++ (nvcc -O3). Export launchers with extern "C"; no torch headers. cuBLAS is linked.\n'
          '#include <cuda_runtime.h>\n\n__global__ void my_op_kernel(const float* x, float* y, long n) {\n'
          '    // TODO\n}\n\nextern "C" void my_op(const float* x, float* y, long n, void* stream) {\n'
          '    // TODO: launch on (cudaStream_t)stream\n}\n'}


# --------------------------------------------------------------------------------------------------
# Configs and records
# --------------------------------------------------------------------------------------------------


@dataclass
class EnvConfig:
    max_turns: int = 150
    """turn limit (paper: 150 in training, 200 in evaluation)"""
    max_context_tokens: int = 131072
    """stop when the conversation reaches this many tokens (paper: 128k agentic)"""
    single_turn: bool = False
    """no tools: one response holding model_new.py and kernels in fenced blocks (the warm-up stage)"""
    device: str = "cpu"
    """kernel backend and where candidates run: "cpu" (kernels/*.cpp) | "cuda" (kernels/*.cu)"""
    work_dir: str = "runs/workspaces"
    """parent directory of the per-episode workspaces"""
    bash_timeout_s: float = 60.0
    """default and maximum time limit of one bash call, seconds"""
    max_obs_chars: int = 6000
    """observations longer than this are cut (head and tail kept)"""
    tool_workers: int = 16
    """threads running episodes' tool calls concurrently"""
    final_check: bool = True
    """profile the final workspace at the end of each episode"""
    ncu: bool = True
    """profile adds a short Nsight Compute kernel summary when device is cuda and `ncu` is on PATH"""
    sandbox: sandbox.SandboxConfig | None = None
    """sandbox settings for verify/profile; None: the pool's own config"""


@dataclass
class Trajectory:
    task: str                                   # task name
    task_source: str                            # the pristine reference (what verdicts were computed on)
    messages: list[dict]                        # chat format; assistant messages may carry "token_ids"
    tools: list[dict] | None
    ids: list[int] = field(default_factory=list)        # tokenize_conversation(messages, tools, tok)[0]
    mask: list[int] = field(default_factory=list)       # 1 on policy-sampled tokens
    logprobs: list[float] = field(default_factory=list)  # sampled log-prob on mask==1 tokens, 0.0 elsewhere
    turns: list[dict] = field(default_factory=list)     # per turn: finish_reason, n_context, calls[...]
    final_verdict: dict | None = None
    final_reward: float = -1.0
    best_verdict: dict | None = None
    best_reward: float = -1.0
    best_files: dict[str, str] = field(default_factory=dict)   # workspace snapshot at the best verdict
    invalid_calls: int = 0
    repeated_calls: int = 0
    stop_reason: str = ""                       # "finish" | "max_turns" | "context" | "single_turn"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str) -> "Trajectory":
        return cls(**json.loads(line))


def save_trajectories(path: str, trajs: list[Trajectory], append: bool = False) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for t in trajs:
            f.write(t.to_json() + "\n")


def load_trajectories(path: str) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_json(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------------------
# Workspace and path confinement
# --------------------------------------------------------------------------------------------------


def task_name(src: str) -> str:
    return "task_" + hashlib.sha1(src.encode()).hexdigest()[:10]


def make_workspace(ws: str, task_src: str, device: str, kernel: str = "kernel", tol: float = 1e-2) -> str:
    """Fresh workspace directory in the sandbox format (contract: 'Solution formats (b)')."""
    ext = "cu" if device == "cuda" else "cpp"
    if os.path.exists(ws):
        _make_writable(ws)
        shutil.rmtree(ws)
    os.makedirs(os.path.join(ws, "kernels"))
    with open(os.path.join(ws, "model.py"), "w") as f:
        f.write(task_src)
    os.chmod(os.path.join(ws, "model.py"), 0o444)
    with open(os.path.join(ws, "model_new.py"), "w") as f:
        f.write(SCAFFOLD_PY.format(name=kernel, ext=ext))
    with open(os.path.join(ws, "kernels", f"{kernel}.{ext}"), "w") as f:
        f.write(SCAFFOLD_KERNEL[ext])
    rule = ("cuBLAS (GEMM) and cuDNN (convolution) may be called from your .cu files." if ext == "cu" else
            "This is the CPU backend: use C++ with OpenMP (`#pragma omp parallel for`); BLAS is not linked.")
    with open(os.path.join(ws, "INSTRUCTIONS.md"), "w") as f:
        f.write(INSTRUCTIONS.replace("{kernel_rule}", rule).replace("{lang}", "CUDA C++" if ext == "cu" else "C++")
                .replace("{ext}", ext).replace("{tol}", f"{tol:g}"))
    return ws


def _make_writable(ws: str) -> None:
    for root, dirs, files in os.walk(ws):
        for n in dirs + files:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)


def confine(ws: str, path: str) -> str:
    """Absolute path of `path` inside ws; ValueError if it leaves the workspace (.., absolute, symlinks)."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError("path must be a non-empty string")
    root = os.path.realpath(ws)
    full = os.path.realpath(os.path.join(root, path))
    if full != root and not full.startswith(root + os.sep):
        raise ValueError(f"path {path!r} is outside the workspace")
    return full


SNAPSHOT_SKIP = (".so", ".o", ".pyc", ".a")


def snapshot(ws: str) -> dict[str, str]:
    """The agent's text files (not model.py / INSTRUCTIONS.md / build products), relative path -> text."""
    out = {}
    for root, dirs, files in os.walk(ws):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for n in sorted(files):
            p = os.path.join(root, n)
            rel = os.path.relpath(p, ws)
            if rel in ("model.py", "INSTRUCTIONS.md") or n.endswith(SNAPSHOT_SKIP) or os.path.islink(p):
                continue
            if os.path.getsize(p) <= 1_000_000:
                with open(p, errors="replace") as f:
                    out[rel] = f.read()
    return out


def _digest(files: dict[str, str]) -> str:
    return hashlib.sha1(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_files(ws: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = confine(ws, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)


def truncate(s: str, n: int) -> str:
    if len(s) <= n:
        return s
    return s[: n // 2] + f"\n... [{len(s) - n} characters cut] ...\n" + s[-n // 2:]


def bwrap_argv(ws: str, hide: list[str], device: str) -> list[str]:
    """bubblewrap: read-only root, writable workspace, no network, fresh /tmp, hidden harness paths."""
    ws = os.path.realpath(ws)
    argv = ["bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--tmpfs", "/tmp", "--unshare-net",
            "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session"]
    argv += ["--dev-bind", "/dev", "/dev"] if device == "cuda" else ["--dev", "/dev"]
    hidden = [os.path.realpath(os.path.expanduser(h)) for h in hide]
    for h in hidden:        # the repo (harness), the sandbox cache, other workspaces
        if os.path.isdir(h):
            argv += ["--tmpfs", h]
    for p in {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}:   # a venv inside the repo
        if any((p + os.sep).startswith(h + os.sep) for h in hidden):
            argv += ["--ro-bind", p, p]
    worker = os.path.join(REPO, "sandbox_worker.py")   # the runtime helpers model_new.py imports
    argv += ["--ro-bind", worker, "/tmp/.harness/sandbox_worker.py"] if os.path.exists(worker) else []
    argv += ["--bind", ws, ws, "--ro-bind", os.path.join(ws, "model.py"), os.path.join(ws, "model.py"),
             "--setenv", "PYTHONPATH", "/tmp/.harness", "--chdir", ws,   # `python` = the harness's interpreter
             "--setenv", "PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")]
    return argv


def run_bash(ws: str, command: str, timeout_s: float, hide: list[str], device: str, max_chars: int) -> str:
    argv = bwrap_argv(ws, hide, device) + ["bash", "-c", command]
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        status = f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # the whole process group we started
        out, _ = proc.communicate()
        status = f"killed after {timeout_s:g} s time limit"
    text = out.decode(errors="replace")
    return truncate(text, max_chars) + f"\n[{status}, {time.time() - t0:.1f} s]"


NCU_DRIVER = """import torch
import model
import model_new
torch.manual_seed(0)
xs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in model.get_inputs()]
m = model_new.ModelNew(*model.get_init_inputs()).cuda()
with torch.no_grad():
    m(*xs)
torch.cuda.synchronize()
"""


# --------------------------------------------------------------------------------------------------
# Verdict summaries (what the agent reads)
# --------------------------------------------------------------------------------------------------


def _ms(x) -> str:
    return f"{x:.4g} ms" if isinstance(x, (int, float)) else "n/a"


def verify_text(v: dict) -> str:
    if not v.get("compiled"):
        return f"COMPILE FAILED ({v.get('error') or ''})\n{v.get('compile_log', '')}".strip()
    head = []
    if v.get("violation"):
        head.append(f"RULE VIOLATION: {v['violation']}")
    if v.get("error"):
        head.append(f"ERROR ({v.get('stage')}): {v['error']}")
    trials = v.get("trials") or []
    ok = sum(1 for t in trials if t.get("ok"))
    head.append(f"correct: {bool(v.get('correct'))} ({ok}/{len(trials)} trials passed, precision {v.get('precision')})")
    for t in trials:
        if not t.get("ok"):
            head.append(f"  trial seed={t.get('seed')}: max_abs_err={t.get('max_abs_err')} max_rel_err="
                        f"{t.get('max_rel_err')} first_bad_index={t.get('first_bad_index')} {t.get('reason') or ''}")
    return "\n".join(head)


def profile_text(v: dict) -> str:
    s = verify_text(v)
    if v.get("correct") and v.get("candidate_ms") is not None:
        s += (f"\ndevice {v.get('device')}: eager {_ms(v.get('eager_ms'))} | torch.compile "
              f"{_ms(v.get('compile_ms'))} | ModelNew {_ms(v.get('candidate_ms'))}"
              f"\nspeedup vs eager {v.get('speedup_eager') or 0:.3g}x, vs torch.compile "
              f"{v.get('speedup_compile') or 0:.3g}x")
    return s + f"\nreward this version would earn: {v.get('reward')}"


# --------------------------------------------------------------------------------------------------
# Single-turn mode: parse a whole solution out of one response
# --------------------------------------------------------------------------------------------------

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.S)
_FILE_RE = re.compile(r"^(?:#|//)\s*file:\s*(\S+)\s*$")
_SOL_EXT = (".py", ".cu", ".cpp", ".cuh", ".h", ".hpp")

SINGLE_TURN_FORMAT = """Answer with the complete solution in one response, one fenced code block per file, the file name
in the fence's info string:
```python model_new.py
...
```
```{ext} kernels/NAME.{ext}
...
```"""


def parse_solution_blocks(text: str) -> tuple[dict[str, str], list[str]]:
    """{relative path: source} from fenced blocks named in the info string or a first-line `# file:` comment."""
    files, errors = {}, []
    for info, body in _FENCE.findall(text):
        name = next((w for w in info.split() if w.endswith(_SOL_EXT)), None)
        first = body.split("\n", 1)[0].strip()
        if name is None and _FILE_RE.match(first):
            name = _FILE_RE.match(first).group(1)
        if name is None:
            continue
        if name.startswith("/") or ".." in name.split("/") or name in ("model.py", "INSTRUCTIONS.md"):
            errors.append(f"refused file name {name!r}")
            continue
        files[name] = body
    if "model_new.py" not in files:
        errors.append("no ```python model_new.py``` block in the response")
    return files, errors


# --------------------------------------------------------------------------------------------------
# One episode
# --------------------------------------------------------------------------------------------------

SYSTEM = ("You are an expert GPU/CPU performance engineer. You work in a kernel workspace through tools, "
          "one or more tool calls per turn. Read INSTRUCTIONS.md and model.py, write kernels and ModelNew, then "
          "compile, verify and profile; iterate until it is correct and fast, then call finish.")
SYSTEM_SINGLE = ("You are an expert GPU/CPU performance engineer. Answer with a complete, correct and fast "
                 "solution in one response; nothing is compiled or run until you have answered.")


def _check_args(schema: dict, args) -> str | None:
    """None if args fit the schema (required keys, string/integer types), else the reason."""
    if not isinstance(args, dict):
        return "arguments must be a JSON object"
    params = schema["function"]["parameters"]
    for k in params["required"]:
        if k not in args:
            return f"missing required argument {k!r}"
    for k, v in args.items():
        typ = params["properties"].get(k, {}).get("type")
        if typ == "string" and not isinstance(v, str):
            return f"argument {k!r} must be a string"
        if typ == "integer" and (isinstance(v, bool) or not isinstance(v, int)):
            return f"argument {k!r} must be an integer"
    return None


class Episode:
    """One task's workspace, conversation and bookkeeping. step() applies one Action."""

    def __init__(self, eid: int, task: str | dict, cfg: EnvConfig, pool, sb_cfg, log=None):
        self.id, self.cfg, self.pool, self.sb, self.log = eid, cfg, pool, sb_cfg, log or (lambda *a: None)
        src = task if isinstance(task, str) else (task.get("source") or task.get("code"))
        if isinstance(task, str) and task.endswith(".py") and "\n" not in task and os.path.exists(task):
            src = open(task).read()
        assert src and "class Model" in src, f"task {eid} has no source with class Model"
        self.src = src
        self.name = (task.get("name") or task.get("task_id") or task.get("hash")) if isinstance(task, dict) else None
        self.name = str(self.name or task_name(src))
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.name)[:60]
        self.ws = make_workspace(os.path.abspath(os.path.join(cfg.work_dir, f"ep{eid:05d}_{safe}")), src,
                                 cfg.device, tol=max(sb_cfg.atol, sb_cfg.rtol))
        self.hide = [REPO, os.path.expanduser(sb_cfg.cache_dir), os.path.abspath(cfg.work_dir)]
        self.tools = None if cfg.single_turn else copy.deepcopy(TOOLS)
        ext = "cu" if cfg.device == "cuda" else "cpp"
        intro = open(os.path.join(self.ws, "INSTRUCTIONS.md")).read()
        if cfg.single_turn:      # no tools: drop their section, ask for the whole answer in fenced blocks
            intro = intro.split("## Tools")[0] + SINGLE_TURN_FORMAT.replace("{ext}", ext) + "\n"
        user = f"{intro}\n## model.py\n```python\n{src}\n```\n"
        self.messages = [{"role": "system", "content": SYSTEM_SINGLE if cfg.single_turn else SYSTEM},
                         {"role": "user", "content": user}]
        self.turns, self.turn_logprobs, self.seen = [], [], set()
        self.cache: dict[tuple[str, bool], dict] = {}   # (files digest, profiled) -> verdict dict
        self.best_verdict, self.best_reward, self.best_files = None, -1.0, {}
        self.final_verdict, self.final_reward = None, -1.0
        self.invalid_calls = self.repeated_calls = 0
        self.n_context, self.done, self.stop_reason = 0, False, ""
        self.tok_cache: dict = {}     # shared with the policy through EpisodeState.cache

    def state(self) -> EpisodeState:
        return EpisodeState(self.id, self.messages, self.tools, self.tok_cache)

    # ---- verdicts ------------------------------------------------------------------------------
    def check(self, profile: bool) -> dict:
        files = snapshot(self.ws)
        key = _digest(files)
        if (key, True) in self.cache or (key, profile) in self.cache:
            return self.cache.get((key, True)) or self.cache[(key, profile)]
        cfg = dataclasses.replace(self.sb, profile=profile)
        v = self.pool.submit(self.src, self.ws, cfg).result().to_dict()   # pristine task source, never ws/model.py
        self.cache[(key, profile)] = v
        # best = highest reward, then fastest (a timed verdict beats an untimed one of the same tier)
        old_ms = (self.best_verdict or {}).get("candidate_ms")
        faster = v.get("candidate_ms") is not None and (old_ms is None or v["candidate_ms"] < old_ms)
        better = v["reward"] > self.best_reward or (v["reward"] == self.best_reward and faster)
        if better or self.best_verdict is None:
            self.best_verdict, self.best_reward, self.best_files = v, float(v["reward"]), files
        return v

    # ---- tools -----------------------------------------------------------------------------------
    def call(self, name: str, args: dict) -> tuple[str, dict | None]:
        """Run one tool. Returns (observation, verdict or None). Tool errors come back as text."""
        ws, cfg = self.ws, self.cfg
        if name == "bash":
            t = min(float(args.get("timeout") or cfg.bash_timeout_s), cfg.bash_timeout_s)
            return run_bash(ws, args["command"], t, self.hide, cfg.device, cfg.max_obs_chars), None
        if name == "read_file":
            p = confine(ws, args["path"])
            if not os.path.isfile(p):
                return f"error: no such file: {args['path']}", None
            with open(p, errors="replace") as f:
                lines = f.read().splitlines(keepends=True)
            off = max(1, int(args.get("offset") or 1))
            lim = int(args.get("limit") or len(lines))
            return truncate("".join(lines[off - 1:off - 1 + lim]), cfg.max_obs_chars) or "(empty file)", None
        if name in ("write_file", "edit_file"):
            p = confine(ws, args["path"])
            if p == os.path.realpath(os.path.join(ws, "model.py")):
                return "error: model.py is read-only (it is the reference); write model_new.py", None
            if name == "write_file":
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, "w") as f:
                    f.write(args["content"])
                return f"wrote {len(args['content'])} characters to {args['path']}", None
            if not os.path.isfile(p):
                return f"error: no such file: {args['path']}", None
            text = open(p).read()
            n = text.count(args["old_str"]) if args["old_str"] else 0
            if n != 1:
                why = "old_str is empty" if not args["old_str"] else (
                    "old_str not found" if n == 0 else f"old_str is not unique ({n} occurrences); add context")
                return f"error: {why} in {args['path']}", None
            with open(p, "w") as f:
                f.write(text.replace(args["old_str"], args["new_str"], 1))
            return f"edited {args['path']}", None
        if name == "glob":
            return self._glob(args["pattern"]), None
        if name == "grep":
            return self._grep(args["pattern"], args.get("glob")), None
        if name == "compile":
            ok, log, libs = self.pool.compile(ws).result()
            head = f"compiled OK: {', '.join(sorted(libs)) or '(no kernels)'}" if ok else "compile FAILED"
            return truncate(head + ("\n" + log.strip() if log.strip() else ""), cfg.max_obs_chars), None
        if name in ("verify", "profile"):
            v = self.check(profile=name == "profile")
            txt = profile_text(v) if name == "profile" else verify_text(v)
            if name == "profile" and v.get("correct") and cfg.ncu and cfg.device == "cuda" and shutil.which("ncu"):
                txt += "\n" + self._ncu_summary()
            return truncate(txt, cfg.max_obs_chars), v
        assert name == "finish", name
        self.done, self.stop_reason = True, "finish"
        return "episode finished", None

    def _ncu_summary(self) -> str:
        """One forward of ModelNew under `ncu --print-summary per-kernel`, isolated like bash."""
        ok, log, libs = self.pool.compile(self.ws).result()
        if not ok:
            return "ncu: kernels do not compile"
        d = os.path.join(self.ws, ".ncu")        # dot-dir: not part of snapshots
        os.makedirs(d, exist_ok=True)
        local = {}
        for n, so in libs.items():
            local[n] = shutil.copy(so, os.path.join(d, f"{n}.so"))
        with open(os.path.join(d, "run.py"), "w") as f:
            f.write(NCU_DRIVER)
        # PYTHONPATH=.: `python .ncu/run.py` puts .ncu/, not the workspace, first on sys.path (seen on the H200)
        cmd = (f"HOME=$PWD/.ncu PYTHONPATH=.:${{PYTHONPATH:-}} CUDA_AGENT_KERNELS='{json.dumps(local)}' "
               f"ncu --print-summary per-kernel --launch-count 50 "
               f"python .ncu/run.py 2>&1 | grep -v '^==PROF==' | tail -n 60")
        out = run_bash(self.ws, cmd, 180, self.hide, "cuda", 2500)
        return "ncu kernel summary (one forward):\n" + out

    def _files(self):
        for root, dirs, files in os.walk(self.ws):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for n in sorted(files):
                yield os.path.relpath(os.path.join(root, n), self.ws)

    def _glob(self, pattern: str) -> str:
        if pattern.startswith("/") or ".." in pattern.split("/"):
            return "error: patterns are relative to the workspace (no / or ..)"
        hits = [r for r in self._files() if fnmatch.fnmatch(r, pattern)
                or fnmatch.fnmatch(r, pattern.replace("**/", ""))]
        return "\n".join(hits) or "(no matches)"

    def _grep(self, pattern: str, glob_: str | None) -> str:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            return f"error: bad regular expression: {e}"
        out = []
        for rel in self._files():
            if (glob_ and not fnmatch.fnmatch(rel, glob_)) or rel.endswith(SNAPSHOT_SKIP):
                continue
            with open(os.path.join(self.ws, rel), errors="replace") as f:
                out += [f"{rel}:{i}: {line.rstrip()}" for i, line in enumerate(f, 1) if rx.search(line)]
            if len(out) > 200:
                break
        return truncate("\n".join(out[:200]), self.cfg.max_obs_chars) or "(no matches)"

    # ---- one turn --------------------------------------------------------------------------------
    def step(self, a: Action) -> None:
        """Append the assistant turn and its observations; update counters and the stop condition."""
        self.messages.append(a.message())
        first_obs = len(self.messages)
        self.turn_logprobs.append(a.logprobs)
        self.log(self.id, "assistant", a.text)
        meta = {"turn": len(self.turns), "finish_reason": a.finish_reason, "n_context": a.n_context,
                "calls": [], "errors": list(a.errors)}
        self.turns.append(meta)
        if self.cfg.single_turn:
            return self._single_turn(a)
        self.invalid_calls += len(a.errors)
        for tc in a.tool_calls:
            if self.done:
                break                              # nothing runs after finish
            obs, rec = self._run_call(tc)
            meta["calls"].append(rec)
            self.messages.append({"role": "tool", "tool_call_id": tc["id"], "name": rec["name"], "content": obs})
            self.log(self.id, "tool", f"{rec['name']}({rec['args_text'][:200]}) -> {obs}")
        notes = list(a.errors)
        if not a.tool_calls and not a.errors:
            notes.append("no tool call found: call a tool (write_file, compile, verify, profile, ...) or finish")
        if a.finish_reason == "length":
            notes.append("your turn was cut at the token limit")
        if notes and not self.done:
            self.messages.append({"role": "user", "content": "\n".join(f"[error] {n}" for n in notes)})
            self.log(self.id, "error", "; ".join(notes))
        # token budget: what the policy reported, plus a rough count of the new observations (~3.5 chars/token)
        obs_chars = sum(len(m.get("content") or "") for m in self.messages[first_obs:])
        self.n_context = max(self.n_context, a.n_context or 0) + int(obs_chars / 3.5)
        if not self.done and len(self.turns) >= self.cfg.max_turns:
            self.done, self.stop_reason = True, "max_turns"
        if not self.done and self.n_context >= self.cfg.max_context_tokens:
            self.done, self.stop_reason = True, "context"

    def _run_call(self, tc: dict) -> tuple[str, dict]:
        f = tc.get("function", {})
        name, args_text = f.get("name", ""), f.get("arguments", "{}")
        rec = {"name": name, "args_text": args_text, "duration_s": 0.0, "verdict": None, "error": None}
        try:
            args = json.loads(args_text) if isinstance(args_text, str) else args_text
        except json.JSONDecodeError as e:
            args, rec["error"] = None, f"arguments are not valid JSON: {e}"
        key = (name, json.dumps(args, sort_keys=True) if args is not None else args_text)
        self.repeated_calls += key in self.seen       # RFT drops loops (paper §3.3 stage 2)
        self.seen.add(key)
        if rec["error"] is None and name not in TOOL_NAMES:
            rec["error"] = f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)}"
        if rec["error"] is None:
            rec["error"] = _check_args(TOOLS[TOOL_NAMES.index(name)], args)
        if rec["error"] is not None:
            self.invalid_calls += 1
            return f"error: {rec['error']}", rec
        t0 = time.time()
        try:
            obs, rec["verdict"] = self.call(name, args)
        except ValueError as e:        # confinement and bad argument values
            obs = f"error: {e}"
        except Exception as e:         # a tool must never take the episode down
            obs = f"error: internal tool failure: {type(e).__name__}: {str(e)[:300]}"
        rec["duration_s"] = round(time.time() - t0, 3)
        return obs, rec

    def _single_turn(self, a: Action) -> None:
        files, errors = parse_solution_blocks(a.content if a.tool_calls else a.text)
        self.invalid_calls += len(errors) if "model_new.py" not in files else 0
        write_files(self.ws, files)
        self.turns[-1]["errors"] += errors
        self.done, self.stop_reason = True, "single_turn"

    def close(self) -> None:
        """Final check of the workspace as left (profiled, cached if unchanged)."""
        if self.cfg.final_check or self.cfg.single_turn:
            try:
                self.final_verdict = self.check(profile=self.sb.profile)
                self.final_reward = float(self.final_verdict["reward"])
            except Exception as e:   # the sandbox promises verdicts; keep the episode even if it breaks
                self.final_verdict = {"error": f"final check failed: {type(e).__name__}: {e}", "reward": -1.0}
            self.log(self.id, "verdict", profile_text(self.final_verdict) if "compiled" in self.final_verdict
                     else self.final_verdict["error"])

    def trajectory(self, tokenizer=None) -> Trajectory:
        t = Trajectory(task=self.name, task_source=self.src, messages=self.messages, tools=self.tools,
                       turns=self.turns, final_verdict=self.final_verdict, final_reward=self.final_reward,
                       best_verdict=self.best_verdict, best_reward=self.best_reward, best_files=self.best_files,
                       invalid_calls=self.invalid_calls, repeated_calls=self.repeated_calls,
                       stop_reason=self.stop_reason)
        if tokenizer is not None:
            t.ids, t.mask = tokenize_conversation(self.messages, self.tools, tokenizer, cache=self.tok_cache)
            t.logprobs = flat_logprobs(t.mask, self.turn_logprobs)
        return t


def flat_logprobs(mask: list[int], per_turn: list[list[float] | None]) -> list[float]:
    """Spread per-turn sampled log-probs over the flat ids: the k-th run of mask==1 is the k-th turn."""
    out, k, i = [0.0] * len(mask), 0, 0
    while i < len(mask):
        if mask[i] == 0:
            i += 1
            continue
        j = i
        while j < len(mask) and mask[j] == 1:
            j += 1
        assert k < len(per_turn), "more policy segments than assistant turns"
        lp = per_turn[k]
        if lp is not None:
            assert len(lp) == j - i, f"turn {k}: {len(lp)} log-probs for {j - i} policy tokens"
            out[i:j] = lp
        k, i = k + 1, j
    return out


def _advance(e: Episode, a: Action) -> None:
    e.step(a)
    if e.done:
        e.close()      # the final check starts now, overlapping the other episodes' turns


def run_episodes(policy: Policy, tasks: list, pool, cfg: EnvConfig, tokenizer=None, log=None,
                 id_offset: int = 0) -> list[Trajectory]:
    """Run one episode per task; all active episodes act together, their tools run concurrently.

    tasks: task sources, paths to task .py files, or dicts with "source" (or "code") and "name".
    tokenizer: for ids/mask/logprobs in the records (default: policy.tok if the policy has one).
    """
    import sandbox
    sb = cfg.sandbox or getattr(pool, "cfg", None) or sandbox.SandboxConfig(device=cfg.device)
    tok = tokenizer if tokenizer is not None else getattr(policy, "tok", None)
    eps = [Episode(id_offset + i, t, cfg, pool, sb, log) for i, t in enumerate(tasks)]
    with concurrent.futures.ThreadPoolExecutor(max(1, cfg.tool_workers)) as ex:
        active = list(eps)
        while active:
            actions = policy.act([e.state() for e in active])     # one batched generate per turn
            assert len(actions) == len(active), f"policy returned {len(actions)} actions for {len(active)} episodes"
            list(ex.map(_advance, active, actions))         # tools (and final checks) run concurrently
            for e in active:
                if e.done and hasattr(policy, "release"):
                    policy.release(e.id)                    # optional: free the episode's KV cache
            active = [e for e in active if not e.done]
    return [e.trajectory(tok) for e in eps]


# --------------------------------------------------------------------------------------------------
# solve: one episode from the command line, with a live transcript
# --------------------------------------------------------------------------------------------------


@dataclass
class SolveConfig:
    task: str = ""
    """path to a task .py (KernelBench format: Model, get_inputs, get_init_inputs)"""
    policy: str = "replay"
    """who acts: "replay" (scripted) | "hf" (local transformers model) | "openai" (chat endpoint)"""
    model: str | None = None
    """hf: checkpoint path, or "tiny" for a random tiny MoE; openai: the served model name"""
    adapter: str | None = None
    """hf: optional peft adapter directory"""
    endpoint: str = "http://127.0.0.1:8000/v1"
    """openai: base URL of an OpenAI-compatible server (vLLM, SGLang, hosted API)"""
    api_key_env: str = "OPENAI_API_KEY"
    """openai: environment variable holding the API key"""
    script: str | None = None
    """replay: trajectory JSONL, or a JSON list of assistant messages"""
    max_turns: int = 150
    """turn limit (paper: 150 training, 200 evaluation)"""
    max_context_tokens: int = 131072
    """stop when the conversation reaches this many tokens"""
    max_new_tokens: int = 4096
    """tokens per assistant turn"""
    temperature: float = 0.7
    """sampling temperature (0: greedy)"""
    single_turn: bool = False
    """one response with the whole solution, no tools"""
    device: str = "cpu"
    """kernel backend and where candidates run: "cpu" | "cuda" """
    out: str = "runs/solve"
    """output directory: trajectory.jsonl, best/ (best solution workspace), workspaces/"""
    reward: str = "milestone"
    """reward kind: "milestone" | "speedup" """
    cache_dir: str = field(default_factory=lambda: os.environ.get("CUDA_AGENT_CACHE", "~/.cache/cuda_agent"))
    """sandbox compile + baseline cache, hidden from the agent (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda_agent)"""
    seed: int = 0
    """seed for sampling and the sandbox's inputs"""
    quiet: bool = False
    """do not print the live transcript"""


def print_event(eid: int, kind: str, text: str) -> None:
    """The live transcript: one block per assistant turn, tool result and verdict."""
    color = {"assistant": "\033[36m", "tool": "\033[33m", "error": "\033[31m", "verdict": "\033[32m"}[kind]
    body = text if kind == "assistant" else truncate(text, 1500)
    print(f"{color}[{eid}] {kind}\033[0m {body}", flush=True)


def solve(cfg: SolveConfig) -> int:
    """One episode on one task. Returns 0 if a correct solution was found, 1 if not, 2 on bad input."""
    import policy as policy_mod   # the CLI entry is the one place env builds a policy (lazy: env < policy)
    import sandbox
    try:
        src = sandbox.load_task(cfg.task)
    except (sandbox.TaskError, OSError) as e:
        print(f"bad task {cfg.task}: {e}", file=sys.stderr)
        return 2
    pol = policy_mod.make_policy(cfg.policy, model=cfg.model, adapter=cfg.adapter, endpoint=cfg.endpoint,
                                 api_key_env=cfg.api_key_env, script=cfg.script, device=cfg.device,
                                 max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    sb = sandbox.SandboxConfig(device=cfg.device, reward=cfg.reward, seed=cfg.seed, cache_dir=cfg.cache_dir)
    ecfg = EnvConfig(max_turns=cfg.max_turns, max_context_tokens=cfg.max_context_tokens, device=cfg.device,
                     single_turn=cfg.single_turn, work_dir=os.path.join(cfg.out, "workspaces"), sandbox=sb)
    name = os.path.splitext(os.path.basename(cfg.task))[0]
    pool = sandbox.SandboxPool(sb)
    try:
        traj = run_episodes(pol, [{"source": src, "name": name}], pool, ecfg,
                            log=None if cfg.quiet else print_event)[0]
    finally:
        pool.close()
    save_trajectories(os.path.join(cfg.out, "trajectory.jsonl"), [traj])
    best = os.path.join(cfg.out, "best")
    make_workspace(best, src, cfg.device)
    for rel in list(snapshot(best)):          # the scaffold goes; the best snapshot comes in
        os.remove(os.path.join(best, rel))
    write_files(best, traj.best_files)
    print(f"\n{traj.task}: stop={traj.stop_reason} turns={len(traj.turns)} invalid_calls={traj.invalid_calls} "
          f"repeated_calls={traj.repeated_calls} best_reward={traj.best_reward} final_reward={traj.final_reward}")
    print(f"saved {os.path.join(cfg.out, 'trajectory.jsonl')} and {best}/")
    return 0 if traj.best_reward >= 1 else 1
