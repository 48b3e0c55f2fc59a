"""moe_kernel (fused Triton MoE experts) against transformers' eager experts loop.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets before triton is first imported, ~30 s on 2 cores); on a GPU machine the same tests
run compiled on CUDA, plus bf16 against grouped_mm at a larger shape and a CUDA-graph replay.
Skipped when triton is not importable.
"""
import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")
from engine import moe_kernel as mk  # noqa: E402

if not (CUDA or mk.INTERPRET):   # conftest.py sets it before triton is first imported; a bare run may not
    pytest.skip("no CUDA and TRITON_INTERPRET != 1 when triton was imported", allow_module_level=True)

from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
SMALL = mk.MoeCfg(16, mk.KernelCfg(16, 32), mk.KernelCfg(32, 32))   # masked tails at H=48, I=40


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls that really took the kernels (a silent fallback would pass the comparisons too)."""
    calls, real = [], mk.fused_moe
    monkeypatch.setattr(mk, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def make_experts(E, H, I, K, dtype=torch.float32, seed=0):
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    ex = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, H ** -0.5)
        ex.down_proj.normal_(0, I ** -0.5)
    return ex.to(DEV, dtype)


def route(T, E, K, experts=None, seed=0):
    """Random top-K routing of T tokens over `experts` (default all E): (T, K) int64 distinct ids, (T, K) weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(E) if experts is None else torch.as_tensor(experts)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)])
    w = torch.rand(T, K, generator=g).softmax(-1)
    return idx.to(DEV), w.to(DEV)


def eager(ex, x, idx, w):
    ex.config._experts_implementation = "eager"
    with torch.no_grad():
        return ex(x, idx, w)


@pytest.mark.parametrize("T,E,K,BM,dead", [(1, 16, 2, 16, 0), (7, 8, 8, 16, 0), (40, 4, 2, 16, 0), (5, 32, 8, 32, 0),
                                            (7, 8, 8, 16, 3), (100, 128, 8, 32, 17), (9, 8, 4, 16, 2)])
@pytest.mark.slow
def test_align_layout(T, E, K, BM, dead):
    """Every pair once, in its expert's padded group, ascending; pads = S; total = sum of padded counts.
    dead tokens have no pair, marked as `live` False (odd `dead`) or as ids -1 (even); 800 pairs over 128 experts
    take two loop steps and a histogram with a spare bin (E is a power of two)."""
    idx, _ = route(T, E, K, seed=T)
    gone = torch.randperm(T, generator=torch.Generator().manual_seed(0))[:dead]
    live = torch.ones(T, dtype=torch.bool)
    live[gone] = False
    order, block_expert, total = mk.align(idx, E, BM, live.to(DEV) if dead % 2 else None)
    idx[gone.to(idx.device)] = -1                                  # what the reference sees either way
    if not dead % 2:
        order, block_expert, total = mk.align(idx, E, BM)
    S = idx.numel()
    counts = torch.bincount(idx.flatten().cpu()[idx.flatten().cpu() >= 0], minlength=E)
    n_pad = (counts + BM - 1) // BM * BM
    assert int(total) == int(n_pad.sum()) <= order.numel(), "worst-case buffer too small"
    order, block_expert = order[:int(total)].cpu().long(), block_expert[:int(total) // BM].cpu().long()
    real = order[order < S]
    kept = (idx.flatten().cpu() >= 0).nonzero().flatten().tolist()
    assert sorted(real.tolist()) == kept and (order[order >= S] == S).all()
    flat = idx.flatten().cpu()
    for b in range(len(block_expert)):
        rows = order[b * BM:(b + 1) * BM]
        rows = rows[rows < S]
        assert (flat[rows] == block_expert[b]).all() and (rows.diff() > 0).all()
    assert (block_expert.diff() >= 0).all(), "groups are laid out expert by expert"


@pytest.mark.slow
@pytest.mark.parametrize("T,K,experts", [(1, 2, None), (3, 8, None), (6, 2, [1, 4, 9]), (37, 8, None)])
def test_matches_eager_fp32(T, K, experts):
    """fp32: 1 token, a count with most experts empty, and >BLOCK_M tokens on one expert (several blocks)."""
    ex = make_experts(16, 48, 40, K)
    x = torch.randn(T, 48, device=DEV)
    idx, w = route(T, 16, K, experts, seed=T)
    out = mk.fused_moe(x, ex.gate_up_proj.detach(), ex.down_proj.detach(), idx, w, cfg=SMALL)
    torch.testing.assert_close(out, eager(ex, x, idx, w), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_live_tokens_skip_the_others(fused_calls):
    """live=False tokens get 0 and no pair (a block per 16 identical padding tokens would read their experts'
    weights again); live ones match eager. Through the interface, `live_tokens` applies to calls of its size."""
    ex = make_experts(16, 48, 40, 2)
    x = torch.randn(37, 48, device=DEV)
    idx, w = route(37, 16, 2, seed=3)
    live = torch.rand(37, generator=torch.Generator().manual_seed(0)).to(DEV) < 0.6
    out = mk.fused_moe(x, ex.gate_up_proj.detach(), ex.down_proj.detach(), idx, w, cfg=SMALL, live=live)
    torch.testing.assert_close(out[live], eager(ex, x, idx, w)[live], rtol=1e-4, atol=1e-5)
    assert (out[~live] == 0).all()
    ex.config._experts_implementation = mk.register()
    with torch.no_grad(), mk.live_tokens(live):
        a, b = ex(x, idx, w), ex(x[:5], idx[:5], w[:5])                  # 37 tokens: masked; 5: not
    assert (a[~live] == 0).all() and len(fused_calls) == 3
    torch.testing.assert_close(b, eager(ex, x[:5], idx[:5], w[:5]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dead", [0, 9])
def test_grouped_moe_matches_eager(dead):
    """grouped_moe (the prefill path: pairs sorted by expert, torch._grouped_mm, the weighted top-k sum through
    `topk_sum`'s row map) equals eager; dead tokens' pairs sort after every group and are never computed (their
    inputs here are NaN), and the tokens get 0."""
    ex = make_experts(16, 48, 40, 4)
    x = torch.randn(37, 48, device=DEV)
    idx, w = route(37, 16, 4, seed=5)
    live = torch.ones(37, dtype=torch.bool, device=DEV)
    live[torch.randperm(37, generator=torch.Generator().manual_seed(1))[:dead].to(DEV)] = False
    ref = eager(ex, x, idx, w)
    x[~live] = float("nan")
    out = mk.grouped_moe(x, ex.gate_up_proj.detach(), ex.down_proj.detach(), idx, w, live=live if dead else None)
    torch.testing.assert_close(out[live], ref[live], rtol=1e-4, atol=1e-5)
    assert (out[~live] == 0).all()


def test_transposed_layout():
    """(E, H, 2I) / (E, I, H) weights (is_transposed experts) give the same result through strides only."""
    ex = make_experts(8, 32, 32, 2)
    x = torch.randn(5, 32, device=DEV)
    idx, w = route(5, 8, 2, seed=1)
    gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
    a = mk.fused_moe(x, gu, dn, idx, w, cfg=SMALL)
    b = mk.fused_moe(x, gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous(), idx, w,
                     transposed=True, cfg=SMALL)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 9])
def test_interface_bf16(T, fused_calls):
    """Registered name through the experts interface, bf16 weights and routing weights, default configs."""
    mk.register()
    ex = make_experts(16, 64, 32, 8, dtype=torch.bfloat16)
    x = torch.randn(T, 64, device=DEV, dtype=torch.bfloat16)
    idx, w = route(T, 16, 8, seed=T)
    w = w.to(torch.bfloat16)
    ref = eager(ex, x, idx, w)
    ex.config._experts_implementation = mk.NAME
    with torch.no_grad():
        out = ex(x, idx, w)
        assert out.dtype == torch.bfloat16 and mk.why_not_fused(ex, x) is None and fused_calls
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_fallbacks(monkeypatch):
    """More than MAX_TOKENS tokens, or autograd, take grouped_mm (and stay correct)."""
    mk.register()
    ex = make_experts(4, 32, 32, 2)
    x = torch.randn(6, 32, device=DEV)
    idx, w = route(6, 4, 2)
    ref = eager(ex, x, idx, w)
    ex.config._experts_implementation = mk.NAME
    assert "autograd" in mk.why_not_fused(ex, x)
    monkeypatch.setattr(mk, "MAX_TOKENS", 4)
    with torch.no_grad():
        assert "tokens" in mk.why_not_fused(ex, x)
        torch.testing.assert_close(ex(x, idx, w), ref, rtol=1e-4, atol=1e-5)


def test_lora_parametrized_experts(fused_calls):
    """peft LoRA on the 3-D expert params (ppo.LORA_TARGETS "experts"): the kernels read base + delta."""
    peft = pytest.importorskip("peft")
    from policy import build_tiny_model_and_tokenizer
    mk.register()
    model, _ = build_tiny_model_and_tokenizer(seed=0, hidden_size=32, num_layers=1)
    lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(model, lc).to(DEV).eval()
    ids = torch.randint(0, 1000, (2, 5), device=DEV)
    outs = {}
    for impl in ("eager", mk.NAME):
        model.set_experts_implementation(impl)
        with torch.no_grad():
            outs[impl] = model(input_ids=ids).logits
        with torch.no_grad(), model.disable_adapter():
            outs[impl + "_base"] = model(input_ids=ids).logits
    assert (outs["eager"] - outs["eager_base"]).abs().max() > 1e-3, "the adapter must change the output"
    assert len(fused_calls) == 2, fused_calls
    torch.testing.assert_close(outs[mk.NAME], outs["eager"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_engine_fused_greedy_matches_default(fused_calls):
    """Engine(experts="fused") decodes the same greedy tokens as the model's default experts."""
    from engine.generate import Engine
    from policy import build_tiny_model_and_tokenizer
    model, _ = build_tiny_model_and_tokenizer(seed=0)
    model = model.to(DEV)
    reqs = [(0, list(range(5, 17)), 6), (1, list(range(40, 47)), 6)]
    outs = []
    for experts in (None, mk.NAME):
        eng = Engine(model, None, max_batch=2, temperature=0.0, stop_ids=set(), experts=experts)
        outs.append({e: (ids, lps) for e, ids, lps, _ in eng.step(reqs)})
    assert len(fused_calls) >= 2 * 6, "every forward of the fused engine (2 layers) takes the kernels"
    for e in outs[0]:
        assert outs[0][e][0] == outs[1][e][0], e
        assert max(abs(a - b) for a, b in zip(outs[0][e][1], outs[1][e][1])) < 1e-3


def test_engine_without_triton_says_so(monkeypatch):
    from engine.generate import Engine
    from policy import build_tiny_model_and_tokenizer
    monkeypatch.setattr(mk, "triton", None)
    model, _ = build_tiny_model_and_tokenizer(seed=0)
    with pytest.raises(RuntimeError, match="needs triton"):
        Engine(model, None, experts=mk.NAME)


# ---- GPU: compiled kernels at a larger shape -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 32, 200, 300, 3000])
def test_gpu_bf16_matches_grouped_mm(T, monkeypatch):
    """bf16 on CUDA vs transformers' grouped_mm (300 and 3000 tokens: moe_kernel's unmasked grouped_moe)."""
    mk.register()
    calls, real = [], mk.grouped_moe
    monkeypatch.setattr(mk, "grouped_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    ex = make_experts(64, 1024, 384, 8, dtype=torch.bfloat16)
    x = torch.randn(T, 1024, device=DEV, dtype=torch.bfloat16)
    idx, w = route(T, 64, 8, seed=T)
    w = w.to(torch.bfloat16)
    outs = {}
    for impl in ("grouped_mm", mk.NAME):
        ex.config._experts_implementation = impl
        with torch.no_grad():
            outs[impl] = ex(x, idx, w).float()
    ref = outs["grouped_mm"]
    err = (outs[mk.NAME] - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"
    assert bool(calls) == (T > mk.MAX_TOKENS)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Captured once, replayed with new routing in the same input buffers: matches eager each time."""
    ex = make_experts(128, 512, 256, 8, dtype=torch.bfloat16)
    gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
    x = torch.randn(32, 512, device=DEV, dtype=torch.bfloat16)
    idx, w = route(32, 128, 8, seed=0)
    mk.fused_moe(x, gu, dn, idx, w)                        # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.fused_moe(x, gu, dn, idx, w)
    for seed in (1, 2, 3):
        new_idx, new_w = route(32, 128, 8, experts=range(seed, 128, 3), seed=seed)   # many empty experts
        x.normal_()
        idx.copy_(new_idx)
        w.copy_(new_w)
        graph.replay()
        torch.testing.assert_close(out, mk.fused_moe(x, gu, dn, idx, w), rtol=0, atol=0)
