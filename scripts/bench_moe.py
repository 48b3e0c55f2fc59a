"""One MoE layer's experts at decode sizes: transformers' grouped_mm vs moe_kernel's fused Triton path.

Builds one layer's experts at the Qwen3-30B-A3B shape (128 experts, hidden 2048, moe_intermediate 768, top-8,
bf16 random weights: 1.2 GB, 20x the H200's L2), routes M tokens with random top-8 and times both whole
experts calls as CUDA-graph replays (the engine decodes through graphs), with a 256 MB write between
replays so that no expert is served from L2. Reported per M: touched experts, their weight bytes (what a
weight-bound kernel must read), median ms, achieved GB/s of touched bytes and the fraction of the 4.8 TB/s
HBM peak, and the relative error of fused vs grouped_mm. Then a small sweep of block configs per kernel
(gate_up and down timed alone) prints the best per M as a `CONFIGS` literal for engine/moe_kernel.py.

GPU (H200, < 90 s): python scripts/bench_moe.py
                    python scripts/bench_moe.py --no-sweep          (the table only, ~15 s)
CPU smoke (Triton interpreter, tiny shape, ~1 min): python scripts/bench_moe.py --device cpu
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HBM_GBS = 4800.0   # H200 HBM3e peak


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda | cpu (Triton interpreter, tiny shape, smoke only)")
    p.add_argument("--tokens", default="1,8,32,64,128,256", help="token counts M")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="moe_intermediate_size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=50, help="timed replays per measurement (median)")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sweep-tokens", default="1,8,32,128", help="token counts M the sweep covers")
    a = p.parse_args()
    if a.device == "cpu":   # the interpreter is ~1e4x slower: a toy shape, few iterations
        os.environ["TRITON_INTERPRET"] = "1"
        a.experts, a.hidden, a.inter, a.top_k, a.iters = 8, 64, 32, 2, 3
        a.tokens, a.sweep_tokens = "1,4", "4"
    return a


class Timer:
    """Median milliseconds of fn(): CUDA graph replays between L2 flushes on GPU, wall clock on CPU."""

    def __init__(self, device: str, iters: int):
        import torch
        self.torch, self.cuda, self.iters = torch, device == "cuda", iters
        if self.cuda:
            self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def __call__(self, fn) -> float:
        torch = self.torch
        if not self.cuda:
            fn()
            ts = []
            for _ in range(self.iters):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            return statistics.median(ts)
        fn()                                                      # compile / autotune outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)]
        for a, b in ev:
            self.flush.zero_()                                    # evicts L2; also hides the replay's launch
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev)


def main():
    args = parse()
    import torch
    from engine import moe_kernel as mk
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    assert mk.triton is not None, f"triton not importable: {mk.TRITON_ERROR}"
    dev, E, H, I, K = args.device, args.experts, args.hidden, args.inter, args.top_k
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"
    with torch.device(dev):
        ex = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, H ** -0.5)
        ex.down_proj.normal_(0, I ** -0.5)
    gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
    expert_bytes = (gu[0].numel() + dn[0].numel()) * gu.element_size()
    timer = Timer(dev, args.iters)
    print(f"experts: {E} x {expert_bytes / 1e6:.1f} MB ({E * expert_bytes / 1e9:.2f} GB), hidden {H}, "
          f"inter {I}, top-{K}, {dtype}, {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (interpreter)'}")

    def routing(M, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)
        idx = torch.rand(M, E, device=dev, generator=g).topk(K, dim=-1).indices               # (M, K) distinct
        w = torch.rand(M, K, device=dev, generator=g).softmax(-1).to(dtype)
        return torch.randn(M, H, device=dev, dtype=dtype, generator=g), idx, w

    # 1) whole experts calls: grouped_mm (transformers) vs fused (the CONFIGS table)
    print(f"\n{'M':>4} {'experts':>7} {'MB':>7} | {'grouped_mm ms':>13} {'GB/s':>6} | {'fused ms':>8} {'GB/s':>6} "
          f"{'of peak':>7} {'speedup':>7} | {'rel err':>7}")
    with torch.no_grad():
        for M in map(int, args.tokens.split(",")):
            x, idx, w = routing(M)
            mb = idx.unique().numel() * expert_bytes / 1e6
            t_g = timer(lambda: mk.ALL_EXPERTS_FUNCTIONS["grouped_mm"](ex, x, idx, w))
            t_f = timer(lambda: mk.fused_moe(x, gu, dn, idx, w))
            ref = mk.ALL_EXPERTS_FUNCTIONS["grouped_mm"](ex, x, idx, w).float()
            err = ((mk.fused_moe(x, gu, dn, idx, w).float() - ref).norm() / ref.norm()).item()
            gbs_g, gbs_f = mb / t_g, mb / t_f                                      # MB/ms = GB/s
            print(f"{M:>4} {idx.unique().numel():>7} {mb:>7.1f} | {t_g:>13.3f} {gbs_g:>6.0f} | {t_f:>8.3f} "
                  f"{gbs_f:>6.0f} {gbs_f / HBM_GBS:>6.0%} {t_g / t_f:>6.2f}x | {err:>7.1e}", flush=True)

        # 2) sweep: each kernel alone, per block_m, over a few (block_n, block_k, warps, stages)
        if not args.sweep:
            return
        t0 = time.time()
        kcfgs = [mk.KernelCfg(bn, bk, 4, st) for bn, bk, st in itertools.product((32, 64, 128), (64, 128), (3, 4))]
        if dev == "cpu":
            kcfgs = [mk.KernelCfg(16, 32, 4, 1), mk.KernelCfg(32, 64, 4, 1)]
        best = {}
        print(f"\nsweep: {len(kcfgs)} configs per kernel; ms of each kernel alone (median)")
        for M in map(int, args.sweep_tokens.split(",")):
            x, idx, w = routing(M)
            mb = idx.unique().numel() * expert_bytes / 1e6
            for bm in (16, 32, 64) if M >= 64 else (16,):
                order, block_expert, total = mk.align(idx, E, bm)
                h = torch.empty(M * K, I, dtype=dtype, device=dev)
                out = torch.empty(M * K, H, dtype=dtype, device=dev)
                S, nb, rw = M * K, block_expert.shape[0], w.reshape(-1)
                kw = dict(BLOCK_M=bm, UPCAST=mk.INTERPRET, PRECISION=mk.dot_precision(dtype))

                def gate_up(c):
                    mk._gate_up_kernel[(nb, mk.triton.cdiv(I, c.block_n))](
                        x, gu, h, order, block_expert, total, S, I, K, x.stride(0), *gu.stride(), h.stride(0),
                        K=H, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.warps, num_stages=c.stages, **kw)

                def down(c):
                    mk._down_kernel[(nb, mk.triton.cdiv(H, c.block_n))](
                        h, dn, out, rw, order, block_expert, total, S, H, h.stride(0), *dn.stride(), out.stride(0),
                        K=I, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.warps, num_stages=c.stages, **kw)

                res = {}
                for name, fn in (("gate_up", gate_up), ("down", down)):
                    ts = []
                    for c in kcfgs:
                        try:
                            ts.append((timer(lambda: fn(c)), c))
                        except Exception as e:  # e.g. out of shared memory: skip the config
                            print(f"  M={M} bm={bm} {name} {tuple(c)}: {type(e).__name__}")
                    res[name] = min(ts)
                tot = res["gate_up"][0] + res["down"][0]
                print(f"  M={M:>4} bm={bm:>2}: gate_up {res['gate_up'][0]:.3f} ms {tuple(res['gate_up'][1])}, "
                      f"down {res['down'][0]:.3f} ms {tuple(res['down'][1])} -> {tot:.3f} ms, "
                      f"{mb / tot:.0f} GB/s ({mb / tot / HBM_GBS:.0%} of peak)", flush=True)
                if M not in best or tot < best[M][0]:
                    best[M] = (tot, mk.MoeCfg(bm, res["gate_up"][1], res["down"][1]))
        print(f"sweep took {time.time() - t0:.0f} s; for moe_kernel.CONFIGS (bound = the swept M, last = "
              f"MAX_TOKENS):\nCONFIGS = [")
        for i, (M, (_, c)) in enumerate(sorted(best.items())):
            bound = M if i < len(best) - 1 else "MAX_TOKENS"
            print(f"    ({bound}, MoeCfg({c.block_m}, KernelCfg{tuple(c.gate_up)}, KernelCfg{tuple(c.down)})),")
        print("]")


if __name__ == "__main__":
    main()
