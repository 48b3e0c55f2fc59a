"""Form (c): the CUDA Agent workspace as the paper released it, built as one torch extension, `cuda_extension`.

The layout: `model_new.py` does `import cuda_extension` and calls its ops; `kernels/NAME.cu` holds a kernel and
its host launcher on `torch::Tensor`; `kernels/NAME_binding.cpp` registers the launcher's pybind11 binding
through the root `binding_registry.h`; the root `binding.cpp` holds `PYBIND11_MODULE(cuda_extension, m)`, which
calls every registered binding. `binding.cpp`, every `kernels/*.cu` and every `kernels/*.cpp` (the bindings
among them) are built by `torch.utils.cpp_extension.load(name="cuda_extension", ...)` with the released
script's flags (-O3; nvcc also --use_fast_math; TORCH_CUDA_ARCH_LIST from the GPU). The cpu backend builds the
same layout from its .cpp sources alone (its .cu sources are not built: CPU-only torch cannot link them).

How it is built (host side, `build_extension`):
  * the host copies the workspace safely (`workspace.copy_tree`: no link followed, capped) and keys the build by
    the digest of every file the compilers can see, the flags, the compilers, torch and the GPU arch: an
    unchanged workspace is a cache hit, and a source that failed to compile fails again at once;
  * otherwise it mirrors those files into a build dir kept per workspace path in the cache (a file is rewritten
    only when its content changed, so its mtime tells ninja what to rebuild) and runs `load()` there in a
    sandboxed child: bubblewrap, no network, only that build dir writable, the repository, the rest of the
    cache and the workspace's parent hidden, time, memory and disk limits. Ninja recompiles only the changed
    sources (the header dependencies are ninja's), then links;
  * the child only compiles and links: it never imports the built module (`load()`'s import step is replaced),
    so no candidate code runs where a later build's objects live. The candidate's child imports a private copy
    of the module (`sandbox.harness.inline.install_extension`).

Departures from the paper:
  1. Like form (a)'s `load_inline`, sources are built against a slim stand-in for <torch/extension.h> and
     <torch/types.h> first (sandbox.harness.inline.SLIM_TORCH_H; -I dirs are searched before torch's -isystem ones;
     ~3x faster to compile). When that fails, the sources that failed are compiled alone with torch's own
     headers (a real error is reported from there), then all of them, and that workspace keeps torch's
     headers from then on; the module is the same either way.
  2. The cpu backend adds -fopenmp to the released flags (its kernels are C++ with OpenMP, as in form (b)).

Smoke: python -m pytest tests/test_workspace_cuda_agent.py -q -k "cpu or template"
GPU:   python -m pytest tests/test_workspace_cuda_agent.py -q -m gpu
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time

import workspace
from workspace import WorkspaceError

from . import child
from .build import _compiler_version, cuda_arch, trim_log
from .child import SandboxError, hidden, new_jobdir, run_child
from .config import SandboxConfig
from .harness.inline import SLIM_TORCH_H

EXTENSION = "cuda_extension"
CFLAGS = ["-O3"]                          # the released compile.py's extra_cflags
CUDA_CFLAGS = ["-O3", "--use_fast_math"]  # ... and its extra_cuda_cflags
CPU_FLAGS = ["-fopenmp"]                  # cpu backend: OpenMP kernels (compile and link)
CPP_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".inl")  # C++/CUDA: scanned
_IMPORT = re.compile(rf"^\s*(?:import|from)\s+{EXTENSION}\b", re.M)
# a compiler's diagnostic: `kernels/a.cpp:7:5: error: ...` (gcc), `kernels/a.cu(7): error: ...` (nvcc)
_ERROR = re.compile(r"^\S+?(?::\d+(?::\d+)?:|\(\d+\):) (?:fatal |catastrophic )?error\b")
# ninja's echo of a compile or link command (left out of logs: a few hundred characters of flags each)
_COMMAND = re.compile(r"^(?:Error building extension '[^']*': )?(?:\[\d+/\d+\] )?\S*(?:c\+\+|g\+\+|nvcc)(?:\s|$)")

# Run by the build child (`python -c`): torch's own load(), minus its import of the built module.
BUILD_SCRIPT = r"""
import json, os, sys
import torch.utils.cpp_extension as ce
a = json.loads(sys.argv[1])
if not hasattr(ce, "_import_module_from_library"):  # never import the candidate's module here
    sys.exit("torch.utils.cpp_extension has no _import_module_from_library: cannot build without importing")
ce._import_module_from_library = lambda name, path, is_python_module: os.path.join(path, name + ".so")
try:
    ce.load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"], extra_cuda_cflags=a["cuda_cflags"],
            extra_ldflags=a["ldflags"], build_directory=a["build"], with_cuda=a["with_cuda"], verbose=False)
except Exception as e:
    with open(a["log"], "w") as f:
        f.write(str(e))
    sys.exit(1)
"""


def is_extension_workspace(ws: str) -> bool:
    """Form (c): a root binding.cpp, a kernels/*_binding.cpp, or a model_new.py that imports cuda_extension.
    False for a workspace the host refuses to read (the per-kernel build reports the refused file)."""
    try:
        files = workspace.walk(ws)
        if "binding.cpp" in files or any(_in_kernels(f) and f.endswith("_binding.cpp") for f in files):
            return True
        return "model_new.py" in files and bool(_IMPORT.search(workspace.read_text(os.path.join(ws, "model_new.py"))))
    except WorkspaceError:
        return False


def _in_kernels(rel: str) -> bool:
    return rel.startswith("kernels/") and rel.count("/") == 1


def extension_sources(files: list[str], device: str) -> list[str]:
    """What `load()` builds, as the released compile.py picks it: binding.cpp, kernels/*.cu (cuda only) and
    kernels/*.cpp (the *_binding.cpp among them)."""
    exts = (".cu", ".cpp") if device == "cuda" else (".cpp",)
    return (["binding.cpp"] if "binding.cpp" in files else []) + \
        sorted(f for f in files if _in_kernels(f) and f.endswith(exts))


def _sources_error(srcs: list[str], cfg: SandboxConfig) -> str | None:
    if not srcs:
        return f"{EXTENSION}: no binding.cpp and no kernels/*.{'cu|cpp' if cfg.device == 'cuda' else 'cpp'} to build"
    if len(srcs) > cfg.max_kernels:
        return f"{len(srcs)} sources in binding.cpp and kernels/, more than max_kernels={cfg.max_kernels}"
    objs: dict[str, str] = {}  # load() names each object after its file: kernels/a.cpp and a.cpp would clash
    for s in srcs:
        obj = _object(s)
        if obj in objs:
            return f"{objs[obj]} and {s} compile to the same object {obj}: rename one"
        objs[obj] = s
    return None


def _object(src: str) -> str:
    """The object file load() compiles `src` to: kernels/a.cu -> a.cuda.o, kernels/a.cpp -> a.o."""
    return os.path.basename(src).rsplit(".", 1)[0] + (".cuda.o" if src.endswith(".cu") else ".o")


def _flags(cfg: SandboxConfig, slim: str | None, cublas: bool) -> tuple[list, list, list]:
    """(extra_cflags, extra_cuda_cflags, extra_ldflags) of load(); `slim`: the stand-in headers' dir."""
    inc = [f"-I{slim}"] if slim else []
    cpu = CPU_FLAGS if cfg.device == "cpu" else []
    return CFLAGS + cpu + inc, CUDA_CFLAGS + inc, cpu + (["-lcublas"] if cublas else [])


def _key(tree: str, srcs: list[str], cfg: SandboxConfig, cublas: bool) -> str:
    """The build's identity: every file the compilers see, what is built, flags, compilers, torch, arch."""
    cxx = os.environ.get("CXX", "c++")
    tools = [_compiler_version(cxx)] + ([_compiler_version("nvcc"), cuda_arch()] if cfg.device == "cuda" else [])
    blob = json.dumps([tree, srcs, cfg.device, _flags(cfg, None, cublas), SLIM_TORCH_H, _torch(), tools])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@functools.cache
def _torch() -> str:
    """torch's version and location, without importing it here (importing the sandbox does not import torch)."""
    return f"{importlib.metadata.version('torch')}|{importlib.util.find_spec('torch').origin}"


@contextlib.contextmanager
def _locked(path: str):
    """One build per work dir at a time, across threads and processes (fcntl lock on a file beside it)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sync(files: dict[str, bytes], dst: str) -> None:
    """Make `dst` hold exactly `files` (relative path -> bytes): only a changed file is written (a new mtime,
    which ninja rebuilds from), files no longer there are removed (links are removed, never followed)."""
    for rel, data in files.items():
        path = os.path.join(dst, rel)
        with contextlib.suppress(OSError):
            if not os.path.islink(path) and os.path.isfile(path) and workspace.read_bytes(path, 1 << 30) == data:
                continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        with open(path, "wb") as f:
            f.write(data)
    for root, dirs, names in os.walk(dst):
        for n in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            if os.path.relpath(os.path.join(root, n), dst) not in files:
                os.remove(os.path.join(root, n))


def _first_error(log: str) -> str:
    """The first compiler error, preferring one in a workspace file (`kernels/a_binding.cpp:7:5: error: ...`;
    the log names workspace files by their relative path, torch's headers by an absolute one)."""
    errs = [ln.strip() for ln in log.splitlines() if _ERROR.match(ln.strip())]
    own = [ln for ln in errs if not ln.startswith("/")]
    return (own or errs or [child.last_line(log) or f"{EXTENSION}: build failed"])[0][:300]


def build_extension(ws: str, cfg: SandboxConfig) -> tuple[bool, str, dict[str, str]]:
    """Build form (c)'s `cuda_extension` from the workspace `ws`: (ok, log, {"cuda_extension": path of the .so}).
    A failure's log starts with one line naming the file and the error."""
    cache = os.path.join(os.path.expanduser(cfg.cache_dir), "cuda_ext")
    tmp = tempfile.mkdtemp(dir=child.root())  # host-private
    try:
        try:
            copied = workspace.copy_tree(ws, tmp, ignore_suffixes=(".so", ".o", ".a", ".pyc"))
        except WorkspaceError as e:
            return False, str(e), {}
        srcs = extension_sources(copied, cfg.device)
        if err := _sources_error(srcs, cfg):
            return False, err, {}
        files = {rel: workspace.read_bytes(os.path.join(tmp, rel), 1 << 30) for rel in copied
                 if not rel.endswith((".py", ".md"))}  # what a compiler may read (an #include of any name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    digest = hashlib.sha256()
    for rel, data in sorted(files.items()):
        digest.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    cublas = cfg.device == "cuda" and any(b"cublas" in data.lower() for data in files.values())  # as form (b)
    key = _key(digest.hexdigest(), srcs, cfg, cublas)
    so, failed = os.path.join(cache, "so", key, f"{EXTENSION}.so"), os.path.join(cache, "so", f"{key}.failed")
    if os.path.exists(so):
        return True, "", {EXTENSION: so}
    if os.path.exists(failed):  # the same sources failed before: the same error, at once
        with open(failed) as f:
            return False, f.read(), {}
    ident = f"{os.path.realpath(ws)}|{cfg.device}|{_torch()}|{cuda_arch() if cfg.device == 'cuda' else ''}"
    work = os.path.join(cache, "work", hashlib.sha256(ident.encode()).hexdigest()[:16])
    os.makedirs(work, exist_ok=True)
    with _locked(f"{work}.lock"):
        _sync(files, os.path.join(work, "src"))
        _sync({"torch/extension.h": SLIM_TORCH_H.encode(), "torch/types.h": SLIM_TORCH_H.encode()},
              os.path.join(work, "slim_include"))
        ok, log, built = _build(work, srcs, ws, cfg, cublas)
        if ok:
            try:
                data = workspace.read_bytes(built, 1 << 30)  # a regular file, not a link the child left
            except WorkspaceError as e:
                return False, f"{EXTENSION}: the built module is refused: {e}", {}
            os.makedirs(os.path.dirname(so), exist_ok=True)
            part = f"{so}.{secrets.token_hex(4)}"
            with open(part, "wb") as f:
                f.write(data)
            os.replace(part, so)  # atomic: builds of the same sources at once leave one file
            return True, log, {EXTENSION: so}
    if built == "compile error":
        os.makedirs(os.path.dirname(failed), exist_ok=True)
        with open(failed, "w") as f:
            f.write(log)
    return False, log, {}


def _build(work: str, srcs: list[str], ws: str, cfg: SandboxConfig, cublas: bool) -> tuple[bool, str, str]:
    """load() in sandboxed children: slim headers first (unless this workspace needed torch's own before); if
    that fails, the sources that failed alone with torch's own headers (a real error fails there too, and is
    reported from there without building the rest), then all of them. (ok, log, path of the built .so |
    "compile error" | "")."""
    deadline = time.monotonic() + cfg.compile_budget_s
    full = False
    with contextlib.suppress(OSError), open(os.path.join(work, "headers")) as f:
        full = f.read() == "full"
    steps = [("full", srcs)] if full else [("slim", srcs), ("full", None), ("full", srcs)]
    log = ""
    for mode, some in steps:
        some = some or _failed_sources(log, srcs)
        ok, log = _load_child(work, mode, some, ws, cfg, cublas, any(s.endswith(".cu") for s in srcs), deadline)
        if ok is None:  # out of time, memory or disk: not remembered as the sources' failure
            return False, log, ""
        if ok and some == srcs:
            with open(os.path.join(work, "headers"), "w") as f:
                f.write(mode)
            return True, trim_log(log, True), os.path.join(work, f"build-{mode}", f"{EXTENSION}.so")
        if not ok and mode == "full":
            break
    return False, f"{_first_error(log)}\n{trim_log(log, False)}", "compile error"


def _failed_sources(log: str, srcs: list[str]) -> list[str]:
    """The sources whose objects ninja reports as FAILED (all of them when none is named, e.g. a link error)."""
    objs = {_object(s): s for s in srcs}
    failed = [objs[m] for m in re.findall(r"^FAILED: (?:\[code=\d+\] )?(\S+)", log, re.M) if m in objs]
    return failed or srcs


def _load_child(work: str, mode: str, srcs: list[str], ws: str, cfg: SandboxConfig, cublas: bool, with_cuda: bool,
                deadline: float) -> tuple[bool | None, str]:
    """One load() of `srcs` into work/build-MODE, in a sandboxed child that can write only `work`: (True, log)
    built, (False, log) a compile error, (None, one line + log) out of time, memory or disk. `with_cuda` is the
    whole workspace's (a subset's objects then compile with the same commands). SandboxError if the child
    fails without a build error (it cannot start, or this torch cannot build without importing)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None, f"{EXTENSION}: not built: the workspace's compile budget of {cfg.compile_budget_s:g} s is spent"
    # parallel compiles: each takes ~1-2.5 GB with torch's headers, all inside the child's memory limit
    env = {"MAX_JOBS": str(max(1, min(os.cpu_count() or 1, cfg.mem_limit_mb // 2560)))}
    if cfg.device == "cuda" and not os.environ.get("TORCH_CUDA_ARCH_LIST"):  # else load() asks the GPU
        arch = cuda_arch()
        env["TORCH_CUDA_ARCH_LIST"] = f"{arch[:-1]}.{arch[-1]}"
    bdir = os.path.join(work, f"build-{mode}")
    os.makedirs(bdir, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(bdir, "lock"))  # load()'s own lock file, left by a build that was killed
    cflags, cuda_cflags, ldflags = _flags(cfg, os.path.join(work, "slim_include") if mode == "slim" else None,
                                          cublas)
    jobdir = new_jobdir()
    try:
        log_path = os.path.join(jobdir, "w", "build.log")
        args = {"name": EXTENSION, "sources": [os.path.join(work, "src", s) for s in srcs], "build": bdir,
                "cflags": cflags, "cuda_cflags": cuda_cflags, "ldflags": ldflags, "log": log_path,
                "with_cuda": with_cuda}
        r = run_child({}, jobdir, device="cpu", timeout_s=min(cfg.compile_timeout_s + 60, left),
                      mem_limit_mb=cfg.mem_limit_mb, cmd=[sys.executable, "-c", BUILD_SCRIPT, json.dumps(args)],
                      writable=(work,), hide=hidden(cfg, ws), env=env, disk_limit_mb=cfg.disk_limit_mb,
                      disk_dirs=(work,))
        log, built = r.stdout + r.stderr, r.rc == 0 and os.path.isfile(os.path.join(bdir, f"{EXTENSION}.so"))
        if os.path.exists(log_path):  # load() raised: the compilers' or the linker's errors
            log = workspace.read_text(log_path) + "\n" + log
        elif not built and not r.error:  # no build error, no module: the sandbox's own failure, not a verdict
            raise SandboxError(f"the {EXTENSION} build child failed: {child.last_line(log) or r.rc}")
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)
    log = log.replace(os.path.join(work, "src") + os.sep, "").replace(bdir + os.sep, "")
    log = "\n".join(ln for ln in log.splitlines() if not _COMMAND.match(ln))
    if r.error:
        return None, f"{EXTENSION}: build {r.error}\n{trim_log(log, False)}"
    return built, log
