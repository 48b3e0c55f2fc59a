"""Warm sandbox children: pre-started workers (torch imported, CUDA up, the checks warmed) kept per device
slot, each handed to exactly one job, and replaced in the background. sandbox/core.py keeps the candidate pool,
sandbox/reference.py the reference pool.

Smoke: python -m pytest tests/test_sandbox_integrity.py -q -k spare
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import shutil
import threading

from .child import Child


def warm_spares(cfg) -> int:
    """Spares per device slot: a spare's start-up (7-8 s on an H200 while others start too) over a check's time
    (~0.6 s) needs many in flight on a GPU: with 8, 3-8 checks in twenty waited for their spare and checks ran
    at 50-67 a minute; with 12, 1-3 in twenty waited, 72-97 a minute (docs/RESULTS.md). Each holds a CUDA
    context on its GPU. On a CPU every spare's start competes with the check being timed."""
    return cfg.warm_spares if cfg.warm_spares >= 0 else 12 if cfg.device == "cuda" else 0


class Spares:
    """Warm children (Child with no job yet), up to `n` per device slot: one pool for candidate children
    (sandbox/core.py), one for reference children (sandbox/reference.py), one for load_inline build children
    (sandbox/build.py). `take` hands one out and starts its
    replacement in the background, so a check finds the child's start-up (interpreter, torch, CUDA, the
    checks' one-time costs) already done. Spares are keyed by what they hide and their limits: one started
    for another workspace's parent is killed, never reused."""

    def __init__(self):
        self._lock, self._ready, self._pending = threading.Lock(), {}, {}  # slot (device, gpu) -> [(key, Child)]
        self._started = threading.Condition(self._lock)  # a pending spare has started (or failed to)
        self._pending_keys: dict = {}  # key -> spares of that key being started
        self.last_error: str | None = None  # why the last spare could not be used (diagnostics)
        # Spares are started from one thread that lives as long as the process: bwrap --die-with-parent
        # (PR_SET_PDEATHSIG) kills a child when the *thread* that started it exits, so a spare started from
        # a short-lived thread died (SIGKILL) as soon as that thread returned.
        self._spawner = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spares")
        atexit.register(self.close)

    def take(self, key: tuple, n: int, spawn) -> tuple[Child, bool]:
        """(a child for this key, whether it was already started: False when none was ready). When none is
        ready but one of this key is being started, that one is awaited: it began earlier than a new one would."""
        child, warm = self._take_or_fill(key, n, spawn, take=True)
        while not warm and child is None:
            with self._lock:
                if not self._pending_keys.get(key):
                    break
                self._started.wait(timeout=5.0)
            child, warm = self._take_or_fill(key, n, spawn, take=True)
        return (child, warm) if child is not None else (spawn(), False)

    def fill(self, key: tuple, n: int, spawn):
        """Start spares up to `n` for this key without taking one: a check calls it before its reference
        run, so that even the first check of a process finds a warm child."""
        self._take_or_fill(key, n, spawn, take=False)

    def _take_or_fill(self, key: tuple, n: int, spawn, take: bool):
        slot, stale, child = key[:2], [], None
        with self._lock:
            ready = self._ready.setdefault(slot, [])
            keep = []
            while ready:
                k, c = ready.pop(0)
                if k != key or not c.alive():
                    stale.append(c)
                    if k == key:
                        self.last_error = f"a spare died before its job (exit code {c.proc.poll()})"
                elif take and child is None:
                    child = c
                else:
                    keep.append((k, c))
            ready[:] = keep
            missing = n - len(keep) - self._pending.get(slot, 0)
            self._pending[slot] = self._pending.get(slot, 0) + max(missing, 0)
            self._pending_keys[key] = self._pending_keys.get(key, 0) + max(missing, 0)
        for c in stale:
            self._discard(c)
        for _ in range(missing):
            self._spawner.submit(self._refill, slot, key, spawn)
        if take:
            return child, child is not None

    def _refill(self, slot, key, spawn):
        c = None
        try:
            c = spawn()
        except Exception as e:  # noqa: BLE001 - a spare that cannot start is started again, cold, at `take`
            self.last_error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._pending[slot] -= 1
            self._pending_keys[key] -= 1
            if c is not None:
                self._ready.setdefault(slot, []).append((key, c))
            self._started.notify_all()

    def starting(self) -> int:
        """Children of this pool still starting (being spawned, or spawned and not yet warm): how many start-ups
        share the host with a check right now (`Verdict.timings["spares_starting"]`)."""
        with self._lock:
            ready = [c for cs in self._ready.values() for _, c in cs]
            pending = sum(self._pending.values())
        return pending + sum(not any(m.get("stage") == "warm" for _, m in list(c.msgs)) for c in ready)

    @staticmethod
    def _discard(c: Child):
        c.kill()
        shutil.rmtree(c.jobdir, ignore_errors=True)

    def close(self):
        with self._lock:
            children = [c for ready in self._ready.values() for _, c in ready]
            self._ready.clear()
        for c in children:
            self._discard(c)
