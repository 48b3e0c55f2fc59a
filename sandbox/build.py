"""Builds for the sandbox: form (b) kernels compiled per file to plain shared objects (nvcc / g++, no torch
headers; cached by every file the compiler sees), form (a) `load_inline` sources built once by an isolated
child that sees no input (candidates run from a private copy), and the harness's own dispatch guard
(sandbox/harness/guard.cpp, once per torch version) and the bytecode cache of what children import. Form (c), the
paper's released workspace built as one torch extension, is sandbox/extension.py's (which uses `cuda_arch` and
`trim_log` from here); `sandbox.compile_workspace` picks between the two for a workspace.

Smoke: python -m pytest tests/test_sandbox.py -q -k "compile or cache or inline"
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import hashlib
import os
import re
import secrets
import shutil
import subprocess
import threading
import time

import workspace
from workspace import WorkspaceError

from . import child
from .child import Child, SandboxError, hidden, isolation, new_jobdir, run_child
from .config import SandboxConfig
from .spares import Spares, warm_spares


# ----------------------------------------------------------------------------- compile (form b)
_VERSIONS: dict[str, str] = {}


def _compiler_version(exe: str) -> str:
    if exe not in _VERSIONS:
        try:
            _VERSIONS[exe] = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            _VERSIONS[exe] = "missing"
    return _VERSIONS[exe]


@functools.cache
def cuda_arch() -> str:
    """sm_XX of GPU 0 (nvidia-smi, asked once per process), overridable with CUDA_AGENT_ARCH=90; default 90."""
    if os.environ.get("CUDA_AGENT_ARCH"):
        return os.environ["CUDA_AGENT_ARCH"].replace("sm_", "").replace(".", "")
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return out[0].replace(".", "")
    return "90"


def _compile_cmd(src: str, so: str, text: str = "") -> list[str]:
    """nvcc for .cu (+ -lcublas when the source mentions cublas), g++ -fopenmp for .cpp."""
    if src.endswith(".cu"):
        a = cuda_arch()
        return ["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{a},code=sm_{a}",
                "-o", so, src] + (["-lcublas"] if "cublas" in text.lower() else [])
    return [os.environ.get("CXX", "g++"), "-O3", "-shared", "-fPIC", "-fopenmp", "-march=native", "-o", so, src]


def trim_log(log: str, ok: bool, limit: int = 3000) -> str:
    """Keep error/warning lines (+2 lines of context); the tail when nothing matches."""
    lines, keep = log.splitlines(), []
    for i, ln in enumerate(lines):
        if re.search(r"\berror\b|\bwarning\b|undefined reference|cannot find|no such file", ln, re.I):
            keep += lines[i:i + 3]
    text = "\n".join(dict.fromkeys(keep)) if keep else ("" if ok else log[-1500:])
    return text[:limit]


def _compile_one(ws: str, name: str, ext: str, cfg: SandboxConfig,
                 deadline: float | None = None) -> tuple[bool, str, str | None]:
    """Compile kernels/NAME.ext in its own sandbox, cached by sha256(what the compiler sees, flags, compiler,
    arch). The job dir gets a safe copy (`workspace.copy_tree`) of all of kernels/, nested dirs included,
    minus the other kernels' sources and build products, and the key is the digest of that copy: a header
    in kernels/impl/ is part of the key, and an edit of another kernel does not rebuild this one.
    `deadline` (time.monotonic) is the workspace's shared compile budget."""
    kdir, own = os.path.join(ws, "kernels"), f"{name}{ext}"
    jobdir = new_jobdir()
    try:
        wdir = os.path.join(jobdir, "w")
        others = tuple(f for f in os.listdir(kdir) if f.endswith((".cu", ".cpp")) and f != own)
        workspace.copy_tree(kdir, wdir, ignore_suffixes=(".so",), skip_names=others)
        cmd = _compile_cmd(own, f"{name}.so", workspace.read_text(os.path.join(wdir, own)))
        h = hashlib.sha256(f"{workspace.tree_digest(wdir)}|{' '.join(cmd)}|{_compiler_version(cmd[0])}".encode())
        cache = os.path.join(os.path.expanduser(cfg.cache_dir), "kernels", h.hexdigest()[:32])
        so = os.path.join(cache, f"{name}.so")
        if os.path.exists(so):
            return True, "", so
        timeout = cfg.compile_timeout_s
        left = deadline - time.monotonic() if deadline is not None else timeout
        if left <= 0:
            return False, f"{own}: not compiled: the workspace's compile budget of {cfg.compile_budget_s:g} s is spent", None
        r = run_child({}, jobdir, device="cpu", timeout_s=min(timeout, left), mem_limit_mb=cfg.mem_limit_mb,
                      cmd=cmd, hide=hidden(cfg, ws), disk_limit_mb=cfg.disk_limit_mb)
        log = r.stdout + r.stderr
        built = os.path.join(wdir, f"{name}.so")
        if r.error and left < timeout and r.error.startswith("timed out"):
            return False, f"{own}: compiler stopped: the workspace's compile budget of {cfg.compile_budget_s:g} s " \
                          f"is spent\n{trim_log(log, False)}", None
        if r.error:  # timeout or memory
            return False, f"{own}: compiler {r.error}\n{trim_log(log, False)}", None
        if r.rc != 0 or not os.path.exists(built):
            return False, f"{own}: compile failed\n{trim_log(log, False)}", None
        os.makedirs(cache, exist_ok=True)
        tmp = f"{so}.{secrets.token_hex(4)}"
        shutil.copy(built, tmp)
        os.replace(tmp, so)  # atomic: concurrent compiles of the same source are fine
        return True, trim_log(log, True), so
    except WorkspaceError as e:
        return False, str(e), None
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def compile_workspace(ws: str, cfg: SandboxConfig, workers: int | None = None) -> tuple[bool, str, dict[str, str]]:
    """Compile every kernels/NAME.cu (cuda) / NAME.cpp (both) separately; returns (ok, log, {name: so}).
    A link or special file anywhere in the workspace, more than cfg.max_kernels sources, or compiles that
    together outlast cfg.compile_budget_s fail it with one line first in the log."""
    exts = (".cu", ".cpp") if cfg.device == "cuda" else (".cpp",)
    try:
        files = workspace.walk(ws)
    except WorkspaceError as e:
        return False, str(e), {}
    srcs = sorted(f[len("kernels/"):] for f in files if f.startswith("kernels/") and f.count("/") == 1
                  and f.endswith(exts))
    names = [os.path.splitext(s) for s in srcs]
    dup = {n for n, _ in names if sum(m == n for m, _ in names) > 1}
    if dup:
        return False, f"two kernel sources share the name {sorted(dup)[0]}", {}
    if len(names) > cfg.max_kernels:
        return False, f"{len(names)} kernel sources in kernels/, more than max_kernels={cfg.max_kernels}", {}
    deadline = time.monotonic() + cfg.compile_budget_s  # one budget for the whole workspace
    with cf.ThreadPoolExecutor(max(1, min(len(names), workers or os.cpu_count() or 1))) as ex:
        results = list(ex.map(lambda ne: _compile_one(ws, ne[0], ne[1], cfg, deadline), names))
    ok = all(r[0] for r in results)
    log = "\n".join(r[1] for r in results if r[1]).strip()
    return ok, log, {n: r[2] for (n, _), r in zip(names, results) if r[2]}


def build_inline(cand: str, wdir: str, cfg: SandboxConfig) -> tuple[str, str | None]:
    """(build dir of this source: cache_dir/torch_ext/<sha>, the compile error or None), built if needed.

    The build child imports the solution and constructs ModelNew with only the build dir writable and no
    input, seed or reference in reach; its load_inline is `sandbox.harness.inline`'s (a slim
    torch header first, torch's own if that fails). Candidate children get a private copy of the dir, so
    nothing a checked run writes there survives into another check (no stash of answers across checks)."""
    with open(cand) as f:
        src = f.read()
    ext = os.path.join(os.path.expanduser(cfg.cache_dir), "torch_ext", hashlib.sha256(src.encode()).hexdigest()[:16])
    os.makedirs(ext, exist_ok=True)
    if os.path.exists(os.path.join(ext, ".built")):
        return ext, None
    failed = os.path.join(os.path.dirname(ext), f"{os.path.basename(ext)}.failed")
    if os.path.exists(failed):  # the same source failed to compile before: the same error, at once
        with open(failed) as f:
            return ext, f.read()
    spare = BUILD_SPARES.take(*_build_spare(cfg))[0] if warm_spares(cfg) > 0 else None
    jobdir = spare.jobdir if spare else new_jobdir()
    try:
        bdir = os.path.join(jobdir, "w")
        os.makedirs(bdir, exist_ok=True)
        shutil.copy(cand, os.path.join(bdir, "solution.py"))
        shutil.copy(os.path.join(wdir, "task.py"), os.path.join(bdir, "task.py"))
        job = {"kind": "build", "cand_path": os.path.join(bdir, "solution.py"), "cand_dir": bdir,
               "ext_dir": os.path.join(bdir, "ext") if spare else ext, "task_path": os.path.join(bdir, "task.py"),
               "init_seed": cfg.seed, "device": cfg.device}
        if spare:  # it builds into its own job dir; the host copies the result (links refused) into the cache
            r = spare.run(job, cfg.compile_timeout_s + 60)
            if (r.result or {}).get("built"):
                shutil.rmtree(ext, ignore_errors=True)
                try:
                    copy_build(job["ext_dir"], ext)
                except WorkspaceError as e:  # a link or special file written at import: the candidate's doing
                    shutil.rmtree(ext, ignore_errors=True)
                    return ext, f"load_inline build dir refused: {e}"
        else:
            r = run_child(job, jobdir, device=cfg.device, timeout_s=cfg.compile_timeout_s + 60,
                          mem_limit_mb=cfg.mem_limit_mb, writable=(ext,), hide=hidden(cfg), env=_build_env(cfg, ext),
                          disk_limit_mb=cfg.disk_limit_mb, disk_dirs=(ext,))
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    res = r.result or {}
    if res.get("built"):
        with open(os.path.join(ext, ".built"), "w") as f:
            f.write("ok")
        return ext, None
    err = res.get("error") or ""
    if "Error building extension" in err:  # a compile error: remembered for this source
        shutil.rmtree(ext, ignore_errors=True)
        with open(failed, "w") as f:
            f.write(err)
        return ext, err
    if r.error and not res:  # the build child timed out or ran out of memory
        shutil.rmtree(ext, ignore_errors=True)
        return ext, f"load_inline build {r.error}"
    return ext, None  # an import or __init__ error: the candidate child reports it, as a verdict


BUILD_SPARES = Spares()  # warm build children: torch and its cpp_extension imported, no CUDA context


def _build_env(cfg: SandboxConfig, ext: str) -> dict:
    env = {"TORCH_EXTENSIONS_DIR": ext}
    if cfg.device == "cuda" and not os.environ.get("TORCH_CUDA_ARCH_LIST"):  # else torch brings CUDA up in the
        arch = cuda_arch()                                                      # build child only to ask for it
        env["TORCH_CUDA_ARCH_LIST"] = f"{arch[:-1]}.{arch[-1]}"
    return env


def _build_spare(cfg: SandboxConfig) -> tuple:
    """(key, count, spawn) of the warm build children of this config: a load_inline check waits for its
    build, and a cold build child spent its first seconds importing torch."""
    def spawn() -> Child:
        jobdir = new_jobdir()
        ext = os.path.join(jobdir, "w", "ext")
        os.makedirs(ext)
        return Child(jobdir, device=cfg.device, mem_limit_mb=cfg.mem_limit_mb, hide=hidden(cfg),
                     env=_build_env(cfg, ext), warm_for="build", disk_limit_mb=cfg.disk_limit_mb)
    key = (cfg.device, None, cfg.mem_limit_mb, cfg.disk_limit_mb, tuple(hidden(cfg)), isolation())
    return key, min(2, warm_spares(cfg)), spawn


def copy_build(src: str, dst: str):
    """Copy a build dir (written by candidate code at import: links and special files are refused)."""
    workspace.copy_tree(src, dst, ignore_suffixes=(".o",), file_cap=1 << 30, total_cap=2 << 30)


# ----------------------------------------------------------------------------- the dispatch guard
GUARD_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness", "guard.cpp")
_GUARD_LOCK = threading.Lock()


def guard_library(cfg: SandboxConfig) -> str:
    """sandbox/harness/guard.cpp built against the running torch (cache_dir/guard/<sha>/sandbox_guard.so: ~10 s once per
    torch, compiler and source) and handed to sandbox/child.py, which binds it into every worker child. Trusted
    source, so it compiles here, not in a sandbox. Raises SandboxError if it cannot: no candidate runs unguarded."""
    import torch
    with _GUARD_LOCK:
        if child.GUARD and os.path.exists(child.GUARD):
            return child.GUARD
        tdir = os.path.dirname(os.path.abspath(torch.__file__))
        lib = os.path.join(tdir, "lib")
        cxx = os.environ.get("CXX", "g++")
        flags = ["-O2", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                 "-I", os.path.join(tdir, "include"), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
        with open(GUARD_SRC, "rb") as f:
            key = hashlib.sha256(f.read() + f"|{torch.__version__}|{tdir}|{flags}|{_compiler_version(cxx)}".encode())
        so = os.path.join(os.path.expanduser(cfg.cache_dir), "guard", key.hexdigest()[:16], "sandbox_guard.so")
        if not os.path.exists(so):
            os.makedirs(os.path.dirname(so), exist_ok=True)
            tmp = f"{so}.{secrets.token_hex(4)}"
            for std in ("c++17", "c++20"):  # C++17 parses torch's headers in ~0.6x the time, where they allow it
                try:
                    r = subprocess.run([cxx, f"-std={std}", GUARD_SRC, "-o", tmp, *flags], capture_output=True,
                                       text=True, timeout=600)
                except (OSError, subprocess.SubprocessError) as e:
                    raise SandboxError(f"cannot build the dispatch guard ({cxx}): {e}") from None
                if r.returncode == 0:
                    break
            if r.returncode != 0:
                raise SandboxError(f"cannot build the dispatch guard: {cxx} failed: "
                                   f"{child.last_line(trim_log(r.stderr, False))}")
            os.replace(tmp, so)  # atomic: processes building at once leave one file
        child.GUARD = so
        return so


# What sandbox children import before any job code: torch, torch.compile's machinery (reference children),
# the extension builder (load_inline builds), the profiler (candidate children). Missing ones are skipped.
BYTECODE_IMPORTS = ("numpy", "torch", "torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codecache",
                    "torch._inductor.codegen.triton", "torch._inductor.codegen.cpp",
                    "torch._inductor.runtime.triton_heuristics", "torch.utils.cpp_extension", "torch.profiler",
                    "triton", "triton.compiler")
_BYTECODE_LOCK = threading.Lock()


def ships_bytecode() -> bool:
    """Whether torch's and inductor's own __pycache__ hold bytecode for this Python (a pip install writes it)."""
    import importlib.util

    import torch
    tdir = os.path.dirname(torch.__file__)
    return all(os.path.exists(importlib.util.cache_from_source(os.path.join(tdir, *f)))
               for f in (("__init__.py",), ("_inductor", "compile_fx.py")))


def bytecode_cache(cfg: SandboxConfig) -> str | None:
    """A bytecode cache for what every child imports (cache_dir/bytecode/<key>, ~70 MB), filled once per
    Python and torch by a trusted process here and handed to sandbox/child.py, which binds it read-only into
    bubblewrap children as their PYTHONPYCACHEPREFIX. Children run on a read-only `/` without writing
    bytecode, so where site-packages ship no .pyc every child compiled torch's sources again: importing
    inductor took ~10 s of a reference child's start on an H200 host (docs/RESULTS.md). None (children
    import as before) where torch ships its bytecode, at the fallback isolation levels (a candidate could
    write into the cache there), or if filling it fails."""
    import sys

    import torch
    if isolation() != "bwrap" or ships_bytecode():
        return None
    with _BYTECODE_LOCK:
        if child.PYCACHE and os.path.isdir(child.PYCACHE):
            return child.PYCACHE
        key = hashlib.sha256(f"{sys.version}|{sys.executable}|{torch.__version__}|{torch.__file__}|"
                             f"{BYTECODE_IMPORTS}".encode()).hexdigest()[:16]
        final = os.path.join(os.path.expanduser(cfg.cache_dir), "bytecode", key)
        if not os.path.isdir(final):
            tmp = f"{final}.{secrets.token_hex(4)}"
            os.makedirs(tmp)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            code = (f"import importlib\nfor m in {BYTECODE_IMPORTS!r}:\n"
                    "    try:\n        importlib.import_module(m)\n    except Exception:\n        pass\n")
            try:
                subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPYCACHEPREFIX": tmp,
                                                                   "CUDA_VISIBLE_DEVICES": ""},
                               capture_output=True, timeout=600, check=True)
                os.rename(tmp, final)  # atomic: of processes filling it at once, one rename wins
            except (OSError, subprocess.SubprocessError):
                shutil.rmtree(tmp, ignore_errors=True)
                if not os.path.isdir(final):
                    return None
        child.PYCACHE = final
        return final
