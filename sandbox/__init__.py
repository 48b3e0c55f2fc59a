"""The sandbox: isolated compile -> verify -> profile of a candidate kernel, and its verdict (`check`).

What the rest of the repository uses is re-exported here; the package's files:
  core.py       what a check runs and its verdict (`check`, `SandboxPool`, `run_isolated`); the threat model
  config.py     `SandboxConfig`
  child.py      isolation (bubblewrap) and the child runner; spares.py the warm children
  build.py      kernel compiles, load_inline builds, the dispatch guard's build; extension.py form (c)'s build
  reference.py  the host's side of drivers and pairings, baselines
  ray.py        the sandbox pool on a Ray cluster (`make_pool`, `RayPool`; `ray.check`)
  harness/      the files a sandboxed child runs (sandbox_worker.py and the modules beside it, guard.cpp)
"""
from workspace import TaskError, WorkspaceError, read_task

from .build import bytecode_cache, guard_library
from .child import (HARNESS_DIR, WORKER, SandboxError, bwrap_argv, hidden, interruptible, isolation, new_jobdir,
                    run_child)
from .config import SandboxConfig
from .core import SandboxPool, Verdict, check, compile_workspace, load_task, run_isolated
from .harness.rules import RULES, compare, static_scan
from .ray import RayPool, make_pool
from .reference import baseline_cache, baseline_timing, baselines, precision_of, prewarm
from .spares import warm_spares

__all__ = ["HARNESS_DIR", "RULES", "RayPool", "SandboxConfig", "SandboxError", "SandboxPool", "TaskError",
           "Verdict", "WORKER", "WorkspaceError", "baseline_cache", "baseline_timing", "baselines", "bwrap_argv",
           "bytecode_cache", "check", "compare", "compile_workspace", "guard_library", "hidden", "interruptible",
           "isolation", "load_task", "make_pool", "new_jobdir", "precision_of", "prewarm", "read_task",
           "run_child", "run_isolated", "static_scan", "warm_spares"]
