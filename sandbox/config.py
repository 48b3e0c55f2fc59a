"""The sandbox's settings (`SandboxConfig`): tolerances, trials, timing, limits, the cache dir, the static scan's
rules and where checks run. Every part of the sandbox reads it; it imports nothing of the project.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SandboxConfig:
    device: str = "cpu"
    """where candidates run: "cpu" | "cuda" """
    atol: float = 1e-2
    """absolute tolerance of torch.allclose (paper: 1e-2)"""
    rtol: float = 1e-2
    """relative tolerance of allclose, and bound on the relative L2 error ||y - y_ref|| / ||y_ref||"""
    n_trials: int = 5
    """correctness trials, fresh seeded inputs each (plain, scaled and shifted, and with outliers, in turn)"""
    precision: str = "auto"
    """"fp32" | "tf32" | "auto" (tf32 for baselines AND candidate iff rtol >= 1e-3; cpu: always fp32)"""
    warmup: int = 5
    """untimed warm-up iterations before timing"""
    iters: int = 50
    """timed iterations (median reported)"""
    compile_timeout_s: float = 120
    """wall-clock limit per kernel compile (+ 60 s for a load_inline build, form (a), or an extension build,
    form (c))"""
    run_timeout_s: float = 300
    """wall-clock limit per child (and per call of a computing child)"""
    mem_limit_mb: int = 8192
    """host-memory limit per child: RSS of its process tree plus what its private /tmp and /dev/shm hold,
    polled (cpu children also get RLIMIT_AS of this + 4 GB). It does not cover GPU memory: a candidate's child
    may use 80% of its GPU (allocator fraction)"""
    disk_limit_mb: int = 4096
    """what a compile, build or candidate child may write into its job dir (polled; the child is stopped)"""
    cache_dir: str = field(default_factory=lambda: os.environ.get("CUDA_AGENT_CACHE", "~/.cache/cuda_agent"))
    """compile cache + baseline cache (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda_agent)"""
    profile: bool = True
    """False -> stop after verify (no timing; reward uses correctness only)"""
    seed: int = 0
    """seed of the models' weights (the task's and the candidate's init); every call's input seed is drawn
    by the driver from the OS's randomness, so no candidate can precompute"""
    static_scan: bool = True
    """the static layer of the no-torch rule (imports, calls, harness introspection); the tests switch it
    off to prove that each dynamic layer catches its hack on its own"""
    allow_imports: str = ""
    """extra modules a candidate may import, comma-separated (default none: kernels must be its own; the
    adversarial tests widen it to use numpy as a stand-in kernel and reach the dynamic layers)"""
    rules: str = "cuda-agent"
    """the static scan's rule profile: "cuda-agent" (the paper's: torch only allocates in forward) | "kernelbench"
    (KernelBench's: no torch compute, unknown torch names left to the dynamic layers); sandbox/harness/rules.py"""
    max_kernels: int = 16
    """kernel sources one workspace may hold (more is an error verdict, not a queue of compiles)"""
    compile_budget_s: float = 300
    """wall-clock budget shared by all compiles of one workspace (each is also capped by compile_timeout_s)"""
    gpu_clock: Literal["queued", "go-first"] = "queued"
    """GPU timed calls: "queued" (the child enqueues its work behind the go flag and is stopped; the driver's clock
    holds GPU work only) or "go-first" (the clock runs from go while the child is continued: its wake-up and
    launch path inside every time, ~0.7 ms on an H100)"""
    eager_beside: bool = True
    """time eager in each candidate's own child, under the same driver, just before the candidate is imported,
    and compare the candidate with that (same process, same minute); False: with the eager baseline cached per
    task. The compile baseline is always the cached one (compiling in every child would cost its compile)"""
    warm_spares: int = -1
    """pre-started candidate children kept per device (torch imported, CUDA up, checks warmed); each serves
    one candidate and is replaced in the background. 0 = start a child per check; -1 = 12 on cuda, 0 on cpu
    (a spare's start-up would share the cores with a check being timed). Form (a) runs in a new child"""
    ray_address: str | None = None
    """check on a Ray cluster (sandbox/ray.py; needs ray): "auto" (this node's `ray start`) or HOST:PORT, one lane
    per GPU of every node; None: this machine's GPUs or CPU slots"""
    ray_lane_cpus: int = 1
    """with --sandbox.ray-address and device cpu: Ray CPUs each lane takes (a node offers its CPUs // this)"""
