"""Fused MoE experts for decode: three Triton kernels behind transformers' experts interface (name "fused").

Why: at the Qwen3-30B-A3B shape a 32-row decode step touches ~110 of 128 experts per layer, ~1.05 GB of
expert weights (50 GB over 48 layers, ~11 ms at the H200's 4.8 TB/s), yet transformers' `grouped_mm` path
spends ~18 ms in its CUTLASS grouped GEMM plus ~3 ms of routing sort/gather/index and a tail of small
elementwise kernels (docs/RESULTS.md §3). With ~2 tokens per expert nothing is compute: the experts are a
weight stream, and the job is to read every touched expert's weights exactly once, at full bandwidth, in
as few launches as possible. The idea is vLLM's fused_moe; the code is our own:
  1. `_align_kernel` (one program per expert): histogram of the S = tokens * top_k routing pairs, each
     expert's pairs padded to a multiple of BLOCK_M, laid out expert by expert (`order`), the expert of each
     BLOCK_M block (`block_expert`) and the padded total. Replaces sort + histc + cumsum + gathers.
  2. `_gate_up_kernel`: per (block, N tile), gate and up tiles of one expert against the block's gathered
     token rows, SiLU(gate) * up in the epilogue -> h (S, I) in the weights' dtype.
  3. `_down_kernel`: h @ down^T times the pair's routing weight -> (S, H) at the pair's own row, so the
     sum over top-k reads each token's K rows in a fixed order (`_topk_sum_kernel`: no inverse permutation,
     deterministic, no atomics).
No host syncs and no data-dependent shapes: buffers and grids are sized by the worst case
S + min(E, S) * (BLOCK_M - 1) padded pairs, and blocks past the padded total (read on the device) exit at
once, so the path replays inside the engine's CUDA graphs. Triton compiles on the first (eager) call.

Covers: Qwen3-MoE style experts (`gate_up_proj` (E, 2I, H) concatenated [gate; up], `down_proj` (E, H, I),
or the transposed layout), SiLU gating, any token count up to MAX_TOKENS, bf16/fp16/fp32, weights that a peft
`target_parameters` LoRA parametrizes (the forward reads `self.gate_up_proj`, which is then base + delta).
Above MAX_TOKENS (prefill: compute-bound, CUTLASS wins) `grouped_moe` runs transformers' grouped_mm algorithm
on CUDA without its masked fills. Falls back to transformers' `grouped_mm` (same arguments) for: autograd
(these kernels have no backward), biases, non-SiLU or custom gates, interleaved gate/up, post-expert norms,
expert parallelism, no tokens, CPU tensors outside the Triton interpreter, and CPU tensors above MAX_TOKENS.
Does not cover: fp8/int weights, split-K for very few experts (M = 1 runs 8 experts' tiles).

Block sizes: CONFIGS by token count; scripts/bench_moe.py sweeps a few and prints the best for the H200.
Tests: python -m pytest -q tests/test_moe_kernel.py   (CPU: the Triton interpreter, set by tests/conftest.py)
Bench: python scripts/bench_moe.py                   (H200, < 90 s)
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

try:
    from transformers.integrations.moe import _default_apply_gate   # 5.24; absent: the class's own forward
except ImportError:
    _default_apply_gate = None
try:
    import triton
    import triton.language as tl
    TRITON_ERROR = None
except ImportError as e:  # CPU CI may not have it: the name is then simply not registered
    triton, tl, TRITON_ERROR = None, None, e

NAME = "fused"
MAX_TOKENS = 256          # more tokens than this: transformers' grouped_mm (prefill)
_LIVE: list = [None]      # (T,) bool while `live_tokens` is active
ALIGN_BLOCK_S = 512       # routing pairs per loop step of `_align_kernel`


@contextlib.contextmanager
def live_tokens(live: torch.Tensor | None):
    """Inside the block, fused experts calls over live.shape[0] tokens skip the tokens where live is False (their
    experts' output is 0). engine.Engine marks the padding and the finished rows that its static batches
    carry: identical pad tokens all route to the same 8 experts, whose weights are then read once per BLOCK_M
    of them, and a finished row's token touches 8 experts of its own."""
    _LIVE[0] = live
    try:
        yield
    finally:
        _LIVE[0] = None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class KernelCfg(NamedTuple):
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4


class MoeCfg(NamedTuple):
    block_m: int
    gate_up: KernelCfg
    down: KernelCfg


# (max tokens, config): the first entry whose bound covers the call's token count. Swept on an H200 by
# `python scripts/bench_moe.py --sweep-tokens 8,32,128` (docs/RESULTS.md §3): 71-82 % of the HBM bound.
CONFIGS = [
    (8, MoeCfg(16, KernelCfg(32, 128, 4, 4), KernelCfg(32, 128, 4, 4))),
    (32, MoeCfg(16, KernelCfg(32, 128, 4, 4), KernelCfg(64, 128, 4, 3))),
    (128, MoeCfg(16, KernelCfg(128, 128, 4, 3), KernelCfg(128, 128, 4, 4))),
    (MAX_TOKENS, MoeCfg(32, KernelCfg(64, 128, 4, 3), KernelCfg(64, 128, 4, 3))),   # --sweep-tokens 256
]


def pick_config(tokens: int) -> MoeCfg:
    return next(c for bound, c in CONFIGS if tokens <= bound)


# The pair count S changes with the token count: left unspecialized, as fused_ops' lengths (one compiled
# variant, not one per divisibility of S by 16 that a prefill happens to hit).
if triton is not None:
    @triton.jit
    def _pair_ids(ids_ptr, live_ptr, offs, S, top_k, HAS_LIVE: tl.constexpr):
        """Expert ids of pairs offs (int32), -1 past S and for the pairs of tokens that are not live."""
        ok = offs < S
        if HAS_LIVE:
            ok = ok & (tl.load(live_ptr + offs // top_k, mask=ok, other=0) != 0)
        return tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)

    @triton.jit(do_not_specialize=["S"])
    def _align_kernel(ids_ptr, live_ptr, order_ptr, block_expert_ptr, total_ptr, S, E, top_k,
                      E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, HAS_LIVE: tl.constexpr):
        """Program e: place expert e's pairs (ascending pair id) at its padded offset; pad slots get S.
        E_PAD > E bins: ids < 0 (no expert), pairs of tokens t with live[t] False (HAS_LIVE) and masked lanes
        count in the last bin, which no expert owns."""
        e = tl.program_id(0)
        experts = tl.arange(0, E_PAD)
        counts = tl.zeros((E_PAD,), tl.int32)
        s0 = 0
        while s0 < S:   # while, not range: triton 3.6's interpreter cannot index with a runtime bound (numpy 2.4)
            offs = s0 + tl.arange(0, BLOCK_S)
            ids = _pair_ids(ids_ptr, live_ptr, offs, S, top_k, HAS_LIVE)
            counts += tl.histogram(tl.where(ids < 0, E_PAD - 1, ids), E_PAD)   # shared-memory histogram
            s0 += BLOCK_S
        padded = tl.where(experts < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)   # (E_PAD,)
        ends = tl.cumsum(padded, axis=0)
        mine = experts == e
        start = tl.sum(tl.where(mine, ends - padded, 0))
        count = tl.sum(tl.where(mine, counts, 0))
        n_pad = tl.sum(tl.where(mine, padded, 0))
        if e == 0:
            tl.store(total_ptr, tl.sum(padded))
        pos = start
        s0 = 0
        while s0 < S:                                                         # expert e's pairs, in order
            offs = s0 + tl.arange(0, BLOCK_S)
            hit = (_pair_ids(ids_ptr, live_ptr, offs, S, top_k, HAS_LIVE) == e).to(tl.int32)
            tl.store(order_ptr + pos + tl.cumsum(hit, axis=0) - 1, offs, mask=hit > 0)
            pos += tl.sum(hit)
            s0 += BLOCK_S
        pad = tl.arange(0, BLOCK_M)
        tl.store(order_ptr + start + count + pad, S + pad * 0, mask=count + pad < n_pad)
        b0 = 0
        while b0 < n_pad // BLOCK_M:                                          # the expert of each of its blocks
            b = b0 + tl.arange(0, 16)
            tl.store(block_expert_ptr + start // BLOCK_M + b, e + b * 0, mask=b < n_pad // BLOCK_M)
            b0 += 16

    @triton.jit(do_not_specialize=["S"])
    def _gate_up_kernel(x_ptr, w_ptr, h_ptr, order_ptr, block_expert_ptr, total_ptr, S, N, top_k,
                        stride_xm, stride_we, stride_wn, stride_wk, stride_hm,
                        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """h[p, n] = silu(x[p // top_k] . w[e, n]) * (x[p // top_k] . w[e, N + n]) for the block's pairs p."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        pairs = tl.load(order_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))   # (BM,), S = padding
        row_ok = pairs < S
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + (pairs // top_k)[:, None] * stride_xm + offs_k[None, :]                  # (BM, BK)
        g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # (BK, BN)
        u_ptrs = g_ptrs + N * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:   # the interpreter's tl.dot mis-reads bf16 operands
                x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(x, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, u, acc_u, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + pairs[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["S"])
    def _down_kernel(h_ptr, w_ptr, out_ptr, rw_ptr, order_ptr, block_expert_ptr, total_ptr, S, N,
                     stride_hm, stride_we, stride_wn, stride_wk, stride_om,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """out[p, n] = rw[p] * (h[p] . w[e, n]) for the block's pairs p."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        pairs = tl.load(order_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pairs < S
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + pairs[:, None] * stride_hm + offs_k[None, :]
        w_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        acc = acc * tl.load(rw_ptr + pairs, mask=row_ok, other=0).to(tl.float32)[:, None]
        tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _topk_sum_kernel(src_ptr, row_ptr, w_ptr, live_ptr, out_ptr, H, K: tl.constexpr, HAS_LIVE: tl.constexpr,
                         HAS_ROW: tl.constexpr, BLOCK_H: tl.constexpr):
        """Program (t, j): out[t, cols j] = sum_k src[t * K + k, cols j] in fp32, 0 where live[t] is False (those
        pairs were never computed: their rows of src are not read). HAS_ROW: pair p's row of src is row[p] and
        it is weighted by w[p] (grouped_moe's rows are sorted by expert and not yet weighted)."""
        t, j = tl.program_id(0), tl.program_id(1)
        offs = j * BLOCK_H + tl.arange(0, BLOCK_H)
        m = offs < H
        if HAS_LIVE:
            m_in = m & (tl.load(live_ptr + t) != 0)
        else:
            m_in = m
        acc = tl.zeros((BLOCK_H,), tl.float32)
        for k in tl.static_range(K):
            p = (t * K + k).to(tl.int64)
            if HAS_ROW:
                v = tl.load(src_ptr + tl.load(row_ptr + p).to(tl.int64) * H + offs, mask=m_in, other=0)
                acc += v.to(tl.float32) * tl.load(w_ptr + p).to(tl.float32)
            else:
                acc += tl.load(src_ptr + p * H + offs, mask=m_in, other=0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int, live: torch.Tensor | None = None):
    """Pairs grouped by expert, each group padded to block_m: (order (n_blocks * block_m,) int32 pair ids
    with S at pad slots, block_expert (n_blocks,) int32, total (1,) int32 padded pairs). Sized by the worst
    case, so the shapes depend only on (S, E, block_m); entries past `total` are left unwritten. live (T,)
    bool: the pairs of tokens where it is False are left out (as if their ids were -1)."""
    S = top_k_index.numel()
    n_blocks = triton.cdiv(S + min(num_experts, S) * (block_m - 1), block_m)
    dev = top_k_index.device
    order = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    # BLOCK_S: pairs per loop step. The histogram is tl.histogram's, so a long step costs little; a (64, E)
    # comparison matrix per step averaged 28 us a launch over an overlapped A3B call (mixed steps have 1,280
    # pairs), this 4.5-5.8 us (H200, docs/RESULTS.md §3)
    _align_kernel[(num_experts,)](top_k_index.reshape(-1), top_k_index if live is None else live, order,
                                  block_expert, total, S, num_experts, top_k_index.shape[-1],
                                  E_PAD=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
                                  BLOCK_S=min(ALIGN_BLOCK_S, triton.next_power_of_2(S)), HAS_LIVE=live is not None)
    return order, block_expert, total


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 weights: exact fp32 products (tf32 would be off by ~1e-3); half types: tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _nk_strides(w: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, out-feature, in-feature) strides of a (E, out, in) weight, or of an (E, in, out) one."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transposed else w.stride()


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor, transposed: bool = False, cfg: MoeCfg | None = None,
              live: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = top_k_index[t, k]: x (T, H) -> (T, H).

    gate_up (E, 2I, H) [gate; up] and down (E, H, I), or (E, H, 2I) and (E, I, H) with transposed=True.
    live (T,) bool: tokens where it is False get 0 and no pair (`align` leaves them out)."""
    T, H = x.shape
    top_k = top_k_index.shape[-1]
    E = gate_up.shape[0]
    I = gate_up.shape[2 if transposed else 1] // 2
    S = T * top_k
    cfg = cfg or pick_config(T)
    x = x.to(gate_up.dtype).contiguous()
    rw = top_k_weights.reshape(-1).contiguous()                                       # (S,)
    order, block_expert, total = align(top_k_index.contiguous(), E, cfg.block_m, live)
    n_blocks = block_expert.shape[0]
    h = torch.empty(S, I, dtype=gate_up.dtype, device=x.device)                       # (S, I)
    out = torch.empty(S, H, dtype=x.dtype, device=x.device)                           # (S, H) pairs
    kw = dict(BLOCK_M=cfg.block_m, UPCAST=INTERPRET, PRECISION=dot_precision(gate_up.dtype))
    c = cfg.gate_up
    _gate_up_kernel[(n_blocks, triton.cdiv(I, c.block_n))](
        x, gate_up, h, order, block_expert, total, S, I, top_k, x.stride(0), *_nk_strides(gate_up, transposed),
        h.stride(0), K=H, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.warps, num_stages=c.stages, **kw)
    c = cfg.down
    _down_kernel[(n_blocks, triton.cdiv(H, c.block_n))](
        h, down, out, rw, order, block_expert, total, S, H, h.stride(0), *_nk_strides(down, transposed),
        out.stride(0), K=I, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.warps, num_stages=c.stages, **kw)
    # the sum over top-k (fp32, one rounding) and the dead tokens' zeros in one launch: torch's `view(T, K, H)
    # .sum(1)` plus a zero fill of `out` were two launches a layer
    return topk_sum(out, T, top_k, live)


def topk_sum(src: torch.Tensor, T: int, K: int, live: torch.Tensor | None = None, rows: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H): out[t] = sum_k src[t * K + k] (or weights[t * K + k] * src[rows[t * K + k]]), fp32 sums, one
    rounding; 0 for tokens where live (T,) is False (their rows of src are never read). src (S', H)."""
    H = src.shape[1]
    y = torch.empty(T, H, dtype=src.dtype, device=src.device)                         # (T, H)
    block_h = min(1024, triton.next_power_of_2(H))
    _topk_sum_kernel[(T, triton.cdiv(H, block_h))](src, y if rows is None else rows, y if weights is None else weights,
                                                   y if live is None else live, y, H, K=K, HAS_LIVE=live is not None,
                                                   HAS_ROW=rows is not None, BLOCK_H=block_h)
    return y


def grouped_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, transposed: bool = False,
                live: torch.Tensor | None = None) -> torch.Tensor:
    """The same sum as `fused_moe` for prefill sizes: pairs sorted by expert, two `torch._grouped_mm` (CUTLASS on
    CUDA) calls. transformers' grouped_mm path does the same plus masked fills of every (pairs, H) and (pairs, 2I)
    intermediate (transformers 5.17; ~100 of 420 ms of a 12k-token A3B prefill, docs/RESULTS.md §3), which this
    path has no use for: no expert-parallel sentinels, no backward. live (T,) bool: the pairs of tokens where it is
    False (a prefill's right-padding) sort after every group, so no GEMM computes them, and their tokens get 0."""
    T, H = x.shape
    K, E = top_k_index.shape[-1], gate_up.shape[0]
    ids = top_k_index.reshape(-1)
    if live is not None:                                                              # expert E: no group's
        ids = torch.where(live[:, None].expand(T, K).reshape(-1), ids, E)
    ids, perm = torch.sort(ids)                                                       # (S,) pairs by expert
    offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), 0).int()  # (E,) group ends
    xs = x.to(gate_up.dtype)[perm // K]                                               # (S, H)
    gu = torch._grouped_mm(xs, gate_up if transposed else gate_up.transpose(1, 2), offs=offs)   # (S, 2I)
    I = gu.shape[1] // 2
    h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]                               # (S, I)
    y = torch._grouped_mm(h, down if transposed else down.transpose(1, 2), offs=offs)  # (S, H), rows past offs[-1]
    # unwritten. Each token's K rows, weighted and summed in one pass (`topk_sum` through the pair -> sorted row
    # map): a gather back to pair order and a (T, 1, K) @ (T, K, H) `bmm` were 10 + 18 of 354 ms of kernels of a
    # 32-row A3B admission (docs/RESULTS.md §3); a scatter `out[perm] = y` before them 59
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)                        # (S,) pair -> sorted row
    return topk_sum(y, T, K, live, rows=inv, weights=top_k_weights.reshape(-1))       # (T, H)


def why_not_fused(experts: torch.nn.Module, hidden_states: torch.Tensor, any_size: bool = False) -> str | None:
    """Why this call must take the grouped_mm path (see the module docstring), or None if the kernels apply.
    any_size: every condition but the token count (the caller then picks fused_moe or grouped_moe by size)."""
    w = experts.gate_up_proj if getattr(experts, "has_gate", True) else None
    checks = [
        (triton is None, f"triton not importable ({TRITON_ERROR})"),
        (not 0 < hidden_states.shape[0] <= (1 << 62 if any_size else MAX_TOKENS),
         f"{hidden_states.shape[0]} tokens (fused: 1..{MAX_TOKENS})"),
        (w is None or getattr(experts, "has_bias", False), "no gate or biased experts"),
        (getattr(experts, "has_post_expert_norm", False) or getattr(experts, "_is_expert_parallel", False),
         "post-expert norm or expert parallelism"),
        (not getattr(experts, "is_concatenated", True), "interleaved gate/up layout"),
        (getattr(type(experts), "_apply_gate", _default_apply_gate) not in (None, _default_apply_gate)
         or getattr(getattr(experts, "config", None), "hidden_act", "silu") not in ("silu", "swish"),
         "gate is not SiLU(gate) * up"),
        (w is not None and w.dtype not in (torch.bfloat16, torch.float16, torch.float32), "weight dtype"),
        (torch.is_grad_enabled() and (hidden_states.requires_grad or (w is not None and w.requires_grad)),
         "autograd (no backward)"),
        (hidden_states.device.type != "cuda" and not INTERPRET, "not CUDA and not TRITON_INTERPRET=1"),
    ]
    return next((why for bad, why in checks if bad), None)


def fused_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts-interface signature: hidden (T, H), top_k_index (T, K), top_k_weights (T, K)."""
    args = (hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights,
            getattr(self, "is_transposed", False))
    if why_not_fused(self, hidden_states, any_size=True) is None:
        live = _LIVE[0] if _LIVE[0] is not None and _LIVE[0].shape[0] == hidden_states.shape[0] else None
        if hidden_states.shape[0] <= MAX_TOKENS:
            return fused_moe(*args, live=live).to(hidden_states.dtype)
        if hidden_states.is_cuda:                                  # prefill: CUTLASS grouped GEMMs, unmasked
            return grouped_moe(*args, live=live).to(hidden_states.dtype)
    return ALL_EXPERTS_FUNCTIONS["grouped_mm"](self, hidden_states, top_k_index, top_k_weights)


def register() -> str:
    """Make `experts_implementation=NAME` available (Engine(experts=NAME) calls this); returns NAME."""
    if triton is None:
        raise RuntimeError(f"experts={NAME!r} needs triton, which is not importable here: {TRITON_ERROR}")
    ExpertsInterface.register(NAME, fused_experts_forward)
    return NAME
