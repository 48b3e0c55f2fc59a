"""Host memory for KV caches that the rollout engine evicts (engine.Engine, `kv_budget_gib`).

Offloaded caches live in a pool of fixed-size pinned blocks (`HostPool`, 64 MiB by default). Copies from
pageable memory go through a driver bounce buffer (~1.3-1.9 GB/s on an H200 host); pinned ones run at PCIe
speed (~50 GB/s there). Pinning each cache as its own tensor would waste memory: PyTorch's pinned allocator
rounds a request up to a power of two and caches the block, so 63 caches of 1.5 GiB would pin 126 GiB of a
128 GiB host. Power-of-two blocks are taken exactly, return to a free list when their cache is reloaded or
its episode released, and are reused; a cache wastes less than one block (64 MiB next to 1.5 GiB at 16k
tokens). A cache (layers, 2, Hkv, n, D) is copied one layer (2, Hkv, n, D) at a time, ~32 MiB at 16k tokens
for the Qwen3-30B-A3B shape, so the contiguous copy of an arena row (or the staging on the way back) stays
small on the device.

The pool only grows (to the most ever offloaded at once), and pinning is slow, ~1.3-2.6 GiB/s with
cudaHostAlloc on an H200 host: a one-time cost per engine (engine.Engine.stats["kv_host_alloc_s"]);
PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 pins ~3x faster.
Measured with scripts/bench_kv_host.py (docs/RESULTS.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

KV_HOST_BLOCK = 64 * 2 ** 20   # bytes per host block of offloaded caches (a power of two: see above)


class HostPool:
    """Fixed-size host blocks (pinned when the engine runs on CUDA), kept on a free list and reused."""

    def __init__(self, block: int, pin: bool):
        self.block, self.pin = block, pin
        self.free: list[torch.Tensor] = []         # (block,) uint8 each
        self.allocated = 0                          # blocks ever allocated (held by caches or free)
        self.alloc_s = 0.0                          # seconds spent allocating (pinning) them

    def take(self, nbytes: int) -> list[torch.Tensor]:
        """ceil(nbytes / block) blocks, from the free list first."""
        n = -(-nbytes // self.block)
        t = time.perf_counter()
        while len(self.free) < n:
            self.free.append(torch.empty(self.block, dtype=torch.uint8, pin_memory=self.pin))
            self.allocated += 1
        self.alloc_s += time.perf_counter() - t
        return [self.free.pop() for _ in range(n)]

    def give(self, blocks: list[torch.Tensor]) -> None:
        self.free.extend(blocks)

    def pieces(self, blocks: list[torch.Tensor], start: int, length: int):
        """Bytes [start, start + length) of the blocks laid end to end, as (block slice, offset in the range, size);
        a range straddles as many block boundaries as it crosses."""
        done = 0
        while done < length:
            b, off = divmod(start + done, self.block)
            k = min(self.block - off, length - done)
            yield blocks[b][off:off + k], done, k
            done += k


@dataclass
class HostKV:
    """An offloaded cache: its bytes in (layers, 2, Hkv, n, D) order, laid end to end over pool blocks."""
    blocks: list[torch.Tensor]
    shape: torch.Size                  # (layers, 2, Hkv, n, D)
    dtype: torch.dtype


def offload(pool: HostPool, kv: torch.Tensor) -> HostKV:
    """Copy kv (layers, 2, Hkv, n, D), any strides, into blocks of `pool` (pinned on CUDA).

    One layer (2, Hkv, n, D) at a time is made contiguous on kv's device and copied asynchronously into
    consecutive block bytes; the caller synchronises before it relies on them. With plain CPU blocks the same
    code runs synchronously."""
    h = HostKV(pool.take(kv.numel() * kv.element_size()), kv.shape, kv.dtype)
    layer = kv[0].numel() * kv.element_size()                             # bytes of (2, Hkv, n, D)
    for l in range(kv.shape[0]):
        src = kv[l].contiguous().view(-1).view(torch.uint8)               # (layer,) bytes
        for blk, a, k in pool.pieces(h.blocks, l * layer, layer):
            blk.copy_(src[a:a + k], non_blocking=True)
    return h


def reload(pool: HostPool, h: HostKV, dst: torch.Tensor) -> None:
    """Copy an offloaded cache into dst (layers, 2, Hkv, n, D), e.g. an arena row, and give its blocks back.

    A layer's bytes may straddle blocks, so each layer goes through a staging buffer (2, Hkv, n, D) on dst's
    device (asynchronously from pinned blocks) and then into dst's strides. A strided cross-device `copy_`
    stages through a temporary of the same size anyway. Blocks handed back while copies are in flight are
    safe: the next writer is an offload on the same CUDA stream, or host code after a synchronisation."""
    layer = h.shape[1:].numel() * h.dtype.itemsize
    for l in range(h.shape[0]):
        stage = torch.empty(layer, dtype=torch.uint8, device=dst.device)
        for blk, a, k in pool.pieces(h.blocks, l * layer, layer):
            stage[a:a + k].copy_(blk, non_blocking=True)
        dst[l].copy_(stage.view(h.dtype).view(h.shape[1:]))
    pool.give(h.blocks)
