"""Fast multi-turn generation for agent rollouts: per-episode KV caches kept across turns, continuous batching.

An agent episode grows by one observation and one model turn at a time (paper §3.2-3.3: up to 150 turns,
128k context). Re-encoding the whole conversation with `model.generate` every turn is quadratic in turns
and a batch waits for its longest row. `Engine` removes both costs:
  * `Engine.step_full([(episode_id, all_ids), ...])` feeds only the part after the longest common prefix
    with what the episode has cached (rewinding if the template re-rendered a token), then samples; every
    token of a conversation enters the model once (`Engine.fed`). policy.HFPolicy calls it once per turn.
  * Continuous batching: up to `max_batch` rows decode together with ragged cache lengths; finished rows
    leave, waiting requests join mid-turn. With `step(..., follow=fn)` an episode's next turn joins as soon
    as its row finishes (turns overlap across episodes): it stays in its arena row and its new tokens ride in
    the next decode steps (`feed_tokens` slots a step, "mixed" steps, one CUDA graph), so no eager prefill
    forward re-reads the weights for it (at the A3B shape 1,517-1,535 tok/s against 1,411 one `step` per turn,
    docs/RESULTS.md §3). fn may answer with a Future while the episode's tools run: the row waits with its
    cache and the others decode on (policy.HFPolicy.stream, which env.run_episodes uses).
  * Each episode has its own CPU torch.Generator and one uniform draw per token, so in fp32 samples do not
    depend on the batch (in bf16 the batch changes the logits by rounding, and so can change a sample);
    returned log-probs are log_softmax(logits) at temperature 1, before top-p/top-k.
  * `kv_budget_gib` bounds the KV memory on the device: fewer arena rows, idle caches offloaded to pinned host
    memory (or dropped and re-prefilled), least recently used first.
The cache layout and why transformers' own continuous batching does not fit are explained above `Engine`.

Departures from the paper
  1. The paper generates with a dedicated inference server; we generate with the training model itself
     (LoRA adapter live, no reload after an update). `RolloutBackend` is the extension point for vLLM.
  2. Sliding-window and non-attention (linear/SSM) layers are not supported by the ragged arena.

Correctness: in fp32 on CPU greedy tokens equal `model.generate`'s and sampled tokens `sampling.plain_turn`'s
(tests/test_generate.py); in bf16 on GPU scripts/bench_generate.py reports identical greedy turns.

Smoke: python -m pytest -q tests/test_generate.py
Bench: python scripts/bench_generate.py --preset small --out bench_small.json     (H200)
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

import torch
from transformers.cache_utils import Cache

from . import fused_ops, moe_kernel
from .kv_host import KV_HOST_BLOCK, HostKV, HostPool, offload, reload
from .ragged_attention import ATTN_NAME, Feed, RaggedLayer, begin_feed, end_forward, patch_attention
from .sampling import cache_kwarg, episode_generator, sample_rows

@dataclass
class _Episode:
    ids: list[int]                     # every token of the conversation so far (cached + the pending one)
    n_cached: int                      # ids[:n_cached] have keys/values in kv
    kv: torch.Tensor | HostKV | None  # (layers, 2, Hkv, n_cached, D) on the device, offloaded to host, or None
    gen: torch.Generator


Result = tuple[Hashable, list[int], list[float], str]       # (episode_id, sampled ids, log-probs, finish reason)
# Engine.step's follow: the next turn (new_ids, (new_ids, max_new_tokens) or None), or a Future of it while the
# episode's tools run (the row waits, keeping its cache, and the other rows go on decoding)
Follow = Callable[[Result], "list[int] | tuple[list[int], int] | None | Future"]


def _turn(nxt) -> tuple[list[int], int | None]:
    """follow's answer as (new_ids, max_new_tokens or None)."""
    if isinstance(nxt, tuple):
        return list(nxt[0]), (nxt[1] if len(nxt) > 1 else None)
    return list(nxt), None


@dataclass
class _Row:
    eid: Hashable
    budget: int                        # tokens it may sample this turn
    alive: bool = True                 # as of the last `_collect`; the device's `_st` row ALIVE is the truth
    feed: list[int] | None = None      # a follow-up turn's tokens still to be fed through mixed steps
    wait: Future | None = None         # follow's answer, still running (the row keeps the episode's cache)


# --------------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------------


# Why not the library's continuous batching, and the cache layout
# transformers 5 ships `generate_batch` / `ContinuousBatchingManager` (paged KV cache, background thread). It
# frees a request's blocks when the request ends, and its prefix sharing only reuses complete blocks of
# prompts it has seen; it cannot hold an episode's exact cache (including the partial last block and the
# pending sampled token) across a tool call that takes minutes, per-request torch.Generators are not part
# of its API, and the module changes between 5.17 (GPU image) and 5.24 (CI). So this is a manual decode loop
# over the model's own forward, using the library where it fits:
# * the batched cache is a `transformers.Cache` of `StaticLayer`s (ragged_attention.RaggedLayer) whose
#   buffers are views of one preallocated arena `(layers, 2, max_batch, kv_heads, C, head_dim)`; row b holds
#   its episode's tokens at columns [0, len_b) with no padding holes, so column == RoPE position and a row
#   writes each new token at its own column (StaticLayer.update uses one shared write position; ours per row);
# * the 4D mask `(B, 1, q, C)` is built here (`col <= len_b + i`) and passed straight through
#   `create_causal_mask` (its documented 4D early exit);
# * attention (ragged_attention.py) is registered through `AttentionInterface` for the engine's calls only:
#   decode and prefill fold the query heads that share a kv head into the query axis, so grouped-query
#   attention reads K/V once instead of `repeat_kv`-copying them (8x for Qwen3-30B-A3B) as transformers' sdpa
#   path does with a mask;
# * the MoE experts run with whatever `experts_implementation` the model has (transformers' default is
#   `grouped_mm` where it can dispatch; `Engine(experts=...)` sets another one for the engine's calls);
#   `experts="fused"` registers moe_kernel.py's Triton kernels (decode at the weight-bandwidth bound);
# * `fused=` (on CUDA by default) swaps fused_ops.py's one-launch norms, rotary embeddings and routers in.
# Episode caches live between turns as compact tensors `(layers, 2, kv_heads, n, head_dim)` and are copied
# into the arena at the start of a `step` and out when the row finishes (a memcpy of the cache per turn,
# small next to a turn's decode steps).
# KV budget (`kv_budget_gib`): at the Qwen3-30B-A3B shape a token's keys and values take 96 KiB in bf16
# (48 layers x 2 x 4 kv heads x 128 x 2 bytes), so 64 episodes of 16k tokens hold 96 GiB, more than an H200
# has beside 61 GB of weights. With a budget, the arena plus the idle caches on the device stay within it:
# * the arena gets as many rows as fit (B * C * 96 KiB <= budget); the other requests wait in the queue and
#   join as rows finish;
# * before the arena is allocated, and whenever a finished row's cache is copied out, idle caches are evicted
#   least recently used first (for a finished row, only caches of episodes outside the running `step`: the
#   others are needed again sooner); a finished cache that still does not fit goes straight out itself;
# * evicted = copied to host memory and back into the arena when the episode is admitted (`kv_evict=
#   "offload"`: a PCIe copy each way, host memory for what does not fit), or dropped and the episode's tokens
#   re-prefilled when its turn comes (`"drop"`: prefill compute instead of copies and host memory).
# Offloaded caches live in pinned host blocks (kv_host.py: why fixed blocks, what pinning costs).
# The cost is in `stats`: kv_offloaded/reloaded/dropped_tokens, kv_offload_s (copy seconds, including pinning
# new blocks), kv_peak_resident_gib (arena + resident caches, from tensor sizes), kv_host_gib (pinned host
# memory held by the pool) and kv_host_alloc_s (seconds spent allocating it).


# Decode state on the device. A decode step must not wait for the host: the rows' pending tokens, lengths,
# budgets and outputs live in device tensors that the step updates itself, so a step is the forward (one
# graph replay), ~15 small sampling/update kernels and ONE device-to-host copy of the rows' counters. The
# host learns from that copy which rows finished and only then touches them (cache out, results, scheduling),
# with one more copy for their tokens. `_st` (6, B) int64, one column per arena row:
TOK, LEN, LEFT, NOUT, ALIVE, DONE = range(6)
# TOK the token fed at the next decode step (the last sampled; the pad for dead and unused rows); LEN tokens
# in the row's arena row (its next write column; frozen once the row is dead); LEFT sampling budget left;
# NOUT tokens sampled this turn (the next column of `_out`/`_lps`); ALIVE 1 while sampling; DONE 1 on the
# sample that finished the row (stop id or budget). Sampled tokens and log-probs go to `_out`/`_lps`
# (B, T + 1) at column NOUT (column T is scratch for dead rows); a sampling engine pre-draws each row's
# uniforms into `_u` (B, T + 1) from a copy of its episode's generator, and advances the generator by the
# number actually used when the row finishes, so draws stay one per sampled token as in `plain_turn`.


class Engine:
    """Multi-turn batched sampler with per-episode KV caches. See the module docstring."""

    def __init__(self, model, tokenizer=None, max_batch: int = 64, max_new_tokens: int = 1024,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, top_k: int = 0,
                 stop_ids: set[int] | None = None, max_context: int | None = None,
                 compact_min: int | None = None, admit_min: int | None = None,
                 prefill_tokens: int = 16384, experts: str | None = None, fused: bool | None = None,
                 attention: str | None = None, cuda_graphs: bool = False, feed_tokens: int = 128,
                 static_batch: bool = False, kv_budget_gib: float | None = None, kv_evict: str = "offload",
                 kv_host_block: int = KV_HOST_BLOCK):
        self.model = model
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.cfg = cfg
        assert getattr(cfg, "sliding_window", None) is None or not getattr(cfg, "use_sliding_window", False), \
            "sliding-window attention is not supported by the ragged arena"
        self.n_layers, self.n_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_batch, self.max_new_tokens = max_batch, max_new_tokens
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        if stop_ids is None:
            stop_ids = set()
            for e in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
                stop_ids |= set(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
        self.stop_ids = set(stop_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else 0
        self.max_context = max_context or getattr(cfg, "max_position_embeddings", 1 << 30)
        self.compact_min = compact_min or max(1, max_batch // 8)
        self.admit_min = admit_min or max(1, max_batch // 8)
        self.prefill_tokens, self.experts = prefill_tokens, experts
        if experts == moe_kernel.NAME:
            moe_kernel.register()   # raises with one clear line when triton is not importable
        # Elementwise chains as one launch each for the engine's calls (None: on CUDA only): RMSNorms, rotary
        # embeddings and MoE routers (fused_ops.py), and attentions through ragged_attention.attention_forward
        # (q/k/v as one GEMM where they are plain Linears, norms + rotary + the K/V write as one launch); the
        # modules are found once and patched around each call.
        self.fused = self.device.type == "cuda" if fused is None else fused
        self._fused_targets = fused_ops.targets(model)
        self._qkv: dict = {}   # ragged_attention._qkv_weight: fused q/k/v weights of the plain-Linear attentions
        # decode attention (None: "triton" on CUDA where triton imports, else "sdpa"): "sdpa" (torch, a mask over
        # all arena columns) or "triton" (fused_ops: each row's keys only up to its length; the A3B decode step
        # 17.8 -> 16.9 ms, the 0.7B one 2.4 -> 1.9 ms on an H200, docs/RESULTS.md §3). Prefill is sdpa either way.
        if attention is None:
            attention = "triton" if self.device.type == "cuda" and fused_ops.triton is not None else "sdpa"
        assert attention in ("sdpa", "triton"), f"attention={attention!r}: sdpa | triton"
        if attention == "triton" and fused_ops.triton is None:
            raise RuntimeError(f"attention='triton' needs triton, not importable here: {fused_ops.TRITON_ERROR}")
        self.attn_name = ATTN_NAME + ("_triton" if attention == "triton" else "")
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.static_batch = static_batch or self.cuda_graphs   # decode all arena rows every step (graphs need it)
        self.graph_error: str | None = None       # why CUDA-graph decode was switched off, if it was
        self._graphs: dict = {}                     # "decode" / "mixed" -> (graph, its logits) while a `step` runs
        self._warm: set = set()                     # graph names captured before (their kernels are compiled)
        self._side: torch.cuda.Stream | None = None   # the stream graphs are captured on
        # Follow-up turns (step(follow=)) are fed through the decode steps: up to feed_tokens slots a step carry
        # the new turns' tokens beside the pending ones (a "mixed" step), so a row that finishes a turn stays in
        # its arena row and needs no admission (an eager forward that reads every weight again). 0: admissions.
        self.feed_tokens = feed_tokens
        self._mixed = False                         # this run feeds follow-ups through mixed steps
        self.arena: torch.Tensor | None = None      # (layers, 2, B, Hkv, C, D) while a `step` runs
        self.rows: list[_Row] = []                  # the arena's rows; none yet when a step's turns had no room
        self._follow: Follow | None = None          # step's follow while it runs
        self._queue: list = []                      # (episode, budget) waiting for a row in the running `_run`
        self._later: list = []                      # follow-ups for the next `_run` of this step (arena too small)
        self._waiting: list = []                    # (episode, Future) follow-ups of episodes without an arena row
        self._n_wait = 0                            # rows waiting for follow's Future
        self._full = self._release = False          # step_full's follow (whole conversations); release on leave
        self._cache_kw = cache_kwarg(self.decoder)
        self.episodes: dict[Hashable, _Episode] = {}
        self.fed: dict[Hashable, int] = {}        # tokens of each episode that entered the model (real, no pads)
        assert kv_evict in ("offload", "drop"), f"kv_evict={kv_evict!r}: offload | drop"
        self.kv_budget = None if kv_budget_gib is None else int(kv_budget_gib * 2 ** 30)   # bytes
        self.kv_evict = kv_evict
        self.kv_token_bytes = self.n_layers * 2 * self.n_kv * self.head_dim * p.element_size()
        self._resident: dict[Hashable, None] = {}   # episodes whose idle cache is on the device, LRU first
        self._in_run: set[Hashable] = set()         # episodes of the running `step` (not evicted for its rows)
        # offloaded caches live here; kv_host_block = bytes per block (a power of two when pinned)
        self._pool = HostPool(kv_host_block, pin=self.device.type == "cuda")
        V = self.head.weight.shape[0]
        self._stop = torch.zeros(V, dtype=torch.bool)                # (V,) True at stop ids, on the device
        self._stop[[t for t in self.stop_ids if 0 <= t < V]] = True  # (larger ids are never sampled)
        self._stop = self._stop.to(self.device)
        self.stats = dict(prefill_tokens=0, prefill_positions=0, decode_tokens=0, decode_positions=0, decode_steps=0,
                          forwards=0, admissions=0, compactions=0, rewinds=0, kv_offloaded_tokens=0,
                          kv_reloaded_tokens=0, kv_dropped_tokens=0, kv_offload_s=0.0, kv_peak_resident_gib=0.0,
                          kv_host_gib=0.0, kv_host_alloc_s=0.0, arena_rows_max=0, admit_s=0.0,
                          graph_capture_s=0.0, arena_grows=0, feed_steps=0, rows_given_up=0)

    # ---- public API --------------------------------------------------------------------------------

    def release(self, episode_id: Hashable) -> None:
        """Forget an episode and free its cache (an offloaded one's host blocks go back to the pool)."""
        ep = self.episodes.pop(episode_id, None)
        if ep is not None and isinstance(ep.kv, HostKV):
            self._pool.give(ep.kv.blocks)
        self.fed.pop(episode_id, None)
        self._resident.pop(episode_id, None)

    def history(self, episode_id: Hashable) -> list[int]:
        """All token ids of the episode so far (prompt, observations, sampled tokens)."""
        return list(self.episodes[episode_id].ids)

    def step_full(self, requests: list[tuple], follow: Follow | None = None,
                  release: bool = False) -> list[Result]:
        """Like `step`, but each request (and each answer of follow) carries the FULL conversation ids; only the
        part after the common prefix with the episode's history is fed (the cache is cut back if an earlier token
        changed)."""
        news = [(eid, self._rewind(eid, full) if eid in self.episodes else list(full), *rest)
                for eid, full, *rest in requests]
        self._full = True
        try:
            return self.step(news, follow, release)
        finally:
            self._full = False

    def _rewind(self, eid: Hashable, full: list[int], row: int | None = None) -> list[int]:
        """The ids of `full` after its common prefix with the episode's history; history (and cache) after that
        prefix is dropped. row: the arena row that holds the episode's cache (ep.n_cached of its columns)."""
        ep = self.episodes[eid]
        p = 0
        n = min(len(full), len(ep.ids))
        while p < n and full[p] == ep.ids[p]:
            p += 1
        p = min(p, len(full) - 1)                      # something must be fed to get next-token logits
        assert p >= 0, f"episode {eid!r}: empty conversation"
        if p < len(ep.ids):                            # rewind: drop history (and cache) after p
            self.stats["rewinds"] += p < ep.n_cached
            ep.ids = ep.ids[:p]
            if ep.n_cached > p:
                ep.n_cached = p
                if row is not None:                    # the arena row's later columns are written again
                    self._lens[row] = p
                    self._st[LEN, row] = p                 # `_collect` reads the lengths back from the device
                elif isinstance(ep.kv, HostKV):        # cut on the host: through a pageable copy, into new blocks
                    with self._timed():
                        kv = torch.empty(ep.kv.shape, dtype=ep.kv.dtype)       # (layers, 2, Hkv, n, D)
                        self._reload(ep.kv, kv)                  # (its blocks go back to the pool)
                        ep.kv = self._host(kv[:, :, :, :p]) if p > 0 else None
                elif ep.kv is not None:
                    ep.kv = ep.kv[:, :, :, :p].clone() if p > 0 else None
                if ep.kv is None and row is None:
                    self._resident.pop(eid, None)
        return list(full[p:])

    @torch.no_grad()
    def step(self, requests: list[tuple], follow: Follow | None = None, release: bool = False) -> list[Result]:
        """requests: [(episode_id, new_ids) or (episode_id, new_ids, max_new_tokens)], one per episode.

        new_ids are the tokens appended since the episode's last call (the whole prompt on the first).
        Returns [(episode_id, sampled_ids, sampled_logprobs, finish_reason)] in request order;
        finish_reason is "stop" (a stop id was sampled, and is included), "length" (budget) or "context".

        follow: called with each result as soon as its row finishes; it returns the episode's next turn
        (new_ids or (new_ids, max_new_tokens)), which joins the batch in this same call, or None (the episode
        leaves), or a concurrent.futures.Future of either while the episode's tools run: its row waits with the
        cache in place and the other rows go on decoding. Turns then overlap across episodes: a row that finishes
        early takes its episode's next turn instead of idling until the longest row of the batch is done. `step`
        returns each episode's last result. release: an episode that leaves is released (its cache freed).
        """
        assert len({r[0] for r in requests}) == len(requests), "one request per episode per step"
        results, queue = {}, []
        self._follow, self._release = follow, release and follow is not None
        try:
            for eid, new, *rest in requests:
                self.episodes.setdefault(eid, _Episode([], 0, None, episode_generator(self.seed, eid)))
                self._enqueue(eid, new, rest[0] if rest else None, results, queue)
            while queue or self._waiting:      # a follow-up turn that does not fit the arena waits for the next run
                if not queue:                  # only answers still to come for episodes without a row
                    self._poll(results, block=True, queue=queue)
                    continue
                self._later = []
                self._run(queue, results)
                queue = self._later
        finally:
            self._follow, self._later, self._waiting, self._release = None, [], [], False
        return [results[r[0]] for r in requests]

    def _enqueue(self, eid: Hashable, new: list[int], budget: int | None, results: dict, queue: list,
                 row: int | None = None) -> bool:
        """Append a turn's new ids to the episode and queue (episode, budget); a turn with no context left is a
        "context" result at once (and, with follow, asks for the next one). row: where its cache is, if in the
        arena. True if the episode left (follow answered None)."""
        while True:
            ep = self.episodes[eid]
            ep.ids.extend(int(t) for t in new)
            assert len(ep.ids) > ep.n_cached, f"episode {eid!r}: nothing to feed (pass the new observation ids)"
            budget = min(self.max_new_tokens if budget is None else budget, self.max_context - len(ep.ids))
            if budget > 0:
                queue.append((eid, budget))
                return False
            results[eid] = (eid, [], [], "context")
            if self._follow is None:
                return False
            nxt = self._follow(results[eid])
            if isinstance(nxt, Future):
                self._waiting.append((eid, nxt))
                return False
            if nxt is None:
                return True
            new, budget = _turn(nxt)
            if self._full:
                new = self._rewind(eid, new, row)

    # ---- scheduling ---------------------------------------------------------------------------------

    def _run(self, queue: list[tuple[Hashable, int]], results: dict) -> None:
        """Continuous batching over the queued (episode, budget) pairs until all have finished."""
        eps = self.episodes
        cap = max(len(eps[e].ids) + b for e, b in queue)                 # every row's final length fits
        if self.kv_budget is None:   # and all rows' padded prefills at once (with a budget _admit splits them)
            n_feed = max(len(eps[e].ids) - eps[e].n_cached for e, _ in queue)
            cap = max(cap, max(eps[e].n_cached for e, _ in queue) + n_feed)
        self._mixed = self._follow is not None and self.feed_tokens > 0 and self.kv_budget is None
        if self._mixed:   # follow-ups continue in their rows, each needing more columns: one growth (and the
            cap = min(2 * cap, max(cap, self.max_context))   # graph captures after it) fewer
        cap = -(-cap // 64) * 64                                          # arena columns C
        B = min(self.max_batch, len(queue))
        if self.kv_budget is not None:
            row = cap * self.kv_token_bytes
            if row > self.kv_budget:
                raise ValueError(f"kv_budget_gib={self.kv_budget / 2 ** 30:.4g}: one arena row of {cap} tokens needs "
                                 f"{row / 2 ** 30:.4g} GiB ({self.kv_token_bytes} bytes per token)")
            B = min(B, self.kv_budget // row)
            self._evict(B * row)                                          # make room for the arena
        admit_min = min(self.admit_min, B)
        self._B = B               # + one scratch row in mixed runs: where rows that do not sample write their keys
        self.arena = torch.zeros(self.n_layers, 2, B + self._mixed, self.n_kv, cap, self.head_dim,
                                 dtype=self.dtype, device=self.device)   # (layers, 2, B (+1), Hkv, C, D)
        self._kv_resident()
        self.stats["arena_rows_max"] = max(self.stats["arena_rows_max"], B)
        self.rows: list[_Row] = []
        self._n_alive = 0
        T = max(b for _, b in queue)
        if self._follow is not None:     # follow-up turns may take the engine's whole budget
            T = max(T, self.max_new_tokens)
        dev = self.device
        self._st = torch.zeros(6, B, dtype=torch.long, device=dev)       # the decode state, see above `Engine`
        self._st[TOK] = self.pad_id
        self._lens = [0] * B                                              # host copy of _st[LEN] at the last collect
        self._out = torch.zeros(B, T + 1, dtype=torch.long, device=dev)  # (B, T + 1) sampled ids
        self._lps = torch.zeros(B, T + 1, dtype=torch.float32, device=dev)
        self._u = torch.zeros(B, T + 1, device=dev) if self.temperature > 0 else None
        self._cols = torch.arange(cap, device=dev)                        # (C,) for the masks
        self._last0 = torch.zeros(B, dtype=torch.long, device=dev)       # (B,) decode: logits at j = 0
        self._n_feed = 0                                                  # rows waiting for (the rest of) a feed
        if self._mixed:
            self._mixed_buffers(B)
        self._in_run = {e for e, _ in queue}
        # similar feed lengths prefill together (less padding); follow-up turns are appended as rows finish
        self._queue = sorted(queue, key=lambda q: len(eps[q[0]].ids) - eps[q[0]].n_cached)
        try:
            while self._queue or self._n_alive or self._n_feed or self._n_wait or self._waiting:
                if self._n_wait or self._waiting:   # block when nothing decodes and no waiting turn can start
                    idle = not (self._n_alive or self._n_feed)
                    self._poll(results, block=idle and (not self._queue or self._n_wait >= B))
                # admit when a group of admit_min fits, when nothing decodes, or when the whole queue fits (with
                # follow only once it outnumbers the decoding rows: more follow-ups are on their way)
                busy = self._n_alive + self._n_feed + self._n_wait
                if self._n_wait and len(self._queue) > B - busy:   # queued turns need the rows tools wait in
                    self._give_up_rows(len(self._queue) - (B - busy))
                    busy = self._n_alive + self._n_feed + self._n_wait
                k = min(len(self._queue), B - busy)
                admit = k > 0 and (self._n_alive == 0 or k >= admit_min or (
                    k == len(self._queue) and (self._follow is None or k >= self._n_alive)))
                n_dead = len(self.rows) - busy
                if n_dead and (admit or n_dead >= self.compact_min or self._n_alive == 0):
                    self._compact()
                if admit:
                    group, self._queue = self._queue[:k], self._queue[k:]
                    self._admit(group, results)
                if self._n_alive or self._n_feed:
                    self._decode(results)
        except BaseException:
            self._graphs = {}
            for r in self.rows:              # their caches lived in the arena: drop them, never leave a torn state
                if r.alive or r.feed is not None or r.wait is not None:
                    self.release(r.eid)
            raise
        finally:
            self._graphs = {}                    # they point into the arena and the state: drop them first
            self.arena, self.rows, self._in_run, self._queue, self._n_wait = None, [], set(), [], 0
            self._st = self._out = self._lps = self._u = self._cols = self._last0 = self._fd = None

    def _compact(self) -> None:
        """Move alive rows to the front of the arena (in place, increasing order: never overwrites a source)."""
        keep = [i for i, r in enumerate(self.rows) if r.alive or r.feed is not None or r.wait is not None]
        for new, old in enumerate(keep):
            if new != old:
                n = self._lens[old]
                fused_ops.copy_kv(self.arena[:, :, new, :, :n], self.arena[:, :, old, :, :n])
        k, idx = len(keep), self._h2d(keep)
        for t in (self._out, self._lps, self._u):
            if t is not None:
                t[:k] = t[idx]                                   # (k, T + 1); the gather copies first
        self._st[:, :k] = self._st[:, idx]
        self._st[:, k:] = 0                                      # freed rows: dead, decoding a pad at column 0
        self._st[TOK, k:] = self.pad_id
        self._lens = [self._lens[i] for i in keep] + [0] * (len(self._lens) - k)
        self.rows = [self.rows[i] for i in keep]
        self.stats["compactions"] += 1

    def _admit(self, group: list[tuple[Hashable, int]], results: dict) -> None:
        """Load the group's caches into free rows, prefill their new tokens (in chunks of rows), sample one token.

        Its wall time goes to stats["admit_s"]: the stream is idle at entry and `_collect` syncs at the end."""
        t0 = time.perf_counter()
        self.stats["admissions"] += 1
        r0 = len(self.rows)
        on_host = any(isinstance(self.episodes[e].kv, HostKV) for e, _ in group)
        with self._timed(on_host):                               # offloaded caches come back host -> arena
            for i, (eid, budget) in enumerate(group):
                ep = self.episodes[eid]
                dst = self.arena[:, :, r0 + i, :, :ep.n_cached]  # (layers, 2, Hkv, n, D) view
                if isinstance(ep.kv, HostKV):
                    self._reload(ep.kv, dst)
                    self.stats["kv_reloaded_tokens"] += ep.n_cached
                elif ep.kv is not None:
                    fused_ops.copy_kv(dst, ep.kv)
                ep.kv = None                                     # the arena owns it until the row finishes
                self._resident.pop(eid, None)
                self.rows.append(_Row(eid, budget))
                self._lens[r0 + i] = ep.n_cached
        self._n_alive += len(group)
        if self._u is not None:
            u = torch.stack([self._uniforms(eid, budget) for eid, budget in group])          # (k, T + 1)
            self._u[r0:r0 + len(group)] = u.to(self.device, non_blocking=True)
        C = self.arena.shape[4]
        i = 0
        while i < len(group):    # chunks of rows with <= prefill_tokens positions whose padded feeds fit C
            j, q, start = i, 0, 0
            while j < len(group):
                e = self.episodes[group[j][0]]
                q2, start2 = max(q, len(e.ids) - e.n_cached), max(start, e.n_cached)
                if j > i and ((j + 1 - i) * q2 > self.prefill_tokens or start2 + q2 > C):
                    break
                q, start, j = q2, start2, j + 1
            self._prefill(r0 + i, r0 + j, results)
            i = j
        self.stats["admit_s"] += time.perf_counter() - t0

    def _prefill(self, a: int, b: int, results: dict) -> None:
        """Feed rows a..b-1 their pending + new tokens, right-padded to the longest; sample each row's first token."""
        rows = self.rows[a:b]
        feeds = [self.episodes[r.eid].ids[n:] for r, n in zip(rows, self._lens[a:b])]
        q = max(map(len, feeds))
        ids = self._h2d([f + [self.pad_id] * (q - len(f)) for f in feeds])                          # (B, q)
        start = self._h2d(self._lens[a:b])                                                          # (B,)
        last = self._h2d([len(f) - 1 for f in feeds])                                               # (B,)
        logits = self._forward(a, b, ids, start, last)                                              # (B, V)
        for i, (r, f) in enumerate(zip(rows, feeds)):
            self._lens[a + i] += len(f)
            self.fed[r.eid] = self.fed.get(r.eid, 0) + len(f)
        self.stats["prefill_tokens"] += sum(map(len, feeds))
        self.stats["prefill_positions"] += ids.numel()
        k = b - a                                # the rows' state: all alive, whole budget, nothing sampled
        self._st[LEN:, a:b] = self._h2d([self._lens[a:b], [r.budget for r in rows], [0] * k, [1] * k, [0] * k])
        self._sample(a, b, logits, results)

    def _decode(self, results: dict) -> None:
        """One token for every row in the arena (dead rows ride along until compaction; their output is dropped);
        while rows wait for a follow-up turn's tokens, a mixed step that also feeds them (`_plan_feed`).

        With CUDA graphs the step always covers all arena rows (unused ones decode a pad at column 0), so one
        graph, captured on the first decode of a `step` call, serves every decode of that call (and one more
        every mixed step)."""
        st = self._st
        if self._n_feed:
            n = self._B
            self._plan_feed()
            logits = self._graphed("mixed", self._forward_mixed)                                       # (B, V)
            st[LEN, :n] += st[ALIVE, :n]
            st[LEN:, :n] = torch.where(self._fd_set > 0, self._fd_val, st[LEN:, :n])   # the fed rows' new state
            self.stats["feed_steps"] += 1
        else:
            n = self._B if self.static_batch else len(self.rows)
            ids, start = st[TOK, :n, None], st[LEN, :n]                                             # (B, 1), (B,)
            logits = self._graphed("decode", lambda: self._forward(0, n, ids, start, self._last0[:n],
                                                                   st[ALIVE, :n] > 0))             # (B, V)
            start += st[ALIVE, :n]                               # the fed token is cached now (start is _st[LEN])
        self.stats["decode_positions"] += n
        self.stats["decode_steps"] += 1
        self._sample(0, n, logits, results)

    def _graphed(self, name: str, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """forward() through a CUDA graph where graphs are on: it reads static buffers (`_st`, the arena, the feed
        plan), the same memory at every step of a `step` call, and returns static logits.

        The first capture of a name in this engine runs the step eagerly on the side stream first (a real step:
        it writes the same K/V the graph will; Triton compiles, cuBLAS sets up its workspace), then captures it.
        Later captures (the next `step` call, a wider arena) capture at once and replay: the eager forward costs
        about four graph replays at the Qwen3-30B-A3B shape. A capture failure without the warm-up retries with
        it; one with it switches graphs off for this engine and records why."""
        if not self.cuda_graphs:
            return forward()
        if name in self._graphs:
            graph, out = self._graphs[name]
            graph.replay()
            self.stats["graph_replays"] = self.stats.get("graph_replays", 0) + 1
            return out
        t0 = time.perf_counter()
        warm = name not in self._warm
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        if warm:
            with torch.cuda.stream(side):
                out = forward().clone()                                       # warm-up = this step's result
            torch.cuda.current_stream().wait_stream(side)
        # capture_begin/end on the side stream, not `torch.cuda.graph(...)`: its entry synchronizes and empties
        # the allocator's device and pinned-host caches (older torch also runs gc.collect()), so the allocations
        # after every capture went back to cudaMalloc
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out_g = forward()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            self._graphs[name] = (graph, out_g)
            self._warm.add(name)
            self.stats["graph_captures"] = self.stats.get("graph_captures", 0) + 1
            if not warm:
                graph.replay()                                                # this step's result
                out = out_g
        except RuntimeError as e:   # capture is best effort: eager decode stays correct
            if not warm:
                self._warm.discard(name)
                return self._graphed(name, forward)
            self.cuda_graphs, self.graph_error = False, f"{type(e).__name__}: {str(e)[:300]}"
            self._graphs = {}
        torch.cuda.synchronize(self.device)                  # once per graph and `step` call: time it
        self.stats["graph_capture_s"] += time.perf_counter() - t0
        return out

    def _sample(self, a: int, b: int, logits: torch.Tensor, results: dict) -> None:
        """Sample for arena rows a..b-1 (logits (b - a, V)) and update their state on the device (dead and unused
        rows sample too; their draws are dropped), then `_collect`."""
        tok, _, left, nout, alive, done = self._st[:, a:b]                      # (b - a,) views each
        col = nout[:, None]                                                      # (b - a, 1) output column
        u = None if self._u is None else self._u[a:b].gather(1, col).squeeze(1)                 # (b - a,)
        ids, lps = sample_rows(logits, u, self.temperature, self.top_p, self.top_k)             # (b - a,) each
        self._out[a:b].scatter_(1, col, ids[:, None])
        self._lps[a:b].scatter_(1, col, lps[:, None])
        tok.copy_(ids.masked_fill(alive == 0, self.pad_id))
        nout += alive
        left -= alive
        torch.bitwise_and(alive, self._stop[ids] | (left <= 0), out=done)
        alive -= done
        self._collect(a, b, results)

    def _collect(self, a: int, b: int, results: dict) -> None:
        """The host's one sync per sample: read rows a..b-1's counters; rows that finished copy their cache out
        and report (one more copy, for their tokens)."""
        lens, _, nout, _, done = self._fetch(self._st[LEN:, a:b])[0]
        self._lens[a:b] = lens
        fin = [i for i, d in enumerate(done) if d]
        if not fin:
            return
        lo, hi, m = fin[0], fin[-1] + 1, max(nout[i] for i in fin)
        out, lps = self._fetch(self._out[a + lo:a + hi, :m], self._lps[a + lo:a + hi, :m])
        for i in fin:
            r, n = self.rows[a + i], nout[i]
            toks, lp = out[i - lo][:n], lps[i - lo][:n]
            ep = self.episodes[r.eid]
            ep.ids.extend(toks)
            assert lens[i] == len(ep.ids) - 1, "cache must hold all but the pending sampled token"
            if self._u is not None:
                torch.rand(n, generator=ep.gen)                   # the n uniforms the row used
            self.fed[r.eid] += n - 1                              # its decode steps fed one token each
            self.stats["decode_tokens"] += n - 1
            results[r.eid] = (r.eid, toks, lp, "stop" if toks[-1] in self.stop_ids else "length")
            r.alive = False
            self._n_alive -= 1
            ep.n_cached = lens[i]                                 # in the arena row until it is stored
            nxt = self._follow(results[r.eid]) if self._follow is not None else None
            if isinstance(nxt, Future):                           # its tools run: the row waits (`_poll`)
                r.wait = nxt
                self._n_wait += 1
                continue
            self._next_turn(a + i, nxt, results)

    def _next_turn(self, row: int, nxt, results: dict) -> None:
        """A finished row's episode goes on with follow's answer `nxt` (or leaves: None): its next turn continues in
        the row (mixed steps) or queues for admission, and otherwise the row's cache is copied out."""
        r = self.rows[row]
        ep, queue, left = self.episodes[r.eid], [], nxt is None
        if nxt is not None:      # the next turn (a "context" result instead, and follow asked again, if no room)
            new, budget = _turn(nxt)
            left = self._enqueue(r.eid, self._rewind(r.eid, new, row) if self._full else new, budget, results,
                                 queue, row)
        # the cache stays in the arena row unless turns wait for a row (they go first, as in a queue)
        if queue and self._mixed and not self._queue and self._feed_in_place(row, *queue[0]):
            return
        if left and self._release:
            self.release(r.eid)
            return
        self._store(ep, r.eid, self.arena[:, :, row, :, :self._lens[row]])   # (layers, 2, Hkv, n, D) view
        self._follow_up(queue)

    def _give_up_rows(self, n: int) -> None:
        """Up to n rows whose episodes wait for their tools copy their caches out (`_store`) and wait without a
        row, so that queued turns can take the rows (with a KV budget or more episodes than rows)."""
        for i, r in enumerate(self.rows):
            if n > 0 and r.wait is not None:
                self._store(self.episodes[r.eid], r.eid, self.arena[:, :, i, :, :self._lens[i]])
                self._waiting.append((r.eid, r.wait))
                r.wait, n = None, n - 1
                self._n_wait -= 1
                self.stats["rows_given_up"] += 1

    def _poll(self, results: dict, block: bool, queue: list | None = None) -> None:
        """Take follow's answers that have come (block: wait for one first): a waiting row's episode goes on in
        its row or leaves it; an episode without a row queues its turn (into `queue` between runs)."""
        if block:
            concurrent.futures.wait([r.wait for r in self.rows if r.wait is not None] + [f for _, f in self._waiting],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for i, r in enumerate(self.rows):
            if r.wait is not None and r.wait.done():
                nxt, r.wait = r.wait.result(), None
                self._n_wait -= 1
                self._next_turn(i, nxt, results)
        done = [(e, f) for e, f in self._waiting if f.done()]
        self._waiting = [(e, f) for e, f in self._waiting if not f.done()]
        for eid, f in done:
            nxt, q = f.result(), []
            if nxt is not None:
                new, budget = _turn(nxt)
                left = self._enqueue(eid, self._rewind(eid, new) if self._full else new, budget, results, q)
            if (nxt is None or left) and self._release:
                self.release(eid)
            elif queue is not None:
                queue.extend(q)
            else:
                self._follow_up(q)

    def _follow_up(self, queue: list[tuple[Hashable, int]]) -> None:
        """Queue follow-up turns for admission in this run (the arena grows if needed; with a KV budget, or a budget
        over the run's output columns, a turn waits for the next run)."""
        for eid, budget in queue:
            need = len(self.episodes[eid].ids) + budget
            if need > self.arena.shape[4] and self.kv_budget is None:
                self._grow(need)
            fits = need <= self.arena.shape[4] and budget < self._out.shape[1]
            (self._queue if fits else self._later).append((eid, budget))

    # ---- mixed steps: follow-up turns fed beside the decode ------------------------------------------

    def _mixed_buffers(self, B: int) -> None:
        """The feed plan a mixed step reads (static for CUDA graphs), staged on the host and copied in one go:
        P feed slots (ids, rows, columns), then per arena row the logit row it samples from and its state after
        the step where it was fed."""
        blk = fused_ops.feed_block(self.cfg.num_attention_heads // self.n_kv)
        P = -(-self.feed_tokens // blk) * blk
        self._fd_host = torch.zeros(3 * P + 7 * B, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._fd = torch.zeros(3 * P + 7 * B, dtype=torch.long, device=self.device)
        f = self._fd
        self._fd_ids, self._fd_rows, self._fd_pos = f[:P], f[P:2 * P], f[2 * P:3 * P]          # (P,) each
        self._fd_last = f[3 * P:3 * P + B]                                                     # (B,)
        self._fd_set = f[3 * P + B:3 * P + 2 * B]                                              # (B,) 1 = fed
        self._fd_val = f[3 * P + 2 * B:].view(5, B)                                            # LEN..DONE
        self._fd_block, self._rowidx = blk, torch.arange(B, device=self.device)

    def _feed_in_place(self, row: int, eid: Hashable, budget: int) -> bool:
        """The episode's next turn continues in its arena row: its tokens are fed by the next mixed steps."""
        ep = self.episodes[eid]
        need = len(ep.ids) + budget
        if budget >= self._out.shape[1]:
            return False
        if need > self.arena.shape[4]:
            self._grow(need)
        r = self.rows[row]
        ep.n_cached = self._lens[row]                      # the arena row holds them (ep.kv stays None)
        r.budget, r.feed = budget, ep.ids[ep.n_cached:]    # the pending sampled token, then the new ids
        self._n_feed += 1
        if self._u is not None:
            self._u[row] = self._uniforms(eid, budget).to(self.device, non_blocking=True)
        return True

    def _uniforms(self, eid: Hashable, budget: int) -> torch.Tensor:
        """A row's uniforms for its whole budget, (T + 1,), from a copy of its episode's generator (the generator
        itself advances by the number used when the row finishes)."""
        g = torch.Generator()
        g.set_state(self.episodes[eid].gen.get_state())
        u = torch.zeros(self._u.shape[1])
        u[:budget] = torch.rand(budget, generator=g)
        return u

    def _plan_feed(self) -> None:
        """Fill this step's feed slots from the rows waiting to be fed, in row order; a row's chunk starts at a
        block boundary. A row whose last token is fed samples its first token from it in this same step."""
        B, P, blk = self._B, self._fd_ids.shape[0], self._fd_block
        ids, rows, pos = [self.pad_id] * P, [B] * P, [0] * P     # padding: the scratch row, column 0
        last, setl, val = list(range(B)), [0] * B, [[0] * B for _ in range(5)]
        s = 0
        for i, r in enumerate(self.rows):
            if r.feed is None or s >= P:
                continue
            n, L = min(len(r.feed), P - s), self._lens[i]
            ids[s:s + n], rows[s:s + n], pos[s:s + n] = r.feed[:n], [i] * n, range(L, L + n)
            r.feed = r.feed[n:]
            self._lens[i] = L + n
            self.fed[r.eid] = self.fed.get(r.eid, 0) + n
            self.stats["prefill_tokens"] += n
            setl[i], val[0][i] = 1, L + n                         # LEN; LEFT, NOUT, ALIVE, DONE = 0
            if not r.feed:                                        # fed: it samples now, from its last position
                last[i] = B + s + n - 1
                val[1][i], val[3][i] = r.budget, 1
                r.feed, r.alive = None, True
                self._n_feed -= 1
                self._n_alive += 1
            s += -(-n // blk) * blk
        self.stats["prefill_positions"] += P
        self._fd_host.copy_(torch.tensor(ids + rows + pos + last + setl + sum(val, [])))
        self._fd.copy_(self._fd_host, non_blocking=True)

    def _forward_mixed(self) -> torch.Tensor:
        """A mixed step as one flat batch (1, B + P): the B arena rows' pending tokens (a row that does not sample
        writes its keys to the scratch row), then the feed slots; logits (B, V) at each row's sample position."""
        B, st = self._B, self._st
        alive = st[ALIVE, :B]
        rows = torch.cat([torch.where(alive > 0, self._rowidx, B), self._fd_rows])                   # (N,)
        pos = torch.cat([st[LEN, :B] * alive, self._fd_pos])                                         # (N,)
        ids = torch.cat([st[TOK, :B], self._fd_ids])[None]                                           # (1, N)
        N, C = ids.shape[1], self.arena.shape[4]
        cache = Cache(layers=[RaggedLayer(self.arena[l, 0], self.arena[l, 1], rows[None], pos[None])
                              for l in range(self.n_layers)])
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device).expand(1, 1, N, C)   # unread
        begin_feed(Feed(B, rows[B:], pos[B:], pos[:B] + 1, self._fd_block))
        try:   # the experts skip the padding slots and the rows that do not sample (moe_kernel.live_tokens)
            with self._engine_impl(), moe_kernel.live_tokens(rows < B):
                h = self.decoder(input_ids=ids, attention_mask=mask, position_ids=pos[None], use_cache=True,
                                 **{self._cache_kw: cache}).last_hidden_state                     # (1, N, hidden)
        finally:
            end_forward()
        self.stats["forwards"] += 1
        return self.head(h[0, self._fd_last]).float()                                             # (B, V)

    def _grow(self, need: int) -> None:
        """A wider arena (2x, or `need` columns) with the rows copied over; the graphs are captured again."""
        C = self.arena.shape[4]
        C2 = -(-max(need, 2 * C) // 64) * 64
        arena = self.arena.new_zeros(*self.arena.shape[:4], C2, self.arena.shape[5])   # (layers, 2, B, Hkv, C2, D)
        for r in range(arena.shape[2]):
            fused_ops.copy_kv(arena[:, :, r, :, :C], self.arena[:, :, r])
        self.arena, self._cols, self._graphs = arena, torch.arange(C2, device=self.device), {}
        self.stats["arena_grows"] += 1
        self._kv_resident()

    def _h2d(self, data) -> torch.Tensor:
        """Host ints (nested lists) as an int64 tensor on the device, copied without waiting for the stream."""
        return torch.tensor(data, dtype=torch.long).to(self.device, non_blocking=True)

    def _fetch(self, *tensors: torch.Tensor) -> list[list]:
        """Small device tensors as host lists, through one stream sync for all of them."""
        if self.device.type == "cuda":
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]   # into pinned memory
            torch.cuda.current_stream(self.device).synchronize()
        return [t.tolist() for t in tensors]

    # ---- KV memory budget ----------------------------------------------------------------------------

    def _store(self, ep: _Episode, eid: Hashable, kv: torch.Tensor) -> None:
        """A finished row's cache (an arena view) becomes the episode's idle cache: on the device if it fits the
        budget after evicting idle caches of episodes outside this step, else on host (or dropped)."""
        n = ep.n_cached = kv.shape[3]
        if self.kv_budget is None or self._evict(n * self.kv_token_bytes, keep=self._in_run):
            ep.kv = fused_ops.copy_kv(torch.empty(kv.shape, dtype=kv.dtype, device=kv.device), kv)
            self._resident[eid] = None                           # most recently used
            self._kv_resident()
        elif self.kv_evict == "drop":
            ep.kv, ep.n_cached = None, 0
            self.stats["kv_dropped_tokens"] += n
        else:
            with self._timed():
                ep.kv = self._host(kv)
            self.stats["kv_offloaded_tokens"] += n

    def _evict(self, need: int, keep: set = frozenset()) -> bool:
        """Evict idle caches on the device, least recently used first (not those in keep), until `need` more bytes
        fit the budget; whether they fit."""
        for eid in [e for e in self._resident if e not in keep]:
            if self._kv_resident() + need <= self.kv_budget:
                break
            ep = self.episodes[eid]
            del self._resident[eid]
            if self.kv_evict == "drop":          # re-prefilled from ep.ids when its turn comes
                self.stats["kv_dropped_tokens"] += ep.n_cached
                ep.kv, ep.n_cached = None, 0
            else:
                with self._timed():
                    ep.kv = self._host(ep.kv)
                self.stats["kv_offloaded_tokens"] += ep.n_cached
        return self._kv_resident() + need <= self.kv_budget

    def _kv_resident(self) -> int:
        """KV bytes on the device now (the arena + idle caches of resident episodes); records the peak."""
        tensors = [self.episodes[e].kv for e in self._resident] + [self.arena]
        n = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        self.stats["kv_peak_resident_gib"] = max(self.stats["kv_peak_resident_gib"], n / 2 ** 30)
        return n

    def _host(self, kv: torch.Tensor) -> HostKV:
        """Offload kv (layers, 2, Hkv, n, D) into the host pool; the caller's `_timed` waits for the copies."""
        h = offload(self._pool, kv)
        self.stats["kv_host_gib"] = self._pool.allocated * self._pool.block / 2 ** 30
        self.stats["kv_host_alloc_s"] = self._pool.alloc_s
        return h

    def _reload(self, h: HostKV, dst: torch.Tensor) -> None:
        reload(self._pool, h, dst)

    @contextlib.contextmanager
    def _timed(self, on: bool = True):
        """Add the block's wall time to stats["kv_offload_s"], synchronizing CUDA so that async copies count."""
        sync = on and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        yield
        if sync:
            torch.cuda.synchronize(self.device)
        if on:
            self.stats["kv_offload_s"] += time.perf_counter() - t

    # ---- the model call ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _engine_impl(self):
        """Route attention (and optionally experts and fused ops) through the engine's choice for these calls only."""
        cfg, old_attn = self.cfg, self.cfg._attn_implementation
        old_exp = self.model.get_experts_implementation() if self.experts else None
        cfg._attn_implementation = self.attn_name
        if self.experts:
            self.model.set_experts_implementation(self.experts)
        try:
            with contextlib.ExitStack() as stack:
                if self.fused:
                    stack.enter_context(fused_ops.patch(self._fused_targets))
                    stack.enter_context(patch_attention(self._fused_targets.attentions, self._qkv))
                yield
        finally:
            cfg._attn_implementation = old_attn
            if self.experts:
                self.model.set_experts_implementation(old_exp)

    def _forward(self, a: int, b: int, ids: torch.Tensor, start: torch.Tensor, last: torch.Tensor,
                 live: torch.Tensor | None = None) -> torch.Tensor:
        """Rows a..b-1 of the arena: ids (B, q) written at columns start_b + j; returns logits at j = last_b, (B, V).
        The MoE experts skip padding (j > last_b) and rows where live (B,) is False (moe_kernel.live_tokens)."""
        B, q = ids.shape
        pos = start[:, None] + self._cols[:q]                                            # (B, q) = columns
        mask = (self._cols <= pos[:, :, None])[:, None]                                  # (B, 1, q, C) causal per row
        rows = torch.arange(B, device=self.device)[:, None]                              # (B, 1)
        cache = Cache(layers=[RaggedLayer(self.arena[l, 0, a:b], self.arena[l, 1, a:b], rows, pos)
                              for l in range(self.n_layers)])
        real = self._cols[:q] <= last[:, None]                                            # (B, q)
        if live is not None:
            real = real & live[:, None]
        try:
            with self._engine_impl(), moe_kernel.live_tokens(real.reshape(-1)):
                h = self.decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                 **{self._cache_kw: cache}).last_hidden_state            # (B, q, hidden)
        finally:
            end_forward()
        self.stats["forwards"] += 1
        return self.head(h[torch.arange(B, device=self.device), last]).float()          # (B, V)


# --------------------------------------------------------------------------------------------------
# extension point: other rollout backends
# --------------------------------------------------------------------------------------------------


class RolloutBackend(Protocol):
    """What a rollout backend implements; `Engine` is the in-process one.

    A vLLM backend (not shipped: vLLM is not on the GPU image and its wheel is far over what a device run
    can carry, so it could not be tested) would map `step_full` onto vLLM's automatic prefix caching
    (`enable_prefix_caching=True`; a turn's prompt is the full conversation and only uncached blocks are
    prefilled), pass `SamplingParams(seed=..., logprobs=0)` per request, and after every PPO update reload the
    LoRA adapter (`LoRARequest(name, new_id, path)` with a fresh id, or `llm.llm_engine.add_lora`) so that
    rollouts use the current policy. Its log-probs would be used for logging only: the PPO ratio is always
    recomputed by the training-side model (paper §3.3, precision mismatch).
    """

    def step(self, requests: list[tuple], follow=None, release: bool = False) -> list[Result]: ...

    def step_full(self, requests: list[tuple], follow=None, release: bool = False) -> list[Result]: ...

    def release(self, episode_id: Hashable) -> None: ...
