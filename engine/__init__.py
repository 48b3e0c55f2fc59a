"""The rollout engine: multi-turn sampling that keeps each episode's KV cache across turns (`Engine`).

  generate.py          the engine (`Engine`, `HostKV`, `RolloutBackend`)
  ragged_attention.py  the engine's attention over its KV arena
  kv_host.py           offload of idle episodes' caches to pinned host blocks
  sampling.py          token sampling and the plain (re-encoding) turn
  fused_ops.py         Triton kernels for norms, rotary, routing, attention and KV copies
  moe_kernel.py        Triton MoE expert kernels (`Engine(experts="fused")`)
"""
from . import fused_ops, moe_kernel
from .generate import Engine, HostKV, RolloutBackend

__all__ = ["Engine", "HostKV", "RolloutBackend", "fused_ops", "moe_kernel"]
