"""engine.Engine against the plain path (re-encode the conversation every turn), on a tiny random MoE in fp32.

Each test plays several multi-turn episodes with ragged prompt/observation lengths and per-episode budgets,
with a large stop set so that episodes stop at different points, and checks one property.
"""
import concurrent.futures
import copy
import random
import time

import pytest
import torch

from engine.generate import Engine, HostKV
from engine.sampling import episode_generator, plain_turn, sample_next

try:
    from policy import build_tiny_model_and_tokenizer
except ImportError:   # policy.py not there yet: an equivalent tiny Qwen3-MoE, no tokenizer needed
    build_tiny_model_and_tokenizer = None


def _build():
    if build_tiny_model_and_tokenizer is not None:
        m, _ = build_tiny_model_and_tokenizer(seed=0)
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        torch.manual_seed(0)
        m = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=8192, tie_word_embeddings=False))
    return m.float().eval()


MODEL = _build()
V = MODEL.config.vocab_size
STOP = {t for t in range(V) if t % 13 == 0}      # ~8% of the vocabulary: rows stop at different steps


@pytest.fixture(scope="module")
def model():
    return MODEL


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one thread is faster than many on a shared 2-core CI box (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_script(n_eps, max_turns, seed=0):
    """Per episode: prompt, then per turn (observation ids, max_new budget); episodes have 1..max_turns turns."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(1, V) for _ in range(n)]
    return {e: [(tok(rng.randint(3, 60)) if t == 0 else tok(rng.randint(1, 25)), rng.randint(1, 12))
                for t in range(rng.randint(1, max_turns))] for e in range(n_eps)}


def run_engine(model, script, use_full=False, **kw):
    """Drive the engine turn by turn over all episodes still running. Returns {eid: [(ids, lps, reason)]}."""
    eng = Engine(model, None, stop_ids=STOP, **kw)
    outs = {e: [] for e in script}
    conv = {e: [] for e in script}
    for t in range(max(map(len, script.values()))):
        reqs = []
        for e, turns in script.items():
            if t < len(turns):
                new, budget = turns[t]
                conv[e] += new
                reqs.append((e, list(conv[e]) if use_full else new, budget))
        for e, ids, lps, why in (eng.step_full(reqs) if use_full else eng.step(reqs)):
            outs[e].append((ids, lps, why))
            conv[e] += ids
    return outs, eng


def run_plain(model, script, temperature=0.0, top_p=1.0, top_k=0, seed=0):
    """Reference: every turn re-encodes the whole conversation (plain_turn), one episode at a time."""
    outs = {}
    for e, turns in script.items():
        gen, conv, outs[e] = episode_generator(seed, e), [], []
        for new, budget in turns:
            conv += new
            ids, lps, why = plain_turn(model, conv, budget, STOP, gen, temperature, top_p, top_k)
            outs[e].append((ids, lps, why))
            conv += ids
    return outs


def assert_same(a, b, tol=1e-4):
    for e in b:
        assert len(a[e]) == len(b[e]), e
        for t, ((ia, la, ra), (ib, lb, rb)) in enumerate(zip(a[e], b[e])):
            assert ia == ib and ra == rb, f"episode {e} turn {t}: {ia} {ra} != {ib} {rb}"
            assert max(abs(x - y) for x, y in zip(la, lb)) < tol, f"episode {e} turn {t} logprobs"


def test_greedy_matches_model_generate(model):
    """Greedy engine tokens == transformers `generate` on the re-encoded conversation, turn by turn."""
    script = make_script(6, 4, seed=1)
    outs, eng = run_engine(model, script, max_batch=4, temperature=0.0)
    reasons = {why for o in outs.values() for _, _, why in o}
    assert reasons == {"stop", "length"}, reasons          # the script exercises both endings
    assert eng.stats["admissions"] > 1                      # 6 episodes through 4 rows: someone joined later
    for e, turns in script.items():
        conv = []
        for t, (new, budget) in enumerate(turns):
            conv += new
            with torch.no_grad():
                seq = model.generate(torch.tensor([conv]), attention_mask=torch.ones(1, len(conv), dtype=torch.long),
                                     do_sample=False, max_new_tokens=budget, eos_token_id=sorted(STOP),
                                     pad_token_id=0)[0, len(conv):].tolist()
            assert outs[e][t][0] == seq, f"episode {e} turn {t}"
            conv += seq


def test_greedy_matches_plain_logprobs(model):
    """Same tokens and temperature-1 log-probs (to fp32 rounding) as the full-recompute reference."""
    script = make_script(5, 5, seed=2)
    assert_same(run_engine(model, script, max_batch=3, temperature=0.0)[0], run_plain(model, script))


def test_sampling_matches_plain_and_is_batch_independent(model):
    """Per-episode generators: sampled tokens equal the reference's whatever the batch composition."""
    script = make_script(5, 4, seed=3)
    kw = dict(temperature=0.9, top_p=0.95, top_k=100, seed=7)
    ref = run_plain(model, script, **kw)
    for max_batch in (1, 4):
        assert_same(run_engine(model, script, max_batch=max_batch, **kw)[0], ref)


def test_each_turn_prefills_only_new_tokens(model):
    """Positions fed to the model per turn == len(new) + pending token + decode steps; never the conversation."""
    fed = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: fed.append(i[0].numel()))
    try:
        eng = Engine(model, None, max_batch=1, max_new_tokens=8, temperature=0.0, stop_ids=STOP)
        rng, conv = random.Random(4), []
        for t in range(6):
            new = [rng.randrange(1, V) for _ in range(40 if t == 0 else rng.randint(1, 30))]
            fed.clear()
            (_, ids, _, _), = eng.step([(0, new)])
            pending = 1 if t > 0 else 0
            assert fed[0] == len(new) + pending, (t, fed[0], len(new))         # the prefill
            assert fed[1:] == [1] * (len(ids) - 1)                               # the decode steps
            assert sum(fed) < len(conv) + len(new) or t == 0                     # less than re-encoding
            conv += new + ids
            assert eng.fed[0] == len(conv) - 1 == len(eng.history(0)) - 1       # every token fed exactly once
    finally:
        hook.remove()


def test_prefill_counts_many_episodes(model):
    """Across a ragged batch, the engine's real prefill tokens per turn are sum(len(new) + 1)."""
    script = make_script(7, 4, seed=5)
    eng = Engine(model, None, max_batch=3, temperature=0.0, stop_ids=STOP)
    for t in range(max(map(len, script.values()))):
        reqs = [(e, turns[t][0], turns[t][1]) for e, turns in script.items() if t < len(turns)]
        before = eng.stats["prefill_tokens"]
        eng.step(reqs)
        assert eng.stats["prefill_tokens"] - before == sum(len(n) + (t > 0) for _, n, _ in reqs)
        for e, _, _ in reqs:
            assert eng.fed[e] == len(eng.history(e)) - 1


def test_continuous_batching_equals_unbatched(model):
    """More episodes than rows: all finish, mid-turn joins and compactions happen, outputs == max_batch 1."""
    script = make_script(9, 3, seed=6)
    kw = dict(temperature=0.7, seed=3)
    batched, eng = run_engine(model, script, max_batch=2, **kw)
    assert eng.stats["admissions"] >= 5 and eng.stats["compactions"] >= 3, eng.stats
    assert all(len(batched[e]) == len(script[e]) for e in script)
    assert_same(batched, run_engine(model, script, max_batch=1, **kw)[0])
    assert eng.stats["decode_positions"] >= eng.stats["decode_tokens"]
    static, eng = run_engine(model, script, max_batch=3, static_batch=True, **kw)   # the CUDA-graph layout
    assert_same(static, batched)
    assert eng.stats["decode_positions"] % 3 == 0


def run_follow(model, script, **kw):
    """Drive the engine with one `step` call: each episode's next turn joins as soon as its row finishes."""
    eng = Engine(model, None, stop_ids=STOP, **kw)
    outs, order = {e: [] for e in script}, []

    def follow(res):
        e, ids, lps, why = res
        outs[e].append((ids, lps, why))
        order.append((e, len(outs[e]) - 1))
        return script[e][len(outs[e])] if len(outs[e]) < len(script[e]) else None

    last = eng.step([(e, *turns[0]) for e, turns in script.items()], follow=follow)
    assert [r[1:] for r in last] == [outs[e][-1] for e in script]        # step returns each episode's last turn
    return outs, eng, order


@pytest.mark.slow
def test_follow_ups_equal_turn_by_turn(model, monkeypatch):
    """step(follow=...) overlaps turns across episodes (and widens the arena as contexts grow) with the same
    tokens and log-probs as one `step` per turn, sampled and greedy, dynamic and static (CUDA-graph) batches;
    follow-ups fed through mixed steps (in chunks of 256 or 8 slots a step; the feed attention in torch, and with
    attention="triton" through fused_ops' kernels where triton runs) or admitted by their own prefill forwards
    (feed_tokens=0). Fed in place, a run starts with twice the columns its first turns need; long observations
    take it past them."""
    from engine import fused_ops
    short, long = long_script(6, 5, seed=21), long_script(6, 4, seed=21, obs=(40, 60))
    cfgs = ((4, False, 256), (6, True, 256), (2, False, 256), (6, True, 8), (4, False, 0))
    if fused_ops.triton is not None and fused_ops.INTERPRET:     # CPU tensors: the kernels under the interpreter
        cfgs += ((6, True, "triton"),)
    kws = (dict(temperature=0.8, top_p=0.9, seed=4), dict(temperature=0.0))
    runs = [(short, kw, cfg) for kw in kws for cfg in cfgs]
    runs += [(long, dict(temperature=0.0), cfg) for cfg in ((4, False, 256), (6, True, 256))]
    refs = {}
    for script, kw, (mb, static, feed) in runs:
        key = (id(script), tuple(kw.items()))
        if key not in refs:
            refs[key] = run_engine(model, script, max_batch=4, **kw)[0]
        with monkeypatch.context() as mp:
            calls, real = [], fused_ops.feed_attention
            mp.setattr(fused_ops, "feed_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
            triton = dict(feed_tokens=8, attention="triton") if feed == "triton" else dict(feed_tokens=feed)
            outs, eng, order = run_follow(model, script, max_batch=mb, static_batch=static, **triton, **kw)
        assert bool(calls) == (feed == "triton"), "the feed attention follows the engine's attention choice"
        assert_same(outs, refs[key], tol=1e-5)
        if script is long or not feed:    # 120-token prompts, then +5..37 (short) or +40..72 (long) a turn
            assert eng.stats["arena_grows"] >= 1, eng.stats
        if feed and mb == len(script):   # a row per episode: every follow-up fed in place, one admission
            assert eng.stats["feed_steps"] > 0 and eng.stats["admissions"] == 1, eng.stats
        elif not feed:
            assert eng.stats["feed_steps"] == 0 and eng.stats["admissions"] > len(script), eng.stats
        if mb == len(script):   # a row per episode: some episode is a turn ahead of another at some point
            turns = [t for _, t in order]
            assert turns != sorted(turns), "no episode began a turn before all had finished the previous one"
        assert eng.fed == {e: len(eng.history(e)) - 1 for e in script}    # every token fed once: no re-prefill


@pytest.mark.parametrize("cfg", [dict(max_batch=6), dict(max_batch=6, feed_tokens=0), dict(max_batch=3),
                                 dict(max_batch=4, kv_budget_gib=300)])
def test_follow_ups_that_arrive_later_equal_turn_by_turn(model, cfg):
    """follow answers with a Future while the episode's tools run (here: 0-30 ms on a thread pool): its row
    waits with its cache and the others decode on (or gives the row up to a queued turn); the same tokens and
    log-probs as one `step` per turn, with rows fed in place or admitted, fewer rows than episodes, and a KV
    budget (in tokens here)."""
    script = long_script(6, 4, seed=23)
    ref, eng0 = run_engine(model, script, max_batch=4, temperature=0.8, seed=5)
    if "kv_budget_gib" in cfg:
        cfg = dict(cfg, kv_budget_gib=cfg["kv_budget_gib"] * eng0.kv_token_bytes / 2 ** 30)
    rng, outs = random.Random(7), {e: [] for e in script}
    eng = Engine(model, None, stop_ids=STOP, temperature=0.8, seed=5, **cfg)

    def tools(e):
        time.sleep(rng.random() * 0.03)
        return script[e][len(outs[e])] if len(outs[e]) < len(script[e]) else None

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        def follow(res):
            outs[res[0]].append(res[1:])
            return pool.submit(tools, res[0])

        eng.step([(e, *turns[0]) for e, turns in script.items()], follow=follow, release=True)
    assert_same(outs, ref, tol=1e-5)
    assert not eng.episodes, "release=True: every episode that left is released"
    if cfg["max_batch"] < len(script):     # turns queued behind rows whose tools ran: those rows were given up
        assert eng.stats["rows_given_up"] > 0, eng.stats


def test_step_full_follow_ups_rewind(model):
    """step_full(follow=): follow answers with whole conversations; one that re-renders an earlier token (here
    the turn's last cached one, as chat templates may do with a turn's markup) cuts the cache back there in its
    row, with the tokens of a turn-by-turn step_full driven the same way."""
    script = long_script(4, 4, seed=24)

    def drive(overlap):
        eng = Engine(model, None, stop_ids=STOP, max_batch=4, temperature=0.0, feed_tokens=16 if overlap else 0)
        conv, outs = {e: list(t[0][0]) for e, t in script.items()}, {e: [] for e in script}

        def nxt(e, ids):
            outs[e].append(ids)
            if len(outs[e]) == len(script[e]):
                return None
            conv[e] += ids[:-2] + [3] + ids[-1:] + script[e][len(outs[e])][0]   # a cached token re-rendered
            return list(conv[e]), 8

        if overlap:
            eng.step_full([(e, list(c), 8) for e, c in conv.items()], follow=lambda r: nxt(r[0], r[1]), release=True)
        else:
            live = list(script)
            while live:
                res = eng.step_full([(e, list(conv[e]), 8) for e in live])
                live = [e for e, ids, _, _ in res if nxt(e, ids) is not None]
        return outs, eng

    (turns, eng), (ref, eng_ref) = drive(True), drive(False)
    assert turns == ref and eng.stats["rewinds"] == eng_ref.stats["rewinds"] > 0
    assert eng.stats["feed_steps"] > 0 and not eng.episodes


def test_follow_ups_over_a_kv_budget_wait_for_the_next_run(model):
    """With a KV budget the arena never grows: a follow-up turn that does not fit waits for a later run of the
    same `step` call, with the same outputs."""
    script = long_script(4, 4, seed=22)
    ref, eng0 = run_engine(model, script, max_batch=4, temperature=0.0)
    outs, eng, _ = run_follow(model, script, max_batch=4, temperature=0.0,
                              kv_budget_gib=600 * eng0.kv_token_bytes / 2 ** 30)
    assert_same(outs, ref, tol=1e-5)
    assert eng.stats["arena_grows"] == 0 and eng.stats["kv_peak_resident_gib"] * 2 ** 30 <= 600 * eng0.kv_token_bytes


def test_follow_up_past_the_context_is_a_context_result(model):
    """A follow-up turn with no room left under max_context ends as "context" and follow is asked again."""
    eng = Engine(model, None, stop_ids=set(), temperature=0.0, max_context=40)
    seen = []

    def follow(res):
        seen.append(res[3])
        return [7] * 30 if len(seen) == 1 else None

    (_, ids, _, why), = eng.step([(0, [5] * 20, 8)], follow=follow)
    assert seen == ["length", "context"] and (ids, why) == ([], "context")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager():
    """On CUDA: graph-replayed decode gives the eager engine's tokens (same batch layout) and really replays."""
    m = _build().to("cuda", torch.bfloat16)      # bf16: the grouped_mm experts path (fp32 falls back to a loop)
    script = make_script(6, 3, seed=9)
    eager, _ = run_engine(m, script, max_batch=4, temperature=0.0, static_batch=True)   # same rows, same kernels
    graph, eng = run_engine(m, script, max_batch=4, temperature=0.0, cuda_graphs=True)
    assert eng.graph_error is None, eng.graph_error
    assert eng.stats.get("graph_replays", 0) > 0, eng.stats
    assert_same(graph, eager, tol=1e-3)
    # follow-ups fed through mixed steps: their graph too, captured again (without a warm-up) as the arena grows
    script = long_script(4, 4, seed=23, obs=(40, 60))
    for experts in (None, "fused"):          # fused: padding and finished rows skip the experts
        eager, _, _ = run_follow(m, script, max_batch=4, temperature=0.0, static_batch=True, experts=experts)
        graph, eng, _ = run_follow(m, script, max_batch=4, temperature=0.0, cuda_graphs=True, experts=experts)
        assert eng.graph_error is None and eng.stats["feed_steps"] > 0, (eng.graph_error, eng.stats)
        assert eng.stats["arena_grows"] >= 1 and eng.stats["graph_captures"] >= 3, eng.stats
        assert_same(graph, eager, tol=1e-3)


@pytest.mark.slow
def test_triton_decode_attention_matches_plain(model, monkeypatch):
    """Engine(attention="triton"): decode attention through fused_ops' kernel (the Triton interpreter on CPU),
    greedy turns equal the plain reference in fp32."""
    from engine import fused_ops
    if fused_ops.triton is None or not fused_ops.INTERPRET:   # the model is on the CPU (the GPU test: test_fused_ops)
        pytest.skip("needs triton with TRITON_INTERPRET=1 (CPU tensors)")
    calls, real = [], fused_ops.decode_attention
    monkeypatch.setattr(fused_ops, "decode_attention", lambda *a: calls.append(1) or real(*a))
    script = make_script(4, 3, seed=5)
    outs, eng = run_engine(model, script, max_batch=3, temperature=0.0, attention="triton")
    assert eng.attn_name.endswith("_triton") and len(calls) >= model.config.num_hidden_layers
    assert_same(outs, run_plain(model, script))


@pytest.mark.slow
def test_fused_ops_match_the_model_and_are_restored(model, monkeypatch):
    """Engine(fused=True): RMSNorms as F.rms_norm (the same values as the module's forward: fp32 rounding; bf16
    within a bf16 ulp), the attentions through ragged_attention.attention_forward (q/k/v as one GEMM, the
    q/k norms, rotary and K/V write as fused_ops.attention_prologue) and routers through fused_ops' kernels (the
    Triton interpreter on CPU); greedy turns equal the plain reference, and the model is itself again after
    each call."""
    from engine import fused_ops
    from engine.fused_ops import rms_norm as fused_rms_norm
    norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    x = torch.randn(3, 5, norm.weight.shape[0])
    with torch.no_grad():
        torch.testing.assert_close(fused_rms_norm(norm, x), norm(x), rtol=1e-6, atol=1e-6)
        nb = copy.deepcopy(norm).to(torch.bfloat16)
        nb.weight.normal_()
        xb = x.to(torch.bfloat16)
        torch.testing.assert_close(fused_rms_norm(nb, xb).float(), nb(xb).float(), rtol=8e-3, atol=1e-2)
    calls = []
    monkeypatch.setattr(fused_ops, "rms_norm", lambda m, x: calls.append(m) or fused_rms_norm(m, x))
    if fused_ops.triton is not None and fused_ops.INTERPRET:
        for name in ("attention_prologue", "route"):
            real = getattr(fused_ops, name)
            monkeypatch.setattr(fused_ops, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    script = make_script(4, 3, seed=4)
    outs, eng = run_engine(model, script, max_batch=3, temperature=0.0, fused=True)
    norms = eng._fused_targets.norms
    assert len([c for c in calls if not isinstance(c, str)]) >= len(norms)
    assert eng.fused and len(norms) == 2 * 2 * model.config.num_hidden_layers + 1   # + q/k norms
    if fused_ops.triton is not None and fused_ops.INTERPRET:
        L = model.config.num_hidden_layers
        assert calls.count("attention_prologue") >= L and calls.count("route") >= L
        assert len(eng._qkv) == L                                       # plain Linears: one fused weight a layer
    assert len(eng._fused_targets.attentions) == model.config.num_hidden_layers
    assert all("forward" not in vars(m) for m in norms + eng._fused_targets.routers + eng._fused_targets.attentions)
    assert_same(outs, run_plain(model, script))


def test_step_full_and_rewind(model):
    """step_full feeds only the suffix; an edited earlier token rewinds the cache to the common prefix."""
    script = make_script(4, 3, seed=8)
    outs_full, eng = run_engine(model, script, use_full=True, max_batch=2, temperature=0.0)
    assert_same(outs_full, run_plain(model, script))
    assert eng.stats["rewinds"] == 0
    e = 0
    hist = eng.history(e)
    edited = hist[:5] + [(hist[5] + 1) % V or 1] + hist[6:] + [17, 18]
    before = eng.stats["prefill_tokens"]
    (_, ids, _, _), = eng.step_full([(e, edited, 6)])
    assert eng.stats["rewinds"] == 1 and eng.stats["prefill_tokens"] - before == len(edited) - 5
    ref, _, _ = plain_turn(model, edited, 6, STOP, torch.Generator(), temperature=0.0)
    assert ids == ref


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_peft_lora_model(model, fused):
    """A peft-wrapped model (what training samples from): same tokens as the plain path through PeftModel; fused:
    the engine's attention forward calls the LoRA projections as modules (no fused q/k/v weight for them)."""
    peft = pytest.importorskip("peft")
    pm = peft.get_peft_model(_build(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False)).eval()   # a non-zero adapter
    script = make_script(3, 2, seed=11)
    outs, eng = run_engine(pm, script, max_batch=2, temperature=0.0, fused=fused)
    assert_same(outs, run_plain(pm, script))
    assert not eng._qkv


def test_sample_next_filters():
    """top-k 1 is greedy; top-p keeps the smallest set reaching p; log-probs are at temperature 1."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids, lp = sample_next(logits, [g], temperature=1.0, top_k=1)
        assert ids.item() == 1 and abs(lp.item() - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-6
        ids, _ = sample_next(logits, [g], temperature=1.0, top_p=0.7)   # p(1)=.64, p(3)=.24: keeps {1, 3}
        assert ids.item() in (1, 3)


def long_script(n_eps, turns, seed=0, obs=(5, 25)):
    """Every episode plays all turns from a long prompt, so arena rows are wide and idle caches are large."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(1, V) for _ in range(n)]
    return {e: [(tok(rng.randint(100, 120)) if t == 0 else tok(rng.randint(*obs)), rng.randint(3, 12))
                for t in range(turns)] for e in range(n_eps)}


@pytest.mark.parametrize("mode", ["offload", "drop"])
def test_kv_budget_same_outputs(model, mode):
    """A budget of 400 tokens of KV (1-3 arena rows, idle caches evicted): same tokens and log-probs as unlimited."""
    script = long_script(5, 4, seed=12)
    ref, eng0 = run_engine(model, script, max_batch=5, temperature=0.0)
    budget = 400 * eng0.kv_token_bytes / 2 ** 30
    assert eng0.stats["kv_peak_resident_gib"] > 2 * budget                    # the budget binds
    outs, eng = run_engine(model, script, max_batch=5, temperature=0.0, kv_budget_gib=budget, kv_evict=mode)
    assert_same(outs, ref, tol=1e-5)
    s = eng.stats
    assert 0 < s["kv_peak_resident_gib"] <= budget, s
    assert s["arena_rows_max"] <= 3 < eng0.stats["arena_rows_max"], s         # 128 columns x 3 rows <= 400
    if mode == "offload":
        assert s["kv_offloaded_tokens"] > 0 and s["kv_reloaded_tokens"] > 0 and s["kv_dropped_tokens"] == 0, s
        assert s["prefill_tokens"] == eng0.stats["prefill_tokens"]             # nothing recomputed
    else:
        assert s["kv_dropped_tokens"] > 0 and s["kv_offloaded_tokens"] == s["kv_reloaded_tokens"] == 0, s
        extra = s["prefill_tokens"] - eng0.stats["prefill_tokens"]           # dropped caches were re-prefilled
        assert 0 < extra <= s["kv_dropped_tokens"], s                         # (the last turn's drops are not)
    assert eng.stats["admissions"] > eng0.stats["admissions"]                 # rows joined as others finished



def test_kv_offload_host_blocks_reused_and_exact(model, monkeypatch):
    """Offloaded caches live in fixed host blocks: a cache whose layers straddle block boundaries round-trips
    bit for bit, blocks are reused across turns (the pool never outgrows the most ever offloaded at once), a
    rewind of an offloaded cache stays exact, and released episodes give their blocks back."""
    block = 3000                     # bytes; no layer's bytes are a multiple of it, so layers straddle blocks
    eng = Engine(model, None, kv_host_block=block)
    for dtype in (torch.float32, torch.bfloat16):
        arena = torch.randn(2, 2, 3, 2, 50, 32).to(dtype)                  # (layers, 2, B, Hkv, C, D)
        kv = arena[:, :, 1, :, :37]                                          # a strided row view, n = 37
        h = eng._host(kv)
        nbytes = kv.numel() * kv.element_size()                              # 2 layers of 2*2*37*32 elements
        assert len(h.blocks) == -(-nbytes // block) and (nbytes // 2) % block != 0
        back = torch.zeros_like(arena)
        eng._reload(h, back[:, :, 2, :, :37])
        assert torch.equal(back[:, :, 2, :, :37], kv) and back[:, :, :2].abs().sum() == 0
        assert len(eng._pool.free) == eng._pool.allocated                    # all blocks back on the free list

    held = {"now": 0, "peak": 0}                                            # bytes of offloaded caches
    host, reload = Engine._host, Engine._reload
    size = lambda h: h.shape.numel() * h.dtype.itemsize

    def tracked_host(self, kv):
        h = host(self, kv)
        held["now"] += size(h)
        held["peak"] = max(held["peak"], held["now"])
        return h

    def tracked_reload(self, h, dst):
        held["now"] -= size(h)
        return reload(self, h, dst)

    monkeypatch.setattr(Engine, "_host", tracked_host)
    monkeypatch.setattr(Engine, "_reload", tracked_reload)
    script = long_script(5, 4, seed=12)
    ref, eng0 = run_engine(model, script, max_batch=5, temperature=0.0)
    budget = 400 * eng0.kv_token_bytes / 2 ** 30
    outs, eng = run_engine(model, script, max_batch=5, temperature=0.0, kv_budget_gib=budget, kv_host_block=block)
    assert_same(outs, ref, tol=1e-5)
    s, pool = eng.stats, eng._pool
    assert pool.allocated <= -(-held["peak"] // block) + len(script), (pool.allocated, held)   # <1 block slack/cache
    assert s["kv_offloaded_tokens"] * eng.kv_token_bytes > 2 * pool.allocated * block, s      # blocks were reused
    assert s["kv_host_gib"] == pool.allocated * block / 2 ** 30

    e = next(e for e, ep in eng.episodes.items() if isinstance(ep.kv, HostKV))
    hist = eng.history(e)
    edited = hist[:40] + [(hist[40] + 1) % V or 1] + hist[41:] + [17, 18]
    (_, ids, _, _), = eng.step_full([(e, edited, 6)])                    # cut to 40 tokens on the host, then fed
    assert eng.stats["rewinds"] == 1
    assert ids == plain_turn(model, edited, 6, STOP, torch.Generator(), temperature=0.0)[0]
    for e in script:
        eng.release(e)
    assert len(pool.free) == pool.allocated and not eng.episodes

def test_kv_budget_evicts_least_recently_used(model):
    """Room for the arena plus two idle caches: a cache that comes out evicts the least recently used one."""
    rng = random.Random(13)
    per_token = Engine(model, None).kv_token_bytes              # layers x 2 x kv heads x head_dim x 4 bytes
    budget = (128 + 220) * per_token / 2 ** 30                  # one 128-column row + two caches of 103-109 tokens
    eng = Engine(model, None, max_batch=1, temperature=0.0, stop_ids=set(), max_new_tokens=4, kv_budget_gib=budget)
    for e in range(3):
        eng.step([(e, [rng.randrange(1, V) for _ in range(100)])])   # a cache of 100 + 3 tokens each
    assert list(eng._resident) == [1, 2] and eng.stats["kv_offloaded_tokens"] == 103, eng.stats   # 0 left
    eng.step([(1, [5, 6])])                                     # 1 is now the most recently used
    assert list(eng._resident) == [2, 1] and eng.stats["kv_reloaded_tokens"] == 0, eng.stats
    eng.step([(0, [5, 6])])                                     # 0 comes back from host; its new cache evicts 2
    assert list(eng._resident) == [1, 0] and eng.stats["kv_reloaded_tokens"] == 103, eng.stats
    assert eng.stats["kv_offloaded_tokens"] == 2 * 103 and eng.stats["kv_peak_resident_gib"] <= budget


def test_kv_budget_drop_prefills_cached_and_dropped_rows_together(model):
    """A dropped episode (whole conversation to feed) admitted beside a cached one: the rows still fit the arena."""
    rng = random.Random(14)
    tok = lambda n: [rng.randrange(1, V) for _ in range(n)]
    steps = [[(0, tok(200), 4)], [(1, tok(300), 340)], [(0, tok(5), 4), (1, tok(5), 4)]]
    per_token = Engine(model, None).kv_token_bytes
    outs = {}
    for budget in (None, 990 * per_token / 2 ** 30):       # 640-column row + 350 tokens; then 2 rows of 320 + 300
        eng = Engine(model, None, max_batch=2, temperature=0.0, stop_ids=set(range(V)),   # 1 token per turn
                     kv_budget_gib=budget, kv_evict="drop")
        outs[budget] = [eng.step(reqs) for reqs in steps]
    assert eng.stats["arena_rows_max"] == 2, eng.stats
    assert eng.stats["kv_dropped_tokens"] == 200 + 206, eng.stats   # 0's cache in step 2, again after step 3
    for a, b in zip(*outs.values()):
        for (_, ia, la, _), (_, ib, lb, _) in zip(a, b):
            assert ia == ib and abs(la[0] - lb[0]) < 1e-5


def test_kv_budget_too_small_for_one_row(model):
    """A budget below one arena row (64 columns) is a configuration error that names the numbers."""
    per_token = Engine(model, None).kv_token_bytes
    eng = Engine(model, None, temperature=0.0, stop_ids=STOP, kv_budget_gib=32 * per_token / 2 ** 30)
    with pytest.raises(ValueError, match="one arena row of 64 tokens needs"):
        eng.step([(0, [3, 4, 5], 4)])
