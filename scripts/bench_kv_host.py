"""Copy speed of the rollout engine's KV offload (kv_host.offload / kv_host.reload) against a pageable copy.

One cache of the Qwen3-30B-A3B shape at 16k tokens, (48 layers, 2, 4 kv heads, 16384, 128) bf16 = 1.61 GB,
taken as a strided row of an arena like engine.Engine's: offloaded and reloaded three times (the first
offload pins new blocks, later ones reuse them), then 20 caches on new blocks (pinning included) and the same
20 on reused blocks, then `kv.to("cpu")` (pageable). Also checks that a cache whose layers straddle blocks of
an odd size round-trips bit for bit and leaves the neighbouring arena rows untouched. Last, the device copies the
engine makes of an arena row (store, reload, compaction) in an arena of 33 rows x 5,632 columns, a row view
spanning more than 2^31 elements: torch's `clone` (and its kernel launches) against fused_ops.copy_kv.

GPU: python scripts/bench_kv_host.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from engine import fused_ops  # noqa: E402
from engine.kv_host import HostPool, offload, reload  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main():
    assert torch.cuda.is_available(), "needs a GPU (pinned host memory, PCIe copies)"
    # exactness: blocks of an odd size, so every layer straddles block boundaries
    pool = HostPool(3 * 2 ** 20 + 4096, pin=True)
    arena = torch.randn(48, 2, 3, 4, 4096, 128, device="cuda", dtype=torch.bfloat16)   # (L, 2, B, Hkv, C, D)
    kv = arena[:, :, 1, :, :3001]
    h = offload(pool, kv)
    back = torch.zeros_like(arena)
    reload(pool, h, back[:, :, 0, :, :3001])
    torch.cuda.synchronize()
    print(f"pinned blocks: {all(b.is_pinned() for b in h.blocks)}; exact: {torch.equal(back[:, :, 0, :, :3001], kv)}; "
          f"other rows untouched: {back[:, :, 1:].abs().sum().item() == 0}")
    del arena, back, pool

    pool = HostPool(64 * 2 ** 20, pin=True)
    arena = torch.randn(48, 2, 2, 4, 16384, 128, device="cuda", dtype=torch.bfloat16)
    kv = arena[:, :, 0]                                                                 # (48, 2, 4, 16384, 128)
    gb = kv.numel() * kv.element_size() / 1e9
    for i in range(3):
        h, s = timed(lambda: offload(pool, kv))
        print(f"offload {i}: {gb / s:.1f} GB/s ({s:.3f} s), pool {pool.allocated} blocks, pinning {pool.alloc_s:.2f} s")
        _, s = timed(lambda: reload(pool, h, arena[:, :, 1]))
        print(f"reload {i}: {gb / s:.1f} GB/s ({s:.3f} s)")
    print(f"round trip exact: {torch.equal(arena[:, :, 0], arena[:, :, 1])}")
    hs = []
    _, s = timed(lambda: [hs.append(offload(pool, kv)) for _ in range(20)])
    print(f"20 caches on new blocks: {20 * gb / s:.1f} GB/s with pinning; pool "
          f"{pool.allocated * pool.block / 2 ** 30:.1f} GiB, pinning {pool.alloc_s:.2f} s")
    for x in hs:
        reload(pool, x, arena[:, :, 1])
    torch.cuda.synchronize()
    _, s = timed(lambda: [offload(pool, kv) for _ in range(20)])
    print(f"20 caches on reused blocks: {20 * gb / s:.1f} GB/s, pinning {pool.alloc_s:.2f} s in all")
    _, s = timed(lambda: kv.to("cpu"))
    print(f"pageable kv.to('cpu'): {gb / s:.2f} GB/s")
    del arena, kv, hs, pool
    device_copies()


def device_copies(n: int = 3500):
    """An arena row's cache copied out on the device: torch's strided clone against fused_ops.copy_kv."""
    from torch.profiler import ProfilerActivity, profile
    arena = torch.randn(48, 2, 33, 4, 5632, 128, device="cuda", dtype=torch.bfloat16)   # (L, 2, B, Hkv, C, D)
    kv = arena[:, :, 7, :, :n]                                                            # (48, 2, 4, n, 128)
    gb = 2 * kv.numel() * kv.element_size() / 1e9                                         # read + write
    dst = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
    for name, fn in (("torch clone", lambda: kv.clone()), ("fused_ops.copy_kv", lambda: fused_ops.copy_kv(dst, kv))):
        fn()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        launches = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        _, s = timed(lambda: [fn() for _ in range(10)])
        print(f"{name}: a {n}-token row in {1e3 * s / 10:.2f} ms ({10 * gb / s:.0f} GB/s read + write), "
              f"{launches} kernel launches; exact: {torch.equal(fn(), kv)}")


if __name__ == "__main__":
    main()
