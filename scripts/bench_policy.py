"""HFPolicy in an agent-shaped loop: per-turn time split into prompt building (chat template +
tokenize_conversation, incremental through EpisodeState.cache) and sampling, for the plain `generate` path
and the engine.Engine path (KV cache kept across turns), on the same random Qwen3-MoE.

Each of `episodes` conversations starts with a system + user prompt and the env's tool schemas; every turn
the policy acts on all of them at once, then each gets a tool observation of `obs_chars` characters.
Random weights produce random text, so turns rarely stop early: every turn is close to `new_tokens` long.
Reported per turn: prompt-build ms, sampling ms, sampled tokens/s, mean context length; then totals.

Departures: none from the paper (infrastructure).

Smoke (CPU, ~1 min): python scripts/bench_policy.py --model tiny --device cpu --episodes 2 --turns 2 --new-tokens 16
Full (H200):         python scripts/bench_policy.py --model small --device cuda --episodes 64 --turns 20
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from env import EpisodeState  # noqa: E402
from policy import HFPolicy, build_tiny_model_and_tokenizer, build_tiny_tokenizer  # noqa: E402
from tools import TOOLS  # noqa: E402

# random Qwen3-MoE shapes (Qwen3MoeConfig kwargs); "small" is ~0.7B total parameters
SHAPES = {"small": dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384, num_hidden_layers=12,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                        num_experts_per_tok=8)}


def build(name: str, device: str):
    if name == "tiny":
        model, tok = build_tiny_model_and_tokenizer(seed=0)
        return model.to(device), tok
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), max_position_embeddings=40960, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **SHAPES[name])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return Qwen3MoeForCausalLM(cfg).to(device=device, dtype=dtype).eval(), tok


def rollout(pol: HFPolicy, episodes: int, turns: int, obs_chars: int, device: str) -> dict:
    msgs = {e: [{"role": "system", "content": "You write fast kernels."},
                {"role": "user", "content": f"Task {e}: make ModelNew faster. " * 20}] for e in range(episodes)}
    caches = {e: {} for e in msgs}
    tot = dict(build_s=0.0, sample_s=0.0, tokens=0)
    for t in range(turns):
        states = [EpisodeState(e, msgs[e], TOOLS, caches[e]) for e in msgs]
        t0 = time.perf_counter()
        prompts = [pol.prompt_ids(s) for s in states]      # what act() does first (cache makes act's call cheap)
        t1 = time.perf_counter()
        acts = pol.act(states)
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        n = sum(len(a.token_ids) for a in acts)
        build = t1 - t0
        tot["build_s"] += build
        tot["sample_s"] += t2 - t1 - build       # act() builds the prompts again (cached), then samples
        tot["tokens"] += n
        ctx = sum(map(len, prompts)) / len(prompts)
        print(f"  turn {t:3d}: prompt build {1e3 * build:8.1f} ms | sampling {t2 - t1 - build:7.2f} s | "
              f"{n / max(t2 - t1 - build, 1e-9):9.1f} tok/s | mean context {ctx:7.0f}", flush=True)
        for e, a in zip(msgs, acts):
            msgs[e] = msgs[e] + [a.message(), {"role": "tool", "tool_call_id": f"c{t}", "content": "x" * obs_chars}]
    for e in msgs:
        pol.release(e)
    return tot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", *SHAPES])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--obs-chars", type=int, default=800)
    ap.add_argument("--paths", default="plain,engine", help="comma-separated: plain, engine")
    a = ap.parse_args()
    model, tok = build(a.model, a.device)
    print(f"model {a.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params on {a.device}; "
          f"{a.episodes} episodes x {a.turns} turns, {a.new_tokens} new tokens/turn, {a.obs_chars}-char observations")
    for path in a.paths.split(","):
        engine = None
        if path == "engine":
            from engine.generate import Engine
            engine = Engine(model, tok, max_batch=a.episodes, max_new_tokens=a.new_tokens, temperature=1.0,
                            stop_ids={tok.convert_tokens_to_ids("<|im_end|>")})
        pol = HFPolicy(model, tok, max_new_tokens=a.new_tokens, temperature=1.0, engine=engine)
        print(f"[{path}]")
        tot = rollout(pol, a.episodes, a.turns, a.obs_chars, a.device)
        print(f"[{path}] total: {tot['tokens']} tokens in {tot['sample_s']:.1f} s sampling = "
              f"{tot['tokens'] / max(tot['sample_s'], 1e-9):.1f} tok/s; prompt building {tot['build_s']:.2f} s "
              f"({100 * tot['build_s'] / max(tot['build_s'] + tot['sample_s'], 1e-9):.1f}% of the turn time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
