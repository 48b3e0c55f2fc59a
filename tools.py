"""The agent's tools (paper §3.2) and its workspace: schemas, implementations, and the text it reads.

  * `make_workspace`: model.py (the reference, read-only), a model_new.py + kernels/ scaffold in one of the
    sandbox's workspace forms (cpu: kernels/*.cpp with OpenMP; cuda: kernels/*.cu), INSTRUCTIONS.md. Layout
    "ctypes" (default, form b): plain kernels loaded through ctypes; "cuda_extension" (form c): the paper's
    released workspace, kernels/NAME.cu + kernels/NAME_binding.cpp + binding.cpp + binding_registry.h built
    into one torch extension that model_new.py imports.
  * `TOOLS` (OpenAI function-calling schemas) and `check_args`: bash, read_file, write_file, edit_file,
    glob, grep, compile, verify, profile, finish. The file tools go through workspace.py: every workspace
    file is attacker-controlled, so a link, FIFO, device or socket is refused with an error observation
    (never followed, never a hang), reads are capped, paths are confined to the workspace.
  * `run_bash`: the bash tool under bubblewrap (read-only root, writable workspace, read-only model.py, no
    network, fresh /tmp, the repo / sandbox cache / other workspaces hidden, a time limit); where bwrap
    does not work, the sandbox's weaker isolation level is used (unshare without network, or rlimits).
  * `verify_text` / `profile_text`: what the agent reads back from a verdict.
  * `prompt(name)`: the prompts, instructions and scaffold, read from data/prompts/.

Departures from the paper
  1. By default kernels are plain C++/CUDA with extern "C" launchers loaded through ctypes (a per-kernel
     rebuild is ~1 s), not the released torch extension with *_binding.cpp (layout "cuda_extension", which
     the sandbox builds too); compile/verify/profile are tools, not scripts in the workspace.
  2. bash runs under bubblewrap; the paper ran agents in containers.

Smoke: python -m pytest -q tests/test_env.py tests/test_env_files.py
"""
from __future__ import annotations

import fnmatch
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import sandbox
import workspace

REPO = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(REPO, "data", "prompts")
BUILD_PRODUCTS = (".so", ".o", ".pyc", ".a")   # left out of snapshots and grep


@functools.cache
def prompt(name: str) -> str:
    """The text of data/prompts/NAME (system prompts, INSTRUCTIONS.md, scaffold files, chat template)."""
    with open(os.path.join(PROMPTS, name)) as f:
        return f.read()


def truncate(s: str, n: int) -> str:
    """s, or its head and tail with a note of how much was cut in between."""
    if len(s) <= n:
        return s
    return s[: n // 2] + f"\n... [{len(s) - n} characters cut] ...\n" + s[-n // 2:]


# --------------------------------------------------------------------------------------------------
# The workspace
# --------------------------------------------------------------------------------------------------


LAYOUTS = ("ctypes", "cuda_extension")  # make_workspace's workspace forms (b and c in sandbox/core.py)
# layout "cuda_extension": workspace file -> prompt file ({name}, {ext} filled in)
_EXT_FILES = {"model_new.py": "scaffold_ext_model_new.py", "binding.cpp": "scaffold_ext_binding.cpp",
              "binding_registry.h": "scaffold_ext_registry.h", "kernels/{name}.{ext}": "scaffold_ext_kernel.{ext}",
              "kernels/{name}_binding.cpp": "scaffold_ext_kernel_binding.cpp"}


def make_workspace(ws: str, task_src: str, device: str, kernel: str = "kernel", tol: float = 1e-2,
                   layout: str = "ctypes") -> str:
    """Fresh workspace directory in one of the sandbox's workspace forms (LAYOUTS)."""
    assert layout in LAYOUTS, f"workspace layout {layout!r}: one of {', '.join(LAYOUTS)}"
    ext = "cu" if device == "cuda" else "cpp"
    if os.path.lexists(ws):
        _make_writable(ws)
        shutil.rmtree(ws)
    os.makedirs(os.path.join(ws, "kernels"))
    with open(os.path.join(ws, "model.py"), "w") as f:
        f.write(task_src)
    os.chmod(os.path.join(ws, "model.py"), 0o444)
    fill = lambda s: s.replace("{name}", kernel).replace("{ext}", ext)  # noqa: E731
    if layout == "cuda_extension":
        for rel, name in _EXT_FILES.items():
            with open(os.path.join(ws, fill(rel)), "w") as f:
                f.write(fill(prompt(fill(name))))
    else:
        with open(os.path.join(ws, "model_new.py"), "w") as f:
            f.write(prompt("scaffold_model_new.py").format(name=kernel, ext=ext))
        with open(os.path.join(ws, "kernels", f"{kernel}.{ext}"), "w") as f:
            f.write(prompt(f"scaffold_kernel.{ext}"))
    rule = ("cuBLAS (GEMM) and cuDNN (convolution) may be called from your .cu files." if ext == "cu" else
            "This is the CPU backend: use C++ with OpenMP (`#pragma omp parallel for`); BLAS is not linked.")
    with open(os.path.join(ws, "INSTRUCTIONS.md"), "w") as f:
        f.write(prompt("instructions_cuda_extension.md" if layout == "cuda_extension" else "instructions.md")
                .replace("{kernel_rule}", rule).replace("{lang}", "CUDA C++" if ext == "cu" else "C++")
                .replace("{ext}", ext).replace("{tol}", f"{tol:g}"))
    return ws


def _make_writable(ws: str) -> None:
    for root, dirs, files in os.walk(ws):
        for n in dirs + files:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)


def confine(ws: str, path: str) -> str:
    """Absolute path of `path` inside ws; WorkspaceError (a ValueError) if it leaves the workspace (.., an
    absolute path, a link out) or names a link or special file."""
    return workspace.confine(ws, path)


def snapshot(ws: str) -> dict[str, str]:
    """The agent's text files (not model.py / INSTRUCTIONS.md / build products), relative path -> text.
    WorkspaceError if the workspace holds a link or special file."""
    return workspace.snapshot(ws, skip_suffixes=BUILD_PRODUCTS)


def write_files(ws: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = confine(ws, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        workspace.write_text(p, text)


def restore_best(ws: str, task_src: str, device: str, files: dict[str, str], layout: str = "ctypes") -> str:
    """A fresh workspace at `ws` holding an episode's best snapshot (Trajectory.best_files) in place of the
    scaffold's own files: what `solve` saves as OUT/best and kernelbench_eval profiles. Returns ws."""
    make_workspace(ws, task_src, device, layout=layout)
    for rel in list(snapshot(ws)):
        os.remove(os.path.join(ws, rel))
    write_files(ws, files)
    return ws


# --------------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------------


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


def check_args(name: str, args) -> str | None:
    """None if `args` fit tool `name`'s schema (required keys, string/integer types), else the reason."""
    if name not in TOOL_NAMES:
        return f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)}"
    if not isinstance(args, dict):
        return "arguments must be a JSON object"
    params = TOOLS[TOOL_NAMES.index(name)]["function"]["parameters"]
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


# --------------------------------------------------------------------------------------------------
# File tools. Each returns the observation; WorkspaceError (confinement, links, FIFOs) is raised to the
# caller, which turns it into an "error: ..." observation.
# --------------------------------------------------------------------------------------------------


def read_file(ws: str, path: str, offset: int | None, limit: int | None, max_chars: int) -> str:
    p = confine(ws, path)
    if not os.path.isfile(p):
        return f"error: no such file: {path}"
    lines = workspace.read_text(p).splitlines(keepends=True)
    off = max(1, int(offset or 1))
    lim = int(limit or len(lines))
    return truncate("".join(lines[off - 1:off - 1 + lim]), max_chars) or "(empty file)"


def write_file(ws: str, path: str, content: str) -> str:
    p = confine(ws, path)
    if p == os.path.realpath(os.path.join(ws, "model.py")):
        return "error: model.py is read-only (it is the reference); write model_new.py"
    os.makedirs(os.path.dirname(p), exist_ok=True)
    workspace.write_text(p, content)
    return f"wrote {len(content)} characters to {path}"


def edit_file(ws: str, path: str, old: str, new: str) -> str:
    p = confine(ws, path)
    if p == os.path.realpath(os.path.join(ws, "model.py")):
        return "error: model.py is read-only (it is the reference); write model_new.py"
    if not os.path.isfile(p):
        return f"error: no such file: {path}"
    text = workspace.read_text(p)
    n = text.count(old) if old else 0
    if n != 1:
        why = "old_str is empty" if not old else ("old_str not found" if n == 0 else
                                                  f"old_str is not unique ({n} occurrences); add context")
        return f"error: {why} in {path}"
    workspace.write_text(p, text.replace(old, new, 1))
    return f"edited {path}"


def glob(ws: str, pattern: str) -> str:
    if pattern.startswith("/") or ".." in pattern.split("/"):
        return "error: patterns are relative to the workspace (no / or ..)"
    hits = [r for r in workspace.walk(ws) if fnmatch.fnmatch(r, pattern)
            or fnmatch.fnmatch(r, pattern.replace("**/", ""))]
    return "\n".join(hits) or "(no matches)"


def grep(ws: str, pattern: str, glob_: str | None, max_chars: int) -> str:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        return f"error: bad regular expression: {e}"
    out = []
    for rel in workspace.walk(ws):
        if (glob_ and not fnmatch.fnmatch(rel, glob_)) or rel.endswith(BUILD_PRODUCTS):
            continue
        text = workspace.read_text(os.path.join(ws, rel))
        out += [f"{rel}:{i}: {line.rstrip()}" for i, line in enumerate(text.splitlines(), 1) if rx.search(line)]
        if len(out) > 200:
            break
    return truncate("\n".join(out[:200]), max_chars) or "(no matches)"


# --------------------------------------------------------------------------------------------------
# bash
# --------------------------------------------------------------------------------------------------


def bash_argv(ws: str, hide: list[str], device: str) -> tuple[list[str], dict[str, str]]:
    """(argv prefix, environment) of the bash tool's isolation. bubblewrap: read-only root, writable
    workspace, read-only model.py, no network, fresh /tmp, the harness paths in `hide` hidden. Without
    bwrap, the sandbox's fallback level (sandbox.isolation(): unshare --net, or nothing but the time limit)."""
    ws = os.path.realpath(ws)
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # `python` = ours
    if sandbox.isolation() != "bwrap":
        prefix = ["unshare", "--net", "--map-root-user"] if sandbox.isolation() == "unshare" else []
        # the harness's directory, as in the bwrap case: `from sandbox_worker import ...` works
        return prefix, {**os.environ, "PYTHONPATH": os.path.dirname(sandbox.WORKER), "PATH": path}
    # the workspace writable, its model.py read-only; `python -c "from sandbox_worker import ..."` works
    argv = sandbox.bwrap_argv([], ws, device, [], hide, ro_binds=(os.path.join(ws, "model.py"),),
                              setenv={"PYTHONPATH": sandbox.HARNESS_DIR, "PATH": path})
    return argv, dict(os.environ)


def run_bash(ws: str, command: str, timeout_s: float, hide: list[str], device: str, max_chars: int) -> str:
    """Run `command` in the workspace under bash_argv's isolation; output truncated, process group killed
    at the time limit."""
    prefix, child_env = bash_argv(ws, hide, device)
    t0 = time.time()
    proc = subprocess.Popen(prefix + ["bash", "-c", command], cwd=ws, env=child_env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        status = f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # the whole process group we started
        out, _ = proc.communicate()
        status = f"killed after {timeout_s:g} s time limit"
    return truncate(out.decode(errors="replace"), max_chars) + f"\n[{status}, {time.time() - t0:.1f} s]"


# --------------------------------------------------------------------------------------------------
# Verdict summaries (what the agent reads)
# --------------------------------------------------------------------------------------------------


def _ms(x) -> str:
    return f"{x:.4g} ms" if isinstance(x, (int, float)) else "n/a"


def verify_text(v: dict) -> str:
    if not v.get("compiled") and not v.get("violation"):  # a static violation is refused before any compile
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
            head.append(f"  trial {t.get('trial')}: max_abs_err={t.get('max_abs_err')} max_rel_err="
                        f"{t.get('max_rel_err')} first_bad_index={t.get('first_bad_index')} {t.get('reason') or ''}")
    return "\n".join(head)


def profile_text(v: dict, reward: float) -> str:
    """verify_text, the timings, and the reward (computed by reward.py from this verdict) it would earn."""
    s = verify_text(v)
    if v.get("correct") and v.get("candidate_ms") is not None:
        s += (f"\ndevice {v.get('device')}: eager {_ms(v.get('eager_ms'))} | torch.compile "
              f"{_ms(v.get('compile_ms'))} | ModelNew {_ms(v.get('candidate_ms'))}"
              f"\nspeedup vs eager {v.get('speedup_eager') or 0:.3g}x, vs torch.compile "
              f"{v.get('speedup_compile') or 0:.3g}x")
    return s + f"\nreward this version would earn: {reward}"


# --------------------------------------------------------------------------------------------------
# Single-turn mode: the whole solution in one response
# --------------------------------------------------------------------------------------------------

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.S)
_FILE_RE = re.compile(r"^(?:#|//)\s*file:\s*(\S+)\s*$")
_SOL_EXT = (".py", ".cu", ".cpp", ".cuh", ".h", ".hpp")


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
