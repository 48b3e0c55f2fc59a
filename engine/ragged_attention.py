"""The rollout engine's attention over its ragged KV arena (engine.Engine): the cache layer that writes each
row's new keys at its own columns, and the attention function registered with transformers for the engine's
calls only.

Row b of the arena holds its episode's tokens at columns [0, len_b) (column == RoPE position); the engine passes
a boolean mask (B, 1, q, C), True where a query may attend. Grouped-query attention reads K/V once: decode and
prefill fold the G query heads of a kv head into the query axis (transformers' sdpa path with a mask copies
K/V G times, 8x at the Qwen3-30B-A3B shape). `ATTN_NAME + "_triton"` takes the decode step through
fused_ops.decode_attention (each row's keys only up to its length). `attention_forward` replaces the attention
modules' forward for the engine's calls (`patch_attention`): fused q/k/v projections, then one kernel for the
q/k norms, rotary and the K/V write (fused_ops.attention_prologue).

Tests: python -m pytest -q tests/test_generate.py tests/test_fused_ops.py
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import fused_ops

ATTN_NAME = "cuda_agent_ragged"


def _per_forward(mask: torch.Tensor, name: str, make):
    """A tensor derived from this forward's mask: made by the first layer that asks, shared by the others."""
    if _PER_FORWARD.get("mask") is not mask:
        _PER_FORWARD.clear()
        _PER_FORWARD["mask"] = mask
    if name not in _PER_FORWARD:
        _PER_FORWARD[name] = make()
    return _PER_FORWARD[name]


_PER_FORWARD: dict = {}   # the forward's mask and what _per_forward made from it


class Feed(NamedTuple):
    """A mixed step's layout (engine.Engine): one flat batch of n_decode pending tokens, one per arena row, then
    feed tokens of rows being prefilled, in blocks of `block` tokens of one row each."""
    n_decode: int              # B
    rows: torch.Tensor         # (P,) arena row of each feed token
    pos: torch.Tensor          # (P,) its column (= RoPE position)
    lens: torch.Tensor         # (B,) columns each pending token attends (its own included)
    block: int                 # fused_ops.feed_block(G)


def begin_feed(feed: Feed) -> None:
    """The next forward is a mixed step laid out as `feed` (until `end_forward`)."""
    _PER_FORWARD.clear()
    _PER_FORWARD["feed"] = feed


def end_forward() -> None:
    """Drop what the last forward derived from its mask (the engine calls this after each forward)."""
    _PER_FORWARD.clear()


def _ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, decode=None, **kwargs):
    """query (B, Hq, q, D); key/value (B, Hkv, C, D) arena views; attention_mask (B, 1, q, C) bool (True = attend).

    Returns (B, q, Hq, D) like transformers' sdpa_attention_forward. decode: fused_ops.decode_attention for
    q = 1 (registered as ATTN_NAME + "_triton"), reading each row's keys only up to its length.
    """
    if "feed" in _PER_FORWARD:
        return _mixed_attention(query, key, value, _PER_FORWARD["feed"], _scale(query, scaling), decode), None
    B, Hq, q, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    if q == 1 and decode is not None and fused_ops.decode_attention_applies(query, key):
        lens = _per_forward(attention_mask, "lens", lambda: attention_mask[:, 0, 0].sum(-1))        # (B,)
        return decode(query, key, value, lens, D ** -0.5 if scaling is None else scaling), None
    # SDPA turns a boolean mask into an additive one in every call (two `where`s a layer: 33 of 343 ms of a
    # 12k-token A3B prefill); the additive masks are made once per forward and shared by the layers
    if q == 1:   # decode: the G heads sharing kv head h become G "queries" of h -> no K/V copy
        mask = _per_forward(attention_mask, "additive", lambda: _additive(attention_mask, query.dtype))
        out = F.scaled_dot_product_attention(query.reshape(B, Hkv, G, D), key, value,
                                             attn_mask=mask, scale=scaling)             # (B, Hkv, G, D)
        out = out.reshape(B, Hq, 1, D)
    elif G > 1 and G * q <= 2 * Hq * D:
        # prefill, grouped the same way: G * q queries per kv head, the mask repeated G times along the queries
        # (built once per forward, shared by the layers) instead of K/V repeated G times in every layer. The mask
        # is G*q*C*elem bytes a row, the K/V copy 2*Hq*C*D*elem: at the A3B shape with 385-token feeds over 1,600
        # columns the copy was 42 of 422 ms of a 32-row prefill (docs/RESULTS.md §3).
        mask = _per_forward(attention_mask, "grouped",
                            lambda: _additive(attention_mask, query.dtype).repeat(1, 1, G, 1))   # (B, 1, G*q, C)
        out = F.scaled_dot_product_attention(query.reshape(B, Hkv, G * q, D), key, value,
                                             attn_mask=mask, scale=scaling)              # (B, Hkv, G*q, D)
        out = out.reshape(B, Hq, q, D)
    else:        # long prefill feeds: copying K/V G times costs less than a G-times mask
        mask = _per_forward(attention_mask, "additive", lambda: _additive(attention_mask, query.dtype))
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(G, dim=1), value.repeat_interleave(G, dim=1),
                                             attn_mask=mask, scale=scaling)             # (B, Hq, q, D)
    return out.transpose(1, 2).contiguous(), None


def _scale(query: torch.Tensor, scaling: float | None) -> float:
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def _mixed_attention(query, key, value, feed: Feed, scale: float, decode) -> torch.Tensor:
    """A mixed step: query (1, Hq, N, D) = B pending tokens (token b of arena row b) then P feed tokens; key/value
    (R, Hkv, C, D), the whole arena (R > B: the scratch row). Returns (1, N, Hq, D)."""
    _, Hq, N, D = query.shape
    B, Hkv, C = feed.n_decode, key.shape[1], key.shape[2]
    G = Hq // Hkv
    out = query.new_empty(N, Hq, D)
    qd, kd, vd = query[0, :, :B].transpose(0, 1).unsqueeze(2), key[:B], value[:B]     # (B, Hq, 1, D), (B, Hkv, C, D)
    if decode is not None and fused_ops.decode_attention_applies(qd, kd):
        decode(qd, kd, vd, feed.lens, scale, out=out[:B])
    else:
        cols = torch.arange(C, device=query.device)
        mask = _additive((cols < feed.lens[:, None])[:, None, None], query.dtype)                 # (B, 1, 1, C)
        o = F.scaled_dot_product_attention(qd.reshape(B, Hkv, G, D), kd, vd, attn_mask=mask, scale=scale)
        out[:B] = o.reshape(B, Hq, D)
    qf = query[0, :, B:]                                                                          # (Hq, P, D)
    if decode is not None and fused_ops.feed_attention_applies(qf, key):   # the engine's attention="triton"
        fused_ops.feed_attention(qf, key, value, feed.rows, feed.pos, scale, out=out[B:])
    else:   # torch: each block of feed tokens against its row's K/V (gathered), the G heads folded in
        P, BQ = qf.shape[1], feed.block
        nb = P // BQ
        r = feed.rows[::BQ]                                                                       # (nb,)
        q = qf.reshape(Hkv, G, nb, BQ, D).permute(2, 0, 1, 3, 4).reshape(nb, Hkv, G * BQ, D)
        cols = torch.arange(C, device=query.device)
        ok = (cols <= feed.pos.view(nb, 1, BQ, 1)).repeat(1, G, 1, 1).reshape(nb, 1, G * BQ, C)
        o = F.scaled_dot_product_attention(q, key[r], value[r], attn_mask=_additive(ok, query.dtype), scale=scale)
        out[B:] = o.reshape(nb, Hkv, G, BQ, D).permute(0, 3, 1, 2, 4).reshape(P, Hq, D)
    return out[None]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as SDPA's additive one: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _ragged_attention_triton(*args, **kwargs):
    return _ragged_attention(*args, decode=fused_ops.decode_attention, **kwargs)


AttentionInterface.register(ATTN_NAME, _ragged_attention)
AttentionInterface.register(ATTN_NAME + "_triton", _ragged_attention_triton)


class RaggedLayer(StaticLayer):
    """A StaticLayer over arena views where row b writes its q new tokens at its own columns cols[b]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values = keys, values          # (B, Hkv, C, D) views of the arena
        self.rows, self.cols = rows, cols              # (B, 1), (B, q)
        self.is_initialized, self.device, self.dtype = True, keys.device, keys.dtype

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys[self.rows, :, self.cols] = key_states.transpose(1, 2)       # (B, q, Hkv, D)
        self.values[self.rows, :, self.cols] = value_states.transpose(1, 2)
        return self.keys, self.values


# ---- the attention module's forward for the engine's calls ---------------------------------------------------


def attention_forward(attn, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                      qkv_cache: dict | None = None, **kwargs):
    """An attention of fused_ops.ATTENTIONS over a RaggedLayer cache: the projections (one GEMM where q/k/v are
    plain bias-free Linears, see `_qkv_weight`), then `fused_ops.attention_prologue` (q/k norms, rotary, K/V
    written into the arena: one launch), the registered attention function, o_proj. Anything else (another
    cache, a device the kernel does not run on, autograd) takes the class's own forward.

    hidden_states (B, L, H); position_embeddings (cos, sin) (B or 1, L, D) -> ((B, L, H), None)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layer = cache.layers[attn.layer_idx] if isinstance(cache, Cache) else None
    D = attn.head_dim
    if not (isinstance(layer, RaggedLayer) and position_embeddings is not None
            and fused_ops.prologue_applies(hidden_states, position_embeddings[0], D, layer.keys)):
        return type(attn).forward(attn, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **kwargs)
    B, L, _ = hidden_states.shape
    w = _qkv_weight(attn, qkv_cache)
    if w is not None:                                        # (B, L, (Hq + 2 Hkv) D) split into column views
        nq, nk = attn.q_proj.out_features, attn.k_proj.out_features
        q, k, v = F.linear(hidden_states, w).split([nq, nk, nk], dim=-1)
    else:                                                    # module calls: a LoRA wrapper adds its delta
        q, k, v = attn.q_proj(hidden_states), attn.k_proj(hidden_states), attn.v_proj(hidden_states)
    cos, sin = position_embeddings
    query = fused_ops.attention_prologue(q.view(B, L, -1, D), k.view(B, L, -1, D), v.view(B, L, -1, D),
                                         getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), cos, sin,
                                         layer.keys, layer.values, layer.rows, layer.cols)      # (B, L, Hq, D)
    fn = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
    out, _ = fn(attn, query.transpose(1, 2), layer.keys, layer.values, attention_mask, dropout=0.0,
                scaling=attn.scaling)                                                           # (B, L, Hq, D)
    return attn.o_proj(out.reshape(B, L, -1)), None


def _qkv_weight(attn, qkv_cache: dict | None) -> torch.Tensor | None:
    """[W_q; W_k; W_v] ((Hq + 2 Hkv) D, H), made once and kept in qkv_cache while the three weights are the same
    tensors at the same version (an in-place optimizer step makes a new one); None where any projection is not a
    plain bias-free nn.Linear (a peft LoRA layer, biases) or there is no cache. One GEMM instead of three: k and v
    are 1/8 of q's size at the Qwen3-30B-A3B shape, so their GEMMs were launch-bound (about 1 GB for 48 layers)."""
    ps = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if qkv_cache is None or not all(type(p) is torch.nn.Linear and p.bias is None for p in ps):
        return None
    key = tuple((p.weight.data_ptr(), p.weight._version) for p in ps)
    hit = qkv_cache.get(id(attn))
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = qkv_cache[id(attn)] = (key, torch.cat([p.weight for p in ps]))
    return hit[1]


@contextlib.contextmanager
def patch_attention(modules: list, qkv_cache: dict | None = None):
    """Inside the block, the attention modules (fused_ops.targets(model).attentions) run `attention_forward`
    (an instance attribute shadows the class's forward until it is deleted)."""
    for m in modules:
        m.forward = functools.partial(attention_forward, m, qkv_cache=qkv_cache)
    try:
        yield
    finally:
        for m in modules:
            del m.forward
