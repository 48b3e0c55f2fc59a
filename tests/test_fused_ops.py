"""fused_ops (one-launch rotary embedding, MoE router and decode attention) against transformers' and torch's code.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py); on a GPU machine the same tests run compiled, plus bf16 checks and a CUDA-graph replay.
Skipped when triton is not importable.
"""
import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")
from engine import fused_ops  # noqa: E402

if not (CUDA or fused_ops.INTERPRET):
    pytest.skip("no CUDA and TRITON_INTERPRET != 1 when triton was imported", allow_module_level=True)

from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def rotary_inputs(B, L, HQ, HK, D, dtype, seed=0):
    """q, k as the attention makes them: (B, L, H, D) projections viewed as (B, H, L, D); cos/sin from HF's
    rotary module at ragged positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, HQ, D, generator=g).to(DEV, dtype).transpose(1, 2)
    k = torch.randn(B, L, HK, D, generator=g).to(DEV, dtype).transpose(1, 2)
    cfg = Qwen3MoeConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HK, head_dim=D)
    pos = torch.randint(0, 5000, (B, L), generator=g).to(DEV)
    cos, sin = hf.Qwen3MoeRotaryEmbedding(cfg).to(DEV)(q, pos)
    return q, k, cos, sin


@pytest.mark.parametrize("B,L,HQ,HK,D", [(3, 1, 4, 2, 16), (2, 7, 8, 4, 128), (1, 5, 6, 6, 24)])
def test_rope_matches_hf_fp32(B, L, HQ, HK, D):
    q, k, cos, sin = rotary_inputs(B, L, HQ, HK, D, torch.float32)
    assert fused_ops.rope_applies(q, k, cos, sin, 1)
    qo, ko = fused_ops.rope(q, k, cos, sin)
    qr, kr = hf.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(qo, qr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, kr, rtol=1e-5, atol=1e-5)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


@pytest.mark.parametrize("T,E,K,norm", [(1, 8, 2, True), (5, 128, 8, True), (9, 60, 4, False)])
def test_router_matches_hf_fp32(T, E, K, norm):
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm)
    torch.manual_seed(T)
    r = hf.Qwen3MoeTopKRouter(cfg).to(DEV)
    with torch.no_grad():
        r.weight.normal_()
        x = torch.randn(T, 32, device=DEV)
        logits, w, ids = fused_ops._router_forward(r, x)
        ref_logits, ref_w, ref_ids = r(x)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits)


def test_router_ties_pick_the_lower_expert():
    w, ids = fused_ops.route(torch.zeros(2, 16, device=DEV), 4, True)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2 and torch.allclose(w, torch.full_like(w, 0.25))


def test_fallbacks_take_hf_code():
    """What the kernels do not cover goes to HF's code, unchanged."""
    q, k, cos, sin = rotary_inputs(2, 3, 4, 2, 16, torch.float32)
    assert not fused_ops.rope_applies(q, k, cos, sin, 2)                                 # other unsqueeze_dim
    assert not fused_ops.rope_applies(q, k, cos[..., :8], sin[..., :8], 1)              # partial rotary
    assert fused_ops.rope_applies(q, k, cos[:1], sin[:1], 1)                             # cos/sin broadcast
    for a, b in zip(fused_ops.rope(q, k, cos[:1], sin[:1]), hf.apply_rotary_pos_emb(q, k, cos[:1], sin[:1])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not fused_ops.rope_applies(q[:1], k[:1], cos, sin, 1)                         # batch mismatch
    q.requires_grad_(True)
    assert not fused_ops.rope_applies(q, k, cos, sin, 1)                                 # autograd
    wrapped = fused_ops._rope_wrapper(hf.apply_rotary_pos_emb)
    qo, ko = wrapped(q, k, cos, sin)
    assert qo.requires_grad                                                              # HF's differentiable path


def test_patch_finds_and_restores(monkeypatch):
    """patch() swaps HF's rotary function and the routers' and norms' forward inside the block only, and the
    model's output under it equals HF's (fp32)."""
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = hf.Qwen3MoeForCausalLM(cfg).to(DEV).eval()
    t = fused_ops.targets(model)
    assert [g["__name__"] for g in t.spaces] == [hf.__name__] and len(t.routers) == 2 and len(t.norms) == 9
    calls = []
    for name, fn in (("rope", fused_ops.rope), ("route", fused_ops.route)):
        monkeypatch.setattr(fused_ops, name, lambda *a, _f=fn, _n=name, **k: calls.append(_n) or _f(*a, **k))
    ids = torch.randint(0, 64, (2, 6), device=DEV)
    hf_rope = hf.apply_rotary_pos_emb       # a function, or (transformers >= 5.25) a kernelized-function module
    with torch.no_grad():
        ref = model(ids).logits
        with fused_ops.patch(t):
            assert hf.apply_rotary_pos_emb is not hf_rope
            out = model(ids).logits
        again = model(ids).logits
    assert calls.count("rope") == 2 and calls.count("route") == 2                       # one per layer
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert hf.apply_rotary_pos_emb is hf_rope
    assert all("forward" not in vars(m) for m in t.routers + t.norms) and torch.equal(again, ref)


@pytest.mark.parametrize("B,L,HQ,HK,D,norm", [(3, 1, 4, 2, 16, True), (2, 5, 8, 4, 32, True), (1, 4, 6, 2, 24, False)])
def test_attention_prologue_matches_hf_fp32(B, L, HQ, HK, D, norm):
    """q/k RMSNorms (Qwen3's, or none as in Llama), HF's rotary embedding and the K/V written at each token's own
    arena row and column, against the modules and `apply_rotary_pos_emb`; q/k/v column slices of one projection
    output as the fused q/k/v GEMM makes them; nothing else of the arena changes."""
    q, k, cos, sin = rotary_inputs(B, L, HQ, HK, D, torch.float32, seed=B + L)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, L, (HQ + 2 * HK) * D, generator=g).to(DEV)
    qp, kp, vp = (t.view(B, L, -1, D) for t in qkv.split([HQ * D, HK * D, HK * D], dim=-1))
    qn, kn = (hf.Qwen3MoeRMSNorm(D, eps=1e-6).to(DEV) for _ in range(2)) if norm else (None, None)
    if norm:
        for n in (qn, kn):
            n.weight.data.copy_(torch.randn(D, generator=g))
    R, C = B + 2, L + 9
    arena = torch.randn(2, R, HK, C, D, generator=g).to(DEV)
    before = arena.clone()
    rows = torch.randperm(R, generator=g)[:B].to(DEV)[:, None]                       # (B, 1) as the engine passes
    cols = torch.stack([torch.randperm(C, generator=g)[:L] for _ in range(B)]).to(DEV)   # (B, L)
    with torch.no_grad():
        out = fused_ops.attention_prologue(qp, kp, vp, qn, kn, cos, sin, arena[0], arena[1], rows, cols)
        ref_q, ref_k = hf.apply_rotary_pos_emb((qn(qp) if norm else qp).transpose(1, 2),
                                               (kn(kp) if norm else kp).transpose(1, 2), cos, sin)
    torch.testing.assert_close(out, ref_q.transpose(1, 2), rtol=1e-5, atol=1e-5)
    written = torch.zeros(R, C, dtype=torch.bool)
    for b in range(B):
        for l in range(L):
            r, c = int(rows[b, 0]), int(cols[b, l])
            written[r, c] = True
            torch.testing.assert_close(arena[0, r, :, c], ref_k[b, :, l], rtol=1e-5, atol=1e-5)
            assert torch.equal(arena[1, r, :, c], vp[b, l])
    keep = ~written.to(DEV)
    assert torch.equal(arena.permute(0, 1, 3, 2, 4)[:, keep], before.permute(0, 1, 3, 2, 4)[:, keep])


@pytest.mark.parametrize("D", [16, 24])
def test_copy_kv_between_arena_rows_and_caches(D):
    """copy_kv's kernel (under the interpreter on CPU): an arena row's (layers, 2, Hkv, n, D) view out to a
    contiguous cache, back into another row, and row to row; the neighbouring rows and columns untouched. D = 24
    takes torch's copy_."""
    g = torch.Generator().manual_seed(D)
    arena = torch.randn(3, 2, 4, 2, 70, D, generator=g).to(DEV)                     # (L, 2, B, Hkv, C, D)
    before = arena.clone()
    src = arena[:, :, 1, :, :65]
    cache = fused_ops.copy_kv(torch.empty(src.shape, device=DEV), src, kernel=True)
    assert cache.is_contiguous() and torch.equal(cache, src)
    fused_ops.copy_kv(arena[:, :, 3, :, :65], cache, kernel=True)
    fused_ops.copy_kv(arena[:, :, 0, :, :30], arena[:, :, 2, :, :30], kernel=True)
    assert torch.equal(arena[:, :, 3, :, :65], before[:, :, 1, :, :65])
    assert torch.equal(arena[:, :, 0, :, :30], before[:, :, 2, :, :30])
    assert torch.equal(arena[:, :, 3, :, 65:], before[:, :, 3, :, 65:])
    assert torch.equal(arena[:, :, 1:3], before[:, :, 1:3])
    assert torch.equal(arena[:, :, 0, :, 30:], before[:, :, 0, :, 30:])


def test_qkv_weight_follows_in_place_updates():
    """The fused [W_q; W_k; W_v] is made again when a weight changes in place (an optimizer step), and not made
    for a projection with a bias."""
    from engine import ragged_attention
    cfg = Qwen3MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    attn = hf.Qwen3MoeAttention(cfg, layer_idx=0)
    cache = {}
    w = ragged_attention._qkv_weight(attn, cache)
    assert torch.equal(w, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert ragged_attention._qkv_weight(attn, cache) is w
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)
    w2 = ragged_attention._qkv_weight(attn, cache)
    assert w2 is not w and torch.equal(w2[32:48], attn.k_proj.weight)
    attn.v_proj.bias = torch.nn.Parameter(torch.zeros(16))
    assert ragged_attention._qkv_weight(attn, cache) is None and ragged_attention._qkv_weight(attn, None) is None


def ragged_arena(B, HK, G, C, D, dtype, seed=0):
    """K/V as arena views (a row of the arena skipped, so strides are not contiguous), q as HF makes it, and
    per-row lengths in [1, C]."""
    g = torch.Generator().manual_seed(seed)
    arena = torch.randn(2, B + 1, HK, C, D, generator=g).to(DEV, dtype)
    q = torch.randn(B, 1, HK * G, D, generator=g).to(DEV, dtype).transpose(1, 2)       # (B, Hq, 1, D)
    lens = torch.randint(1, C + 1, (B,), generator=g).to(DEV)
    return q, arena[0, 1:], arena[1, 1:], lens


def sdpa_decode(q, k, v, lens):
    B, HQ, _, D = q.shape
    HK, C = k.shape[1], k.shape[2]
    mask = (torch.arange(C, device=q.device)[None, :] < lens[:, None])[:, None, None, :]   # (B, 1, 1, C)
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(B, HK, HQ // HK, D), k, v, attn_mask=mask)
    return out.reshape(B, HQ, 1, D).transpose(1, 2)                                       # (B, 1, Hq, D)


@pytest.mark.parametrize("B,HK,G,C,D", [(3, 2, 2, 64, 16), (2, 2, 4, 1200, 32), (4, 1, 8, 700, 16)])
def test_decode_attention_matches_sdpa_fp32(B, HK, G, C, D):
    """Ragged lengths (one split and several), the G query heads of a kv head in one tile."""
    q, k, v, lens = ragged_arena(B, HK, G, C, D, torch.float32, seed=C)
    assert fused_ops.decode_attention_applies(q, k)
    torch.testing.assert_close(fused_ops.decode_attention(q, k, v, lens, D ** -0.5), sdpa_decode(q, k, v, lens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_decode_attention_bf16_graph_replay():
    """A3B decode shape in bf16 against SDPA; captured once, replayed with new lengths and queries."""
    q, k, v, lens = ragged_arena(32, 4, 8, 4096, 128, torch.bfloat16)
    fused_ops.decode_attention(q, k, v, lens, 128 ** -0.5)                 # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_ops.decode_attention(q, k, v, lens, 128 ** -0.5)
    for seed in (1, 2):
        q2, _, _, lens2 = ragged_arena(32, 4, 8, 4096, 128, torch.bfloat16, seed=seed)
        q.copy_(q2)
        lens.copy_(lens2)
        graph.replay()
        torch.testing.assert_close(out.float(), sdpa_decode(q, k, v, lens).float(), rtol=2e-2, atol=2e-2)


def feed_layout(B, HK, G, C, D, dtype, chunks, seed=0):
    """A mixed step's feed: each (row, start, n) chunk of consecutive positions at a block boundary, padding slots
    on the scratch row B at column 0; the query (Hq, P, D) a view of a wider flat batch, K/V arena views."""
    blk = fused_ops.feed_block(G)
    rows, pos = [], []
    for r, start, n in chunks:
        pad = -(-n // blk) * blk - n
        rows += [r] * n + [B] * pad
        pos += list(range(start, start + n)) + [0] * pad
    rows += [B] * blk                                                  # one all-padding block
    pos += [0] * blk
    g = torch.Generator().manual_seed(seed)
    arena = torch.randn(2, B + 2, HK, C, D, generator=g).to(DEV, dtype)
    P = len(rows)
    q = torch.randn(1, HK * G, B + P, D, generator=g).to(DEV, dtype)[0, :, B:]              # (Hq, P, D)
    return q, arena[0, 1:], arena[1, 1:], torch.tensor(rows, device=DEV), torch.tensor(pos, device=DEV)


def sdpa_feed(q, k, v, rows, pos):
    """Token by token: token t against columns [0, pos[t]] of row rows[t], the heads of a kv head grouped."""
    HQ, P, D = q.shape
    HK = k.shape[1]
    out = []
    for t in range(P):
        n = int(pos[t]) + 1
        o = torch.nn.functional.scaled_dot_product_attention(q[:, t].reshape(HK, HQ // HK, D),
                                                             k[rows[t], :, :n], v[rows[t], :, :n])
        out.append(o.reshape(HQ, D))
    return torch.stack(out)                                                               # (P, Hq, D)


@pytest.mark.parametrize("HK,G,C,D,chunks", [(2, 2, 200, 16, [(0, 0, 70), (2, 130, 5)]),
                                             (1, 8, 1300, 32, [(1, 0, 17), (0, 620, 40), (2, 3, 1)])])
def test_feed_attention_matches_sdpa_fp32(HK, G, C, D, chunks):
    """Chunks of one row per block (a row's first tokens, a continuation deep in its context, one token), padding
    slots and an all-padding block; at 1,300 columns two column splits, one block's tokens on both sides of the
    split boundary (640)."""
    q, k, v, rows, pos = feed_layout(3, HK, G, C, D, torch.float32, chunks, seed=C)
    assert fused_ops.feed_attention_applies(q, k)
    out = fused_ops.feed_attention(q, k, v, rows, pos, D ** -0.5)
    real = rows < 3
    torch.testing.assert_close(out[real], sdpa_feed(q, k, v, rows, pos)[real], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_gpu_feed_attention_bf16_graph_replay():
    """A3B shape in bf16 (4 kv heads, 8 query heads each, 4,096 columns): captured once, replayed on new queries."""
    q, k, v, rows, pos = feed_layout(32, 4, 8, 4096, 128, torch.bfloat16, [(3, 0, 200), (7, 3800, 40)])
    fused_ops.feed_attention(q, k, v, rows, pos, 128 ** -0.5)                 # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_ops.feed_attention(q, k, v, rows, pos, 128 ** -0.5)
    q.copy_(torch.randn_like(q))
    graph.replay()
    real = rows < 32
    torch.testing.assert_close(out[real].float(), sdpa_feed(q, k, v, rows, pos)[real].float(), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.gpu
def test_gpu_bf16_within_an_ulp_and_graph_replay():
    q, k, cos, sin = rotary_inputs(32, 1, 32, 4, 128, torch.bfloat16)
    qo, ko = fused_ops.rope(q, k, cos, sin)
    qr, kr = hf.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(qo.float(), qr.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ko.float(), kr.float(), rtol=2e-2, atol=2e-2)
    def distinct():   # bf16 logits tie often, and torch.topk breaks ties its own way: k / 16 for a permutation
        return torch.stack([torch.randperm(128) for _ in range(32)]).to("cuda", torch.bfloat16) / 16 - 4

    logits = distinct()
    fused_ops.route(logits, 8, True)                      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w2, ids2 = fused_ops.route(logits, 8, True)
    logits.copy_(distinct())
    graph.replay()
    p = torch.softmax(logits.float(), -1)
    top, idx = torch.topk(p, 8)
    assert torch.equal(ids2, idx)
    torch.testing.assert_close(w2.float(), (top / top.sum(-1, keepdim=True)), rtol=1e-2, atol=1e-2)
