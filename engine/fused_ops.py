"""One-launch replacements for chains of small kernels in a Llama/Qwen-style decoder layer, for the rollout engine.

Why: at the Qwen3-30B-A3B shape a 32-row decode step spent ~9 ms of ~34 in small elementwise kernels
(docs/RESULTS.md §3), each a few microseconds of launch and a trip through HBM for a few kilobytes. Three
chains made up most of them, per layer:
  * RMSNorm, HF's forward: two casts, pow, mean, add, rsqrt, two muls (four norms a layer). `rms_norm`:
    torch's one-op F.rms_norm; it rounds once, after the weight multiplies (a bf16 ulp at most).
  * rotary embedding, HF's `apply_rotary_pos_emb`: q * cos + rotate_half(q) * sin and the same for k, where
    rotate_half is two slices, a negation and a cat: ten kernels. `_rope_kernel`: one, for q and k.
  * the MoE router after its gate GEMM, HF's `Qwen3MoeTopKRouter`: an fp32 softmax over the experts, top-k,
    the top-k renormalised to sum 1, a cast: five or six kernels. `_router_kernel`: one (the GEMM stays cuBLAS).
The engine's attentions (ragged_attention.attention_forward) use `attention_prologue`: the q/k RMSNorms, the
rotary embedding and the K/V write into the arena in one launch after the projections. `copy_kv` moves KV
blocks between arena rows and caches in one launch.
`decode_attention` (the engine's default on CUDA, `Engine(attention="triton")`): one decode step's attention over
the engine's ragged KV arena, split-K flash decoding that reads each row's keys only up to its length, where
torch's SDPA with a boolean mask reads every arena column and the mask (~40 % of the KV-read bound at ~3,500
tokens of context); `feed_attention` the same for a mixed step's feed tokens. Tested against SDPA (fp32 on the
interpreter; bf16 and graph replay on a GPU).

The rotary and router kernels compute in fp32 and round once at the end, where HF rounds after each bf16 op:
outputs differ by about a bf16 ulp (the trainer recomputes log-probs with the model's own forward, paper §3.3).
In fp32 they agree to ~1e-6 and pick the same experts unless two router probabilities tie (then the lower
expert wins).

`patch(targets(model))` swaps them in for the engine's calls only (a context manager) on the modules `targets`
recognises: RMSNorm modules with a weight and `variance_epsilon`, attention modules whose forward calls a
module-level `apply_rotary_pos_emb` (Llama, Qwen2/3 and their MoE variants), routers of the classes in ROUTERS.
Calls the kernels do not cover fall back to HF's code: cos/sin not shaped (B, L, D) like q's head dim,
`unsqueeze_dim` other than 1, autograd, CPU tensors outside the Triton interpreter. Not covered: interleaved
(GPT-J style) or partial rotary embeddings, routers with a bias, grouped top-k or sigmoid scores (DeepSeek-V3),
more than 1,024 experts.

Tests: python -m pytest -q tests/test_fused_ops.py   (CPU: the Triton interpreter, set by tests/conftest.py)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import NamedTuple

import torch

from .moe_kernel import dot_precision

try:
    import triton
    import triton.language as tl
    TRITON_ERROR = None
except ImportError as e:  # CPU CI may not have it: patch() then changes nothing
    triton, tl, TRITON_ERROR = None, None, e

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROUTERS = ("Qwen3MoeTopKRouter",)   # softmax -> top-k -> (renormalise) routers, HF's code as in transformers 5
# attentions whose forward is q/k/v projections, optional per-head q/k RMSNorms, HF's rotary embedding, the cache
# update, the attention function and o_proj, nothing else (no gates, sinks or partial rotary)
ATTENTIONS = ("Qwen3MoeAttention", "Qwen3Attention", "Qwen2MoeAttention", "Qwen2Attention", "LlamaAttention")
MAX_EXPERTS = 1024


# Integer arguments that change from call to call (lengths, token and pair counts) are left unspecialized
# (`do_not_specialize`): Triton compiles a variant of a kernel for each new divisibility by 16 (and == 1) of its
# int arguments, so a length that happened to be a multiple of 16 compiled one in the middle of a run.
if triton is not None:
    @triton.jit(do_not_specialize=["L"])
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, L, HQ, HK,
                     sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sc_b, sc_l,
                     HALF: tl.constexpr, BLOCK: tl.constexpr):
        """Program (b * L + l, h): head h of token (b, l); h < HQ is a query head, the rest key heads.
        out[:half] = x1 * cos[:half] - x2 * sin[:half], out[half:] = x2 * cos[half:] + x1 * sin[half:]."""
        bl, h = tl.program_id(0), tl.program_id(1)
        b, l = bl // L, bl % L
        d = tl.arange(0, BLOCK)
        m = d < HALF
        c1 = tl.load(cos_ptr + b * sc_b + l * sc_l + d, mask=m, other=0).to(tl.float32)
        c2 = tl.load(cos_ptr + b * sc_b + l * sc_l + HALF + d, mask=m, other=0).to(tl.float32)
        s1 = tl.load(sin_ptr + b * sc_b + l * sc_l + d, mask=m, other=0).to(tl.float32)
        s2 = tl.load(sin_ptr + b * sc_b + l * sc_l + HALF + d, mask=m, other=0).to(tl.float32)
        if h < HQ:
            src = q_ptr + b * sq_b + h * sq_h + l * sq_l
            dst = qo_ptr + b * sq_b + h * sq_h + l * sq_l
        else:
            src = k_ptr + b * sk_b + (h - HQ) * sk_h + l * sk_l
            dst = ko_ptr + b * sk_b + (h - HQ) * sk_h + l * sk_l
        x1 = tl.load(src + d, mask=m, other=0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=m, other=0).to(tl.float32)
        tl.store(dst + d, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=m)
        tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def _router_kernel(logits_ptr, w_ptr, idx_ptr, E, stride_t,
                       TOP_K: tl.constexpr, NORM: tl.constexpr, E_PAD: tl.constexpr):
        """Program t: softmax over token t's E logits (fp32), the TOP_K largest in descending order (ties: the
        lower expert), renormalised to sum 1 when NORM, written as weights (logits' dtype) and int64 ids."""
        t = tl.program_id(0)
        e = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + t * stride_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(e < E, p, -1.0)
        k = tl.arange(0, TOP_K)
        vals = tl.zeros((TOP_K,), tl.float32)
        ids = tl.zeros((TOP_K,), tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            arg = tl.min(tl.where(p == best, e, E_PAD), axis=0)        # the lowest expert among ties
            vals = tl.where(k == j, best, vals)
            ids = tl.where(k == j, arg.to(tl.int64), ids)
            p = tl.where(e == arg, -1.0, p)
        if NORM:
            vals = vals / tl.sum(vals, axis=0)
        tl.store(w_ptr + t * TOP_K + k, vals.to(w_ptr.dtype.element_ty))
        tl.store(idx_ptr + t * TOP_K + k, ids)


    @triton.jit
    def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, part_ptr, SPLIT, sq_b, sq_h, sk_b, sk_h, sk_c,
                            sv_b, sv_h, sv_c, scale, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """Program (b, h, s): the G query heads of kv head h of row b against columns [s*SPLIT, (s+1)*SPLIT) of
        the row's first lens[b] columns, online softmax; writes (acc (G, D), max, sum) to part[b, h, s]."""
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = tl.load(lens_ptr + b).to(tl.int32)
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
        g, d = tl.arange(0, G_PAD), tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + (h * G + g[:, None]) * sq_h + d[None, :], mask=g[:, None] < G, other=0)
        m = tl.full((G_PAD,), float("-inf"), tl.float32)
        l = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        start = lo
        while start < hi:   # while, not range: the interpreter cannot run a range with runtime bounds here
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < hi
            k = tl.load(k_ptr + b * sk_b + h * sk_h + cols[:, None] * sk_c + d[None, :], mask=ok[:, None], other=0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale                  # (G_PAD, BLOCK_N)
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + b * sv_b + h * sv_h + cols[:, None] * sv_c + d[None, :], mask=ok[:, None], other=0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
            start += BLOCK_N
        base = part_ptr + ((b * tl.num_programs(1) + h) * tl.num_programs(2) + s) * G * (D + 2)
        rows = g[:, None] < G
        tl.store(base + g[:, None] * (D + 2) + d[None, :], acc, mask=rows)
        tl.store(base + g * (D + 2) + D, m, mask=g < G)
        tl.store(base + g * (D + 2) + D + 1, l, mask=g < G)

    @triton.jit(do_not_specialize=["nsplit"])
    def _decode_combine_kernel(part_ptr, out_ptr, so_b, nsplit, G: tl.constexpr, D: tl.constexpr,
                               S_PAD: tl.constexpr):
        """Program (b, h, g): the splits' partial softmaxes merged -> out[b, 0, h*G + g, :]."""
        b, h, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        sp, d = tl.arange(0, S_PAD), tl.arange(0, D)
        base = part_ptr + (b * tl.num_programs(1) + h) * nsplit * G * (D + 2) + g * (D + 2)
        at = base + sp * G * (D + 2)
        m = tl.load(at + D, mask=sp < nsplit, other=float("-inf"))
        l = tl.load(at + D + 1, mask=sp < nsplit, other=0)
        w = tl.where(m > float("-inf"), tl.exp(m - tl.max(m, axis=0)), 0.0)               # empty splits: 0
        acc = tl.load(at[:, None] + d[None, :], mask=(sp < nsplit)[:, None], other=0)   # (S_PAD, D)
        o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + b * so_b + (h * G + g) * D + d, o.to(out_ptr.dtype.element_ty))


    @triton.jit
    def _feed_attn_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, part_ptr, out_ptr, SPLIT, sq_h, sq_t, sk_b, sk_h,
                          sk_c, sv_b, sv_h, sv_c, so_t, scale, G: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr,
                          D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr):
        """Program (i, h, s): feed tokens [i*BQ, (i+1)*BQ), all in arena row rows[i*BQ], with the G query heads of
        kv head h folded in (query row m = token j * G + head g, M >= G*BQ rows), against the row's columns
        [s*SPLIT, (s+1)*SPLIT); token t attends columns [0, pos[t]] (its own key included: the cache was written
        before attention). Online softmax; writes (acc (D,), max, sum) per (token, head) to part[t, h, s] for
        `_decode_combine_kernel` (a query row with no column in the split: max -inf, weight 0 there); DIRECT (one
        split): the normalised output straight to out[t, h*G + g]."""
        i, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t0 = i * BQ
        r = tl.load(rows_ptr + t0)
        mm = tl.arange(0, M)
        valid = mm < G * BQ
        t = t0 + mm // G
        g = mm % G
        p = tl.load(pos_ptr + t, mask=valid, other=0).to(tl.int32)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (h * G + g)[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=valid[:, None],
                    other=0)
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, tl.max(p, axis=0) + 1)
        m_i = tl.full((M,), float("-inf"), tl.float32)
        l_i = tl.zeros((M,), tl.float32)
        acc = tl.zeros((M, D), tl.float32)
        start = lo
        while start < hi:   # while, not range: the interpreter cannot run a range with runtime bounds here
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < hi
            k = tl.load(k_ptr + r * sk_b + h * sk_h + cols[:, None] * sk_c + d[None, :], mask=ok[:, None], other=0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale                       # (M, BLOCK_N)
            sc = tl.where(cols[None, :] <= p[:, None], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)    # rows with nothing yet: p = 0, not NaN
            pr = tl.exp(sc - m_ref[:, None])
            alpha = tl.exp(m_i - m_ref)
            v = tl.load(v_ptr + r * sv_b + h * sv_h + cols[:, None] * sv_c + d[None, :], mask=ok[:, None], other=0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            m_i = m_new
            start += BLOCK_N
        if DIRECT:
            o = acc / l_i[:, None]
            tl.store(out_ptr + t[:, None] * so_t + (h * G + g)[:, None] * D + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            base = part_ptr + ((t * tl.num_programs(1) + h) * tl.num_programs(2) + s) * G * (D + 2) + g * (D + 2)
            tl.store(base[:, None] + d[None, :], acc, mask=valid[:, None])
            tl.store(base + D, m_i, mask=valid)
            tl.store(base + D + 1, l_i, mask=valid)


    @triton.jit(do_not_specialize=["L", "s_rb", "s_rl", "s_pb", "s_pl"])
    def _prologue_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, rows_ptr,
                         cols_ptr, L, HQ, eps_q, eps_k, s_qb, s_ql, s_kb, s_kl, s_vb, s_vl, s_cb, s_cl, s_rb,
                         s_rl, s_pb, s_pl, s_kcb, s_kch, s_kcc, s_vcb, s_vch, s_vcc, D: tl.constexpr,
                         NORM: tl.constexpr, BLOCK: tl.constexpr):
        """Program (t, h), token t = b * L + l: h < HQ: query head h -> qo[t, h]; else key and value head
        h - HQ -> the arena at (rows[b, l], h - HQ, cols[b, l]). Heads are RMS-normalised (NORM) and rotated in
        fp32 and rounded once."""
        t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, l = t // L, t % L
        HALF: tl.constexpr = D // 2
        d = tl.arange(0, BLOCK)
        m = d < HALF
        c1 = tl.load(cos_ptr + b * s_cb + l * s_cl + d, mask=m, other=0).to(tl.float32)
        c2 = tl.load(cos_ptr + b * s_cb + l * s_cl + HALF + d, mask=m, other=0).to(tl.float32)
        s1 = tl.load(sin_ptr + b * s_cb + l * s_cl + d, mask=m, other=0).to(tl.float32)
        s2 = tl.load(sin_ptr + b * s_cb + l * s_cl + HALF + d, mask=m, other=0).to(tl.float32)
        is_q = h < HQ
        if is_q:
            src, w_ptr, eps = q_ptr + b * s_qb + l * s_ql + h * D, qw_ptr, eps_q
        else:
            src, w_ptr, eps = k_ptr + b * s_kb + l * s_kl + (h - HQ) * D, kw_ptr, eps_k
        x1 = tl.load(src + d, mask=m, other=0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=m, other=0).to(tl.float32)
        if NORM:
            r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            x1 = x1 * r * tl.load(w_ptr + d, mask=m, other=0).to(tl.float32)
            x2 = x2 * r * tl.load(w_ptr + HALF + d, mask=m, other=0).to(tl.float32)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        if is_q:
            dst = qo_ptr + (t * HQ + h) * D
            tl.store(dst + d, o1.to(qo_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + d, o2.to(qo_ptr.dtype.element_ty), mask=m)
        else:
            hk = h - HQ
            row = tl.load(rows_ptr + b * s_rb + l * s_rl).to(tl.int64)
            col = tl.load(cols_ptr + b * s_pb + l * s_pl).to(tl.int64)
            kd = kc_ptr + row * s_kcb + hk * s_kch + col * s_kcc
            tl.store(kd + d, o1.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(kd + HALF + d, o2.to(kc_ptr.dtype.element_ty), mask=m)
            vs = v_ptr + b * s_vb + l * s_vl + hk * D
            vd = vc_ptr + row * s_vcb + hk * s_vch + col * s_vcc
            tl.store(vd + d, tl.load(vs + d, mask=m), mask=m)
            tl.store(vd + HALF + d, tl.load(vs + HALF + d, mask=m), mask=m)


    @triton.jit(do_not_specialize=["n"])
    def _copy_kv_kernel(src_ptr, dst_ptr, n, H, s0, s1, s2, s3, d0, d1, d2, d3, D: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        """Program (i, j), i = (layer * 2 + kv) * H + head: rows [j * BLOCK_N, (j + 1) * BLOCK_N) of that (n, D)
        slab; int64 offsets throughout."""
        i, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
        a, h = i // H, i % H
        layer, kv = a // 2, a % 2
        r = j * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, D)
        m = (r < n)[:, None]
        src = src_ptr + layer * s0 + kv * s1 + h * s2 + r.to(tl.int64)[:, None] * s3 + d[None, :]
        dst = dst_ptr + layer * d0 + kv * d1 + h * d2 + r.to(tl.int64)[:, None] * d3 + d[None, :]
        tl.store(dst, tl.load(src, mask=m), mask=m)


def _runs_here(*ts: torch.Tensor) -> bool:
    """The kernels apply: triton is importable, no autograd, CUDA tensors (or CPU ones under the interpreter)."""
    return (triton is not None and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))
            and all(t.device.type == "cuda" or (INTERPRET and t.device.type == "cpu") for t in ts))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, L, D), k (B, Hkv, L, D) (any strides with a unit last one), cos/sin (B, L, D) -> rotated q, k."""
    B, HQ, L, D = q.shape
    HK = k.shape[1]
    cos, sin = cos.expand(B, L, D), sin.expand(B, L, D)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo, ko = torch.empty_like(q), torch.empty_like(k)   # same strides as q, k (dense, non-overlapping views)
    _rope_kernel[(B * L, HQ + HK)](q, k, qo, ko, cos, sin, L, HQ, HK,
                                   q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                   cos.stride(0), cos.stride(1),
                                   HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2))
    return qo, ko


def rope_applies(q, k, cos, sin, unsqueeze_dim: int) -> bool:
    D = q.shape[-1]
    return (unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and cos.shape[-1] == D and k.shape[-1] == D and D % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
            and q.shape[2] == k.shape[2] == cos.shape[1] and cos.shape[0] in (1, q.shape[0]) and q.dtype == k.dtype
            and _runs_here(q, k, cos, sin))


def copy_kv(dst: torch.Tensor, src: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """dst[...] = src for KV blocks (layers, 2, Hkv, n, D), arena views or contiguous caches, in one launch.

    Why: an arena row's view spans more than 2^31 elements of the arena, so torch splits its copy into several
    launches of its unvectorised strided kernel: a 3,500-token row at the A3B shape took 0.47 ms in 8 launches
    on an H200, this kernel 0.20 ms (3.5 TB/s read + write; scripts/bench_kv_host.py), for every cache stored,
    reloaded or moved. kernel None: the kernel on CUDA tensors, torch's `copy_` on CPU ones (True: the kernel
    wherever it runs, e.g. under the interpreter); `copy_` where it cannot run or D is not a power of two."""
    D = src.shape[-1]
    if kernel is None:
        kernel = src.is_cuda
    if not kernel or triton is None or src.shape != dst.shape or src.dim() != 5 or src.shape[1] != 2 or D < 16 \
            or D != triton.next_power_of_2(D) \
            or src.stride(-1) != 1 or dst.stride(-1) != 1 or src.dtype != dst.dtype or not _runs_here(src, dst):
        return dst.copy_(src)
    L, two, H, n, _ = src.shape
    if src.numel():
        block = max(1, min(64, 8192 // D))
        _copy_kv_kernel[(L * two * H, triton.cdiv(n, block))](src, dst, n, H, *src.stride()[:4], *dst.stride()[:4],
                                                             D=D, BLOCK_N=block)
    return dst


def prologue_applies(hidden: torch.Tensor, cos: torch.Tensor, head_dim: int, keys: torch.Tensor) -> bool:
    """hidden (B, L, H) and cos (B or 1, L, head_dim) on a device that runs the kernel; arena keys with unit
    last stride; an even head_dim."""
    return (triton is not None and hidden.dim() == 3 and cos.dim() == 3 and cos.shape[-1] == head_dim
            and cos.shape[1] == hidden.shape[1] and cos.shape[0] in (1, hidden.shape[0]) and head_dim % 2 == 0
            and keys.stride(-1) == 1 and _runs_here(hidden, cos, keys))


def attention_prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm, k_norm, cos: torch.Tensor,
                       sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                       cols: torch.Tensor) -> torch.Tensor:
    """Everything between an attention's projections and its attention, in one launch: the per-head RMSNorms
    (Qwen3's q_norm / k_norm; None for Llama-style layers), the rotary embedding, and the new keys and values
    written into the cache at (rows, cols). Five to seven launches a layer before (two norms, the rotary kernel,
    two index writes, and the copies between them).

    q (B, L, Hq, D), k and v (B, L, Hkv, D) with heads D apart and a unit last stride (projection outputs,
    possibly column slices of one fused one); cos/sin (B or 1, L, D); keys/values (R, Hkv, C, D) arena views;
    rows, cols (B, L) (broadcast views welcome) -> the rotated queries (B, L, Hq, D), contiguous."""
    B, L, HQ, D = q.shape
    HK = k.shape[2]
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1 and q.stride(2) == k.stride(2) == v.stride(2) == D
    cos, sin = cos.expand(B, L, D), sin.expand(B, L, D)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    rows, cols = rows.expand(B, L), cols.expand(B, L)
    norm = q_norm is not None
    qo = torch.empty(B, L, HQ, D, dtype=q.dtype, device=q.device)
    _prologue_kernel[(B * L, HQ + HK)](
        q, k, v, q_norm.weight if norm else q, k_norm.weight if norm else k, cos, sin, qo, keys, values, rows, cols,
        L, HQ, q_norm.variance_epsilon if norm else 0.0, k_norm.variance_epsilon if norm else 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), cos.stride(1),
        rows.stride(0), rows.stride(1), cols.stride(0), cols.stride(1), *keys.stride()[:3], *values.stride()[:3],
        D=D, NORM=norm, BLOCK=triton.next_power_of_2(D // 2))
    return qo


def route(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) -> (weights (T, top_k) in logits' dtype, ids (T, top_k) int64), as the module docstring says."""
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    if T:
        _router_kernel[(T,)](logits, w, ids, E, logits.stride(0), TOP_K=top_k, NORM=bool(norm),
                             E_PAD=triton.next_power_of_2(E))
    return w, ids


DECODE_BLOCK_N = 64        # key columns per inner step of the decode attention
DECODE_SPLIT_MIN = 512     # columns per program at least; more columns -> more programs per (row, kv head)
DECODE_SPLIT_MAX = 16      # programs per (row, kv head) at most; the split count is a runtime argument (the
                           # kernels compile once, not once per arena width)


def decode_attention_applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """query (B, Hq, 1, D) and key (B, Hkv, C, D) with unit last strides, D a power of two, on a device that
    runs the kernel."""
    if triton is None:
        return False
    D = query.shape[-1]
    return (query.shape[2] == 1 and D == triton.next_power_of_2(D) and D >= 16 and query.stride(-1) == 1
            and key.stride(-1) == 1 and query.shape[1] % key.shape[1] == 0 and query.dtype == key.dtype
            and _runs_here(query, key))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: torch.Tensor,
                     scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step's attention over a ragged KV arena: row b attends its first lens[b] columns only.

    query (B, Hq, 1, D); key/value (B, Hkv, C, D) (arena views, any strides with a unit last one); lens (B,)
    -> (B, 1, Hq, D). Split-K flash decoding: each program reads one (row, kv head, column range) and the G
    query heads that share the kv head ride along in one tile, so K/V are read once per row and only up to
    the row's length (SDPA with a boolean mask reads all C columns and the mask). The number of splits depends
    on C only, so the launch replays in a CUDA graph while lengths change; it is a runtime argument, so a wider
    arena does not compile the kernels again. out: (B, Hq * D) elements a row with unit head and last strides
    (a mixed step's rows of its attention output), written in place."""
    B, HQ, _, D = query.shape
    HK, C = key.shape[1], key.shape[2]
    G = HQ // HK
    nsplit = max(1, min(DECODE_SPLIT_MAX, C // DECODE_SPLIT_MIN))
    split = triton.cdiv(triton.cdiv(C, nsplit), DECODE_BLOCK_N) * DECODE_BLOCK_N
    part = torch.empty(B, HK, nsplit, G, D + 2, dtype=torch.float32, device=query.device)
    if out is None:
        out = torch.empty(B, 1, HQ, D, dtype=query.dtype, device=query.device)
    _decode_attn_kernel[(B, HK, nsplit)](
        query, key, value, lens, part, split, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        key.stride(2), value.stride(0), value.stride(1), value.stride(2), scale, G=G,
        G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=DECODE_BLOCK_N, PRECISION=dot_precision(query.dtype))
    _decode_combine_kernel[(B, HK, G)](part, out, out.stride(0), nsplit, G=G, D=D, S_PAD=DECODE_SPLIT_MAX)
    return out


FEED_ROWS = 64             # query rows (feed tokens x the query heads of one kv head) per program of feed_attention


def feed_block(G: int) -> int:
    """Feed tokens per program of `feed_attention` for G query heads per kv head: each arena row's chunk of a
    mixed step starts at a multiple of it (engine.Engine lays the feed slots out so)."""
    return max(1, FEED_ROWS // G)


def feed_attention_applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """query (Hq, P, D) and key (R, Hkv, C, D) with unit last strides, D a power of two, on a device that runs
    the kernel."""
    if triton is None:
        return False
    D = query.shape[-1]
    return (D == triton.next_power_of_2(D) and D >= 16 and query.stride(-1) == 1 and key.stride(-1) == 1
            and query.shape[0] % key.shape[1] == 0 and query.dtype == key.dtype and _runs_here(query, key))


def feed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                   pos: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The feed tokens' attention in a mixed step (engine.Engine): token t attends columns [0, pos[t]] of
    arena row rows[t]. query (Hq, P, D); key/value (R, Hkv, C, D) arena views; rows, pos (P,), P a multiple of
    feed_block(G), each block's tokens in one row (padding slots: that row, position 0) -> (P, Hq, D) (into
    out, like decode_attention's, when given)."""
    HQ, P, D = query.shape
    HK, C = key.shape[1], key.shape[2]
    G = HQ // HK
    BQ = feed_block(G)
    assert P % BQ == 0, f"{P} feed slots: not a multiple of the block {BQ}"
    # split-K over the columns as in decode_attention: a program's loop stays short and the grid fills the GPU
    # (one program per block and kv head ran ~50 serial iterations at 3,400 columns)
    nsplit = max(1, min(DECODE_SPLIT_MAX, C // DECODE_SPLIT_MIN))
    split = triton.cdiv(triton.cdiv(C, nsplit), DECODE_BLOCK_N) * DECODE_BLOCK_N
    part = torch.empty(P, HK, nsplit, G, D + 2, dtype=torch.float32, device=query.device) if nsplit > 1 else None
    if out is None:
        out = torch.empty(P, HQ, D, dtype=query.dtype, device=query.device)
    M = max(16, triton.next_power_of_2(G * BQ))
    _feed_attn_kernel[(P // BQ, HK, nsplit)](
        query, key, value, rows, pos, part if nsplit > 1 else out, out, split, query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), scale, G=G, BQ=BQ, M=M, D=D, BLOCK_N=DECODE_BLOCK_N, PRECISION=dot_precision(query.dtype),
        DIRECT=nsplit == 1)
    if nsplit > 1:
        _decode_combine_kernel[(P, HK, G)](part, out, out.stride(0), nsplit, G=G, D=D, S_PAD=DECODE_SPLIT_MAX)
    return out


def _router_forward(router, hidden_states: torch.Tensor):
    """Qwen3MoeTopKRouter.forward with the chain after the gate GEMM in one launch."""
    k = router.top_k
    if not (_runs_here(hidden_states, router.weight) and router.num_experts <= MAX_EXPERTS
            and k == triton.next_power_of_2(k)):
        return type(router).forward(router, hidden_states)
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)  # (T, E)
    w, ids = route(logits, k, router.norm_topk_prob)
    return logits, w, ids


def _rope_wrapper(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if args or kwargs or not rope_applies(q, k, cos, sin, unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return rope(q, k, cos, sin)
    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A Llama/Qwen RMSNorm module's forward as torch's one-op F.rms_norm: weight * x / rms(x), normalised in fp32.
    HF's forward casts the normalised x to x's dtype before the weight multiplies; this rounds once, after it
    (a bf16 ulp at most; the trainer recomputes log-probs with the model's own forward)."""
    return torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class Targets(NamedTuple):
    spaces: list[dict]                 # module globals holding the `apply_rotary_pos_emb` an attention calls
    routers: list[torch.nn.Module]     # routers of the classes in ROUTERS
    norms: list[torch.nn.Module]       # RMSNorms
    attentions: list[torch.nn.Module]  # attentions of the classes in ATTENTIONS (ragged_attention.attention_forward)


def targets(model: torch.nn.Module) -> Targets:
    """The modules `patch` swaps ops in for (see the module docstring)."""
    spaces, routers, norms, attentions = {}, [], [], []
    for m in model.modules():
        name = type(m).__name__
        if name in ROUTERS:
            routers.append(m)
        elif name.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None),
                                                                                          torch.Tensor):
            norms.append(m)
        elif name.endswith("Attention") and hasattr(type(m), "forward"):
            fwd = inspect.unwrap(type(m).forward)
            g = fwd.__globals__
            if callable(g.get("apply_rotary_pos_emb")) and "apply_rotary_pos_emb" in fwd.__code__.co_names:
                spaces[id(g)] = g
            if name in ATTENTIONS and (getattr(m, "q_norm", None) is None) == (getattr(m, "k_norm", None) is None):
                attentions.append(m)
    return Targets(list(spaces.values()), routers, norms, attentions)


@contextlib.contextmanager
def patch(t: Targets):
    """Route the norms, rotary embeddings and routers found by `targets` through the fused ops inside the block
    (the Triton ones only where triton is importable)."""
    spaces, routers = (t.spaces, t.routers) if triton is not None else ([], [])
    for g in spaces:
        g["apply_rotary_pos_emb"] = _rope_wrapper(g["apply_rotary_pos_emb"])
    for r in routers:   # an instance attribute shadows the class's forward until it is deleted
        r.forward = _router_forward.__get__(r)
    for m in t.norms:
        m.forward = functools.partial(rms_norm, m)
    try:
        yield
    finally:
        for g in spaces:
            g["apply_rotary_pos_emb"] = g["apply_rotary_pos_emb"].original
        for m in routers + t.norms:
            del m.forward
