"""Memory shared between a check's trusted driver and the process that computes, and the driver's hold on that
process. Runs INSIDE children (bound beside sandbox_worker.py); imports nothing of the project.

  * `Region`: one shared buffer, made by the driver and mapped by the computing child. On the cpu backend a
    memfd sealed against shrinking (a child that truncated it would fault the driver's mapping); on a GPU a
    CUDA virtual-memory allocation exported as a POSIX file descriptor. Legacy CUDA IPC handles cannot cross
    PID namespaces, and each child has its own; a file descriptor passed over a unix socket can.
  * `GpuOps`: the driver API calls both sides need on a GPU: stream memory operations (a 32-bit flag written
    by one process's stream and awaited by the other's: the only ordering between two CUDA contexts that
    needs no host round trip) and the L2 controls (persisting lines reset, persisting limit 0).
  * `Freezer`: SIGSTOP / SIGCONT of every process of the computing child's tree, confirmed in /proc, so that
    nothing of it runs while the driver writes the next inputs or reads an output.

Smoke: python -m pytest tests/test_sandbox_attacks.py -q -k thread
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import signal
import time

ALIGN = 256  # tensors in a region start at multiples of this (any dtype's alignment, and coalesced loads)


def layout(specs: list) -> tuple[list[int], int]:
    """Offsets of tensors of (dtype name, shape) specs laid out in one region, and the region's size."""
    import math

    import torch
    offs, at = [], 0
    for dt, shape in specs:
        offs.append(at)
        at += (math.prod(shape) * torch.empty((), dtype=getattr(torch, dt)).element_size() + ALIGN - 1) // ALIGN * ALIGN
    return offs, max(at, ALIGN)


# ----------------------------------------------------------------------------- CUDA driver API (VMM, stream ops)
class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _POSIX_FD, _DEVICE, _READWRITE = 1, 1, 1, 3
_WAIT_GEQ = 0x1
_LIMIT_PERSISTING_L2 = 0x06


class GpuOps:
    """The CUDA driver calls of this module, bound once (libcuda.so.1, the primary context torch made current)."""

    def __init__(self):
        import torch
        self.dev = torch.cuda.current_device()
        torch.cuda.init()
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        sig = {"cuMemGetAllocationGranularity": [ctypes.POINTER(sz), ctypes.POINTER(_AllocProp), ctypes.c_int],
               "cuMemCreate": [ctypes.POINTER(u64), sz, ctypes.POINTER(_AllocProp), u64],
               "cuMemExportToShareableHandle": [vp, u64, ctypes.c_int, u64],
               "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), vp, ctypes.c_int],
               "cuMemAddressReserve": [ctypes.POINTER(u64), sz, sz, u64, u64],
               "cuMemMap": [u64, sz, sz, u64, u64], "cuMemSetAccess": [u64, sz, ctypes.POINTER(_AccessDesc), sz],
               "cuMemRelease": [u64], "cuCtxResetPersistingL2Cache": [], "cuCtxSetLimit": [ctypes.c_int, sz]}
        for name, argtypes in sig.items():
            getattr(self.lib, name).argtypes = argtypes
        # the _v2 entry points are the stream memory operations that need no opt-in (CUDA >= 11.7)
        self.wait32 = getattr(self.lib, "cuStreamWaitValue32_v2", None) or self.lib.cuStreamWaitValue32
        self.write32 = getattr(self.lib, "cuStreamWriteValue32_v2", None) or self.lib.cuStreamWriteValue32
        for f in (self.wait32, self.write32):
            f.argtypes = [vp, u64, ctypes.c_uint32, ctypes.c_uint]

    def check(self, rc: int, what: str):
        if rc != 0:
            raise RuntimeError(f"{what} failed (CUresult {rc})")

    def _prop(self) -> _AllocProp:
        p = _AllocProp()
        p.type, p.requestedHandleTypes, p.location.type, p.location.id = _PINNED, _POSIX_FD, _DEVICE, self.dev
        return p

    def granularity(self) -> int:
        g = ctypes.c_size_t()
        self.check(self.lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(self._prop()), 0), "granularity")
        return g.value

    def create(self, size: int) -> tuple[int, int]:
        """(fd, device pointer) of a new exportable allocation of `size` bytes (a multiple of granularity())."""
        h, fd = ctypes.c_uint64(), ctypes.c_int(-1)
        self.check(self.lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self._prop()), 0), "cuMemCreate")
        self.check(self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), h, _POSIX_FD, 0), "export")
        return fd.value, self._map(h, size)

    def open(self, fd: int, size: int) -> int:
        """The device pointer of another process's allocation, mapped here from its file descriptor."""
        h = ctypes.c_uint64()
        self.check(self.lib.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), _POSIX_FD), "import")
        return self._map(h, size)

    def _map(self, h, size: int) -> int:
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
        self.check(self.lib.cuMemMap(ptr, size, 0, h, 0), "cuMemMap")
        self.check(self.lib.cuMemRelease(h), "cuMemRelease")  # the mapping keeps the memory alive
        acc = _AccessDesc()
        acc.location.type, acc.location.id, acc.flags = _DEVICE, self.dev, _READWRITE
        self.check(self.lib.cuMemSetAccess(ptr, size, ctypes.byref(acc), 1), "cuMemSetAccess")
        return ptr.value

    def wait_flag(self, stream: int, ptr: int, value: int):
        """The stream waits until the 32-bit word at ptr is >= value (written by the other process's stream)."""
        self.check(self.wait32(ctypes.c_void_p(stream), ptr, value, _WAIT_GEQ), "cuStreamWaitValue32")

    def write_flag(self, stream: int, ptr: int, value: int):
        """Once the stream's earlier work is done (and its writes visible), the word at ptr becomes value."""
        self.check(self.write32(ctypes.c_void_p(stream), ptr, value, 0), "cuStreamWriteValue32")

    def reset_l2(self):
        """No persisting L2 lines and no persisting set-aside: lines a process marked persisting (an access-policy
        window with hitProp Persisting) would otherwise survive the flush between calls."""
        self.check(self.lib.cuCtxSetLimit(_LIMIT_PERSISTING_L2, 0), "cuCtxSetLimit")
        self.check(self.lib.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


def device_bytes(ptr: int, size: int, device: int):
    """A torch uint8 tensor over `size` bytes of device memory at ptr (not owned: the mapping outlives it)."""
    import torch

    class _Interface:
        __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 2}
    return torch.as_tensor(_Interface(), device=f"cuda:{device}")


# ----------------------------------------------------------------------------- regions
class Region:
    """`size` shared bytes: a memfd mapping (cpu) or a CUDA VMM mapping (cuda), with `bytes` a uint8 tensor over
    them and `fd` what another process maps. Made with fd=None (the driver), opened with an fd (the child)."""

    def __init__(self, device: str, size: int, fd: int | None = None, ops: GpuOps | None = None):
        import torch
        self.device, self.size = device, size
        if device == "cuda":
            ops = ops or GpuOps()
            g = ops.granularity()
            self.size = size = (size + g - 1) // g * g if fd is None else size
            self.fd, ptr = ops.create(size) if fd is None else (fd, ops.open(fd, size))
            self.bytes = device_bytes(ptr, size, ops.dev)
            self.ptr = ptr
            return
        if fd is None:
            fd = os.memfd_create("cuda_agent_share", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.fd = fd
        self.map = mmap.mmap(fd, size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.ptr = self.bytes.data_ptr()

    def views(self, specs: list) -> list:
        """Tensors of (dtype name, shape) specs over this region, laid out by `layout`."""
        import math

        import torch
        offs, _ = layout(specs)
        out = []
        for (dt, shape), at in zip(specs, offs):
            dtype = getattr(torch, dt)
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            out.append(self.bytes[at:at + n].view(dtype).view(shape))
        return out


# ----------------------------------------------------------------------------- the computing child, held still
class Freezer:
    """Stops and continues every process of a tree (the computing child's sandbox, from its outermost pid).
    `stop()` returns only once every thread of every process is seen stopped in /proc, re-walking the tree
    until no new process appears (one that forks while the others stop is stopped too)."""

    def __init__(self, root: int):
        self.root, self.pids, self.frozen = root, [root], False

    def _tree(self) -> list[int]:
        out, todo = [], [self.root]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for t in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{t}/children") as f:
                        todo += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                pass
        return out

    @staticmethod
    def _running(pid: int, known: set) -> list[str]:
        """Paths of pid's threads not seen stopped (a thread in `known` was seen stopped in this stop())."""
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return []  # gone
        out = []
        for t in tids:
            path = f"/proc/{pid}/task/{t}/stat"
            if path in known:
                continue
            try:
                with open(path) as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # gone
            if state in "TtZX":
                known.add(path)
            else:
                out.append(path)
        return out

    def stop(self, timeout_s: float = 5.0, during=None) -> bool:
        """SIGSTOP every process of the tree and wait until every thread is seen stopped; `during()` (work that
        needs no stopped child, e.g. drawing the next inputs in private memory) runs while the signals land.
        A thread seen stopped is not read again until a last sweep that reads them all: a process that was
        continued meanwhile by one not yet stopped (SIGCONT within the tree) is seen there, stopped again."""
        if self.frozen:
            if during:
                during()
            return True
        seen: set = set()
        deadline = time.monotonic() + timeout_s
        todo = self._tree()
        while time.monotonic() < deadline:
            for p in todo:
                try:
                    os.kill(p, signal.SIGSTOP)
                except OSError:
                    pass
            seen.update(todo)
            if during:
                during, _ = None, during()
            known: set = set()
            while any(self._running(p, known) for p in seen):  # only thread states are polled here ...
                if time.monotonic() > deadline:
                    return False
            todo = [p for p in self._tree() if p not in seen]  # ... and the tree walked once they all stopped
            if not todo and not any(self._running(p, set()) for p in seen):
                self.pids, self.frozen = sorted(seen), True
                return True
            todo = todo or sorted(seen)  # one was continued from inside the tree: stop them all again
        return False

    def cont(self):
        for p in self.pids if self.frozen else []:
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass
        self.frozen = False
