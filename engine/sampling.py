"""Sampling for rollouts, shared by the engine (engine.Engine) and its plain reference: one uniform draw per
token from the episode's own generator, the inverse CDF of the filtered distribution, log-probs at T=1.

Smoke: python -m pytest -q tests/test_generate.py -k sample
"""
from __future__ import annotations

import inspect
import zlib
from typing import Hashable

import torch
from transformers.cache_utils import DynamicCache



def cache_kwarg(module) -> str:
    """The forward kwarg that takes the KV cache: `cache` in transformers >= 5.2x, `past_key_values` before."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module     # unwrap a peft model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def episode_generator(seed: int, episode_id: Hashable) -> torch.Generator:
    """The CPU generator an episode samples from: a stable function of (engine seed, episode id)."""
    key = zlib.crc32(repr(episode_id).encode())
    return torch.Generator().manual_seed((seed * 1_000_003 + key) % (2 ** 63))


def sample_next(logits: torch.Tensor, generators: list[torch.Generator], temperature: float = 1.0,
                top_p: float = 1.0, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. logits (B, V) -> (ids (B,), logprobs (B,) = log_softmax(logits) at T=1).

    temperature 0 is greedy (argmax, first max on ties, as `generate`). Otherwise row b draws one
    uniform u_b from generators[b] and takes the inverse CDF of its filtered distribution.
    """
    assert logits.dim() == 2 and len(generators) == logits.shape[0], "one generator per row"
    u = None if temperature <= 0 else torch.tensor(
        [torch.rand((), generator=g).item() for g in generators]).to(logits.device)      # (B,) float32
    return sample_rows(logits, u, temperature, top_p, top_k)


def sample_rows(logits: torch.Tensor, u: torch.Tensor | None, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next` with the uniforms given: u (B,) float32 on logits' device (None when greedy). No host sync."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)                                  # (B, V) at temperature 1
    if temperature <= 0:
        ids = logits.argmax(dim=-1)                                               # (B,)
    else:
        probs = torch.softmax(logits / temperature, dim=-1)                      # (B, V)
        order = None
        if top_k > 0 or top_p < 1.0:
            probs, order = probs.sort(dim=-1, descending=True)                   # (B, V) each
            keep = torch.ones_like(probs, dtype=torch.bool)
            if top_k > 0:
                keep[:, top_k:] = False
            if top_p < 1.0:
                keep &= (probs.cumsum(-1) - probs) < top_p                       # mass before it < top_p
            probs = probs * keep
        cdf = probs.cumsum(dim=-1)                                                # (B, V)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        idx = idx.clamp(max=cdf.shape[-1] - 1)                                    # (B,)
        ids = idx if order is None else order.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return ids, logprobs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def plain_turn(model, ids: list[int], max_new_tokens: int, stop_ids: set[int], generator: torch.Generator,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> tuple[list[int], list[float], str]:
    """Reference: one turn of the plain path. The whole conversation is re-encoded (fresh cache), then decoded
    one token at a time with a DynamicCache, sampling with `sample_next`. Returns (ids, logprobs, reason)."""
    dev = next(model.parameters()).device
    out, lps, inp = [], [], torch.tensor([ids], device=dev)                  # (1, n): the full conversation
    kw, cache = cache_kwarg(model), DynamicCache(config=model.config)
    for _ in range(max_new_tokens):
        logits = model(input_ids=inp, use_cache=True, **{kw: cache}).logits
        tok, lp = sample_next(logits[:, -1], [generator], temperature, top_p, top_k)   # logits (1, V)
        out.append(int(tok)), lps.append(float(lp))
        if out[-1] in stop_ids:
            return out, lps, "stop"
        inp = tok.view(1, 1)
    return out, lps, "length"
