"""Task synthesis (paper §3.1): mine operators, compose them into KernelBench tasks, keep those that pass
execution filters, and write a JSONL training set with a manifest beside it.

What it does
  1. Catalogue, mined by introspection (`mine_catalogue`): every `torch.nn` Module class, every public
     `torch.nn.functional` callable, every `torch.*` function that is also a Tensor method, and, when
     transformers is importable, its activation classes and the RMSNorm/LayerNorm/MLP layers of a few model
     families. Required constructor/call arguments are filled by name rules (`_arg_value`: `in_channels`
     = the input's channel dim, `kernel_size` = 3 or 5, ...). Each candidate is probed on small random
     inputs of rank 2-5 (twice, to catch stochastic ops, and on the meta device, for shape inference).
     Everything not mined gets a one-line reason (stochastic, loss needs targets, needs integer inputs,
     no rule for a required argument, probe error, ...); `catalogue_report()` counts them.
  2. Composer (`compose_program`): seeded, no LLM. Draws the op count from the paper's mix (3.4/83.8/7.6/
     2.8/1.2 % for 1-5 ops, 1.2 % standalone transformers layers), a realistic start shape, then chains
     ops whose accepted ranks match, tracking shapes on the meta device. Emits KernelBench source:
     `class Model(nn.Module)`, `get_inputs()`, `get_init_inputs()`. `compose_llm` is the optional path
     (`--composer llm`): a policy from policy.py picks operators and writes the module.
  3. Filters, one named function each (`FILTERS`, in the order applied): duplicate (normalized-source
     hash), contamination (AST similarity > 0.9 to a KernelBench problem), runs_eager, deterministic,
     nondegenerate (finite; not constant; not all |y| < 0.01; outputs for two input sets differ beyond
     the 1e-2 verification tolerance), runtime (eager ms in [min_ms, max_ms]), runs_compile (torch.compile
     runs and agrees with eager). Execution filters run in isolated child processes (sandbox.run_isolated),
     several candidates per child; a crashing chunk is re-run one candidate at a time. Calibration
     (`--calibrate`, default on): a candidate below min_ms gets its `batch_size` times 2^k
     (`calibrated_code`) and is filtered again, up to twice. On an H200 without it, 177 of 188 candidates
     ran under 1 ms (median 0.076 ms); with it, 156 of 168 were accepted (README).
  4. Output: JSONL rows {code, ops, data_source, eager_ms, compile_ms, device, hash, seed, index} in
     candidate order, `<out>.manifest.json` (command, seed, versions, counts per category, rejections
     per filter, catalogue report), `<out>.progress.jsonl` (resume). Candidate i is drawn from its own
     RNG seeded by (seed, i), so a run is reproducible and resumable whatever the worker count.
  5. `load_tasks(source)`: our JSONL, a local JSONL/parquet of CUDA-Agent-Ops-6K (columns `code`, `ops`,
     `data_source`), or an HF dataset id via `datasets`. The trainer reads tasks only through it.
  6. `emit_demo`: a fused elementwise kernel (C++/OpenMP or CUDA) for tasks made only of pointwise ops with
     exact C equivalents; `write_demos` lays out sandbox workspaces (data/demos/).

AST similarity (contamination): both sources are parsed; each node, in ast.walk order, becomes a token:
its type name, plus the identifier for Name/Attribute/FunctionDef/ClassDef/arg nodes (constants become
the bare token "Constant", so sizes do not matter). Similarity = difflib.SequenceMatcher ratio of the
two token sequences (2*matches/total). Cheap upper bounds (real_quick_ratio, quick_ratio) skip most pairs.

Departures from the paper
  1. The paper's composer is an LLM; ours is programmatic by default (reproducible, free); the LLM path
     exists behind `--composer llm`.
  2. Op arguments come from name rules, not an LLM, so some ops (e.g. Bilinear, Fold) are skipped and
     listed with their reason instead.
  3. Determinism is checked by running the same inputs twice (allclose 1e-5), which also catches
     dropout-like ops the catalogue missed.
  4. The 1-100 ms window is for CUDA; `--scale cpu` uses smaller tensors and a 0.02-50 ms window so the
     pipeline (and the shipped tiny set) can be exercised without a GPU.
  5. `--no-timings` drops eager_ms/compile_ms from the JSONL: timings are the only run-dependent fields,
     so the same seed then gives a byte-identical file.
  6. Filters run cheapest-first (static, eager, runtime, then torch.compile), and runs_compile also requires
     the compiled output to match eager at 1e-2. Several workers share one GPU, so eager_ms includes some
     contention; `--workers 1` gives clean timings (the sandbox re-times baselines for rewards anyway).

Smoke: python cuda_agent.py synth --scale cpu --n-candidates 16 --out runs/synth/smoke.jsonl
Full:  python cuda_agent.py synth --device cuda --n-candidates 20000 --n-tasks 6000 --workers 12 \
           --kernelbench-dir ~/KernelBench --out runs/synth/ops6k.jsonl
Bench: python scripts/bench_synth.py --n-candidates 240 --workers 8   (H200: per-filter rates, tasks/hour)
"""
from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields

# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------


@dataclass
class SynthConfig:
    out: str = "runs/synth/tasks.jsonl"
    """output JSONL; the manifest goes to <out>.manifest.json, resume state to <out>.progress.jsonl"""
    n_candidates: int = 200
    """number of composed candidates to try"""
    n_tasks: int | None = None
    """stop once this many tasks are accepted (None: try all candidates)"""
    seed: int = 0
    """master seed; candidate i uses its own RNG seeded by (seed, i)"""
    device: str = "cpu"
    """device the filters run on: cpu | cuda"""
    scale: str = "auto"
    """tensor sizes and runtime window: cuda (1-100 ms, real sizes) | cpu (0.02-50 ms, small) | auto (= device)"""
    min_ms: float | None = None
    """lower bound of the eager runtime window in ms (None: the preset's)"""
    max_ms: float | None = None
    """upper bound of the eager runtime window in ms (None: the preset's)"""
    mix: str = "3.4,83.8,7.6,2.8,1.2,1.2"
    """percent of candidates with 1,2,3,4,5 torch ops and standalone transformers layers (paper §3.1)"""
    pointwise_frac: float = 0.0
    """fraction of candidates built only from pointwise ops with C equivalents (lets demos be generated)"""
    composer: str = "program"
    """program (seeded, no LLM) | llm (a policy picks operators and writes the module)"""
    policy: str = "openai"
    """llm composer backend: openai (OpenAI-compatible endpoint) | hf (local model path in --model)"""
    model: str = ""
    """llm composer: model name (openai) or checkpoint path (hf)"""
    endpoint: str = "http://127.0.0.1:8000/v1"
    """llm composer: OpenAI-compatible base URL"""
    kernelbench_dir: str | None = None
    """KernelBench checkout (KernelBench/level{N}/{id}_{Name}.py) for the contamination filter"""
    contamination_threshold: float = 0.9
    """drop a task whose AST similarity to any KernelBench problem is above this"""
    use_transformers: bool = True
    """mine transformers activations/norms/MLPs (standalone tasks) when transformers is importable"""
    workers: int = 2
    """parallel isolated filter processes"""
    chunk: int = 8
    """candidates per isolated child (amortizes torch import and compile warm-up)"""
    mem_limit_mb: int = 16384
    """memory limit of one isolated child (host RSS of its process tree)"""
    timeout_s: float = 900.0
    """wall-clock limit for one child (a chunk); a chunk that times out is re-run one candidate at a time"""
    compile_backend: str = "inductor"
    """torch.compile backend for the runs_compile filter (inductor is the paper's; aot_eager is fast)"""
    warmup: int = 3
    """untimed eager runs before timing"""
    iters: int = 10
    """timed eager runs (median is reported)"""
    calibrate: bool = True
    """grow the batch of a candidate that runs under min_ms by a power of two (inputs up to 2^29 elements)
    and filter it again, as a user sizes a task for the target GPU; the timing-dependent size means the
    same seed gives the same file only on the same kind of device (--no-calibrate: everywhere)"""
    timings: bool = True
    """record eager_ms/compile_ms in the JSONL (off: the same seed gives a byte-identical file)"""
    resume: bool = True
    """continue from <out>.progress.jsonl when it exists"""
    demos_dir: str | None = None
    """if set, write generated demo workspaces for accepted pointwise tasks here (+ index.jsonl)"""
    progress: bool = True
    """show a tqdm progress bar"""


PRESETS = {  # (min_ms, max_ms, min_numel, max_numel) of the first input
    "cuda": (1.0, 100.0, 2 ** 22, 2 ** 27),
    "cpu": (0.02, 50.0, 2 ** 12, 2 ** 16),   # wide: CPU timings are noisy on a shared machine
}
FILTERS = ("duplicate", "contamination", "runs_eager", "deterministic", "nondegenerate", "runtime",
           "runs_compile")
ATOL = RTOL = 1e-2   # the sandbox's verification tolerance (paper §3.2)

# --------------------------------------------------------------------------------------------------
# 1) operator catalogue, mined by introspection
# --------------------------------------------------------------------------------------------------

PROBE_SHAPES = {2: (4, 32), 3: (4, 16, 24), 4: (2, 8, 12, 12), 5: (2, 4, 6, 8, 8)}
_NO_RULE = object()
_SKIP_RULES = [   # (regex on the op name, reason): decided before probing
    (r"(?i)dropout|rrelu|gumbel|fractional|bernoulli|rand|multinomial|normal$", "stochastic"),
    (r"(?i)loss|nll|kl_div|cross_entropy|ctc", "loss: needs targets"),
    (r"^nn\.Lazy", "lazy module: same op as its non-lazy twin"),
    (r"^nn\.(Module|Sequential|ModuleList|ModuleDict|ParameterList|ParameterDict|Container|DataParallel|"
     r"RNNBase|RNNCellBase|Identity|SyncBatchNorm)$", "container/wrapper/identity: no compute"),
    (r"(?i)embedding|one_hot|bincount|histc|histogram", "needs integer inputs"),
    (r"RNN|LSTM|GRU|Multihead|Transformer|multi_head|scaled_dot_product|^nn\.Bilinear$|^F\.bilinear$|grid_sample|"
     r"affine_grid|Unpool|unpool|Fold$|cosine_similarity|pairwise|CosineSimilarity|PairwiseDistance",
     "needs several tensor inputs or returns state"),
    (r"_$", "in-place variant"),
    (r"with_indices|^torch\.(sort|argsort|split|chunk|unbind|.*split.*)$", "returns a tuple/list"),
    (r"^torch\.(inverse|pinverse|det|logdet|slogdet|cholesky.*|lu.*|qr|svd|eig|symeig|geqrf|orgqr|ormqr|"
     r"triangular_solve|lstsq|solve|matrix_exp|matrix_power)$", "needs special matrix inputs (linear algebra)"),
    (r"^torch\.(clone|detach|contiguous|positive|real|conj|resolve_conj|resolve_neg|as_strided|"
     r"broadcast_to|nonzero_static|dequantize|int_repr|hash_tensor|slice_inverse)$", "no arithmetic (copy/view)"),
    (r"^F\.(upsample|upsample_bilinear|upsample_nearest)$", "deprecated alias of interpolate"),
    (r"scaled_mm|grouped_mm|conv_tbc|boolean_dispatch|handle_torch|has_torch|assert_int|^F\.[A-Z]",
     "not an operator / needs special dtypes"),
]
_PARAM_TENSORS = {"weight", "bias", "running_mean", "running_var", "target", "other", "input2", "x2",
                  "grid", "theta", "indices", "offsets", "mask", "tensor", "tensor1", "tensor2", "mat1", "mat2"}


def _arg_value(param: str, shape: tuple, rng: random.Random, ctx: str):
    """A realistic value for a required (or semantically needed) argument, given the input shape."""
    r, C, D = len(shape), shape[1] if len(shape) > 1 else shape[0], shape[-1]
    spatial = shape[2:] if r > 2 else shape[1:]
    pool = "pool" in ctx.lower()
    if param == "in_features":
        return D
    if param == "out_features":
        return rng.choice([max(8, D // 2), D, 2 * D])
    if param == "in_channels":
        return C
    if param == "out_channels":
        return rng.choice([16, 32, 64]) if C <= 4 else rng.choice([max(4, C // 2), C, 2 * C])
    if param == "kernel_size":
        return rng.choice([2, 3]) if pool else rng.choice([3, 5])
    if param in ("num_features", "num_channels"):
        return C
    if param == "normalized_shape":
        return [D]
    if param in ("hidden_size", "dim") and ctx.startswith("transformers"):
        return D
    if param == "dim":
        return -1
    if param == "num_groups":
        divs = [g for g in (2, 4, 8, 16, 32) if C % g == 0 and g < C]
        return rng.choice(divs) if divs else _NO_RULE
    if param == "norm_type":
        return 2.0
    if param == "output_size":
        out = tuple(max(1, s // 2) for s in spatial)
        return out[0] if len(out) == 1 else out
    if param in ("upscale_factor", "downscale_factor", "groups"):
        return 2
    if param == "size":
        return 5
    if param == "padding":
        return rng.choice([1, 2])
    if param in ("value",):
        return 0.0
    if param in ("threshold",):
        return 0.1
    return _NO_RULE


def _required(fn, skip_first: bool) -> list[str] | None:
    """Names of required parameters (None if the signature cannot be introspected)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    ps = [p for p in sig.parameters.values() if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if skip_first:
        ps = ps[1:]
    req = [p.name for p in ps if p.default is inspect.Parameter.empty]
    if any(p.name == "dim" and p.default is None for p in ps) and "dim" not in req:
        req.append("dim")   # softmax-like: an implicit dim is deprecated, so always pass one
    return req


def _resolve(name: str):
    """'nn.Conv2d' | 'F.gelu' | 'torch.tanh' | 'transformers.models.x.modeling_x:Cls' -> the callable."""
    import torch
    if ":" in name:
        mod, attr = name.split(":")
        return getattr(importlib.import_module(mod), attr)
    head, attr = name.split(".", 1)
    return getattr({"nn": torch.nn, "F": torch.nn.functional, "torch": torch}[head], attr)


def _call_op(entry: dict, kwargs: dict, device=None):
    """A callable x -> y for a catalogue entry with instantiated args (module built on `device`)."""
    import torch
    obj = _resolve(entry["name"])
    if entry["kind"] in ("module", "transformers"):
        if "config" in kwargs:
            cfg_cls = _resolve(entry["config_cls"])
            kwargs = {**{k: v for k, v in kwargs.items() if k != "config"}, "config": cfg_cls(**kwargs["config"])}
        with torch.device(device or "cpu"):
            return obj(**kwargs)
    args = entry.get("args", [])
    return (lambda x: obj(x, *args, **kwargs)[0]) if entry.get("index0") else (lambda x: obj(x, *args, **kwargs))


def instantiate(entry: dict, shape: tuple, rng: random.Random) -> dict | None:
    """Keyword arguments for this entry on an input of `shape`; None if a rule has no value."""
    kw = {}
    for p in entry["params"]:
        if p == "config":
            D = shape[-1]
            kw["config"] = {"hidden_size": D, "intermediate_size": rng.choice([2 * D, 4 * D]), "hidden_act": "silu"}
            continue
        v = _arg_value(p, shape, rng, entry["kind"] + ":" + entry["name"])
        if v is _NO_RULE:
            return None
        kw[p] = v
    return kw


def _probe(entry: dict, rank: int) -> str | None:
    """Run the entry on a small randn input of `rank` (twice + on meta); None if fine, else a reason."""
    import torch
    shape = PROBE_SHAPES[rank]
    kw = instantiate(entry, shape, random.Random(0))
    if kw is None:
        return "no rule value for an argument at this rank"
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=g)
        fn = _call_op(entry, kw)
        with torch.no_grad():
            y1, y2 = fn(x), fn(x)
    except Exception as e:   # noqa: BLE001 - any failure means "not usable like this"
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    if not isinstance(y1, torch.Tensor):
        return "non-tensor output"
    if not y1.is_floating_point():
        return "non-float output"
    if y1.dtype != x.dtype:
        return "changes dtype"
    if y1.dim() == 0 or y1.numel() < 2:
        return "reduces to a scalar"
    if not torch.isfinite(y1).all():
        return "needs a special input domain (non-finite on randn)"
    if y1.shape == x.shape and torch.equal(y1, x):
        return "no arithmetic (returns its input)"
    if y1.data_ptr() == x.data_ptr():
        return "no arithmetic (a view of its input)"
    if not torch.equal(y1, y2):
        return "stochastic"
    try:
        with torch.no_grad():
            ym = _call_op(entry, kw, device="meta")(torch.empty(shape, device="meta"))
        assert tuple(ym.shape) == tuple(y1.shape), "meta shape differs"
    except Exception as e:   # noqa: BLE001
        return f"no meta shape inference ({type(e).__name__})"
    return None


def _candidates(use_transformers: bool) -> tuple[list[dict], dict[str, str]]:
    """Introspect torch (and transformers) for operator candidates; pre-skip the obvious ones."""
    import torch
    nn, F = torch.nn, torch.nn.functional
    cands, skipped = [], {}
    for n in sorted(dir(nn)):
        c = getattr(nn, n)
        if inspect.isclass(c) and issubclass(c, nn.Module):
            cands.append({"name": f"nn.{n}", "kind": "module", "source": "torch", "req": _required(c.__init__, False)})
    for n in sorted(dir(F)):
        f = getattr(F, n)
        if not n.startswith("_") and callable(f) and not inspect.isclass(f):
            cands.append({"name": f"F.{n}", "kind": "functional", "source": "torch", "req": _required(f, True)})
    for n in sorted(dir(torch)):
        if not n.startswith("_") and hasattr(torch.Tensor, n) and callable(getattr(torch, n)):
            cands.append({"name": f"torch.{n}", "kind": "tensor", "source": "torch", "req": []})
    if use_transformers:
        cands += _transformers_candidates(skipped)
    out = []
    for c in cands:
        reason = next((r for pat, r in _SKIP_RULES if re.search(pat, c["name"])), None)
        c["req"] = [] if c["req"] is None else c["req"]   # builtin without a signature: let the probe decide
        if reason is None and (bad := [p for p in c["req"] if p in _PARAM_TENSORS]):
            reason = f"needs tensor argument '{bad[0]}' (parameters/targets: the nn.Module form is mined instead)"
        if reason:
            skipped[c["name"]] = reason
        else:
            out.append(c)
    return out, skipped


def _transformers_candidates(skipped: dict) -> list[dict]:
    """transformers activations (ACT2CLS) and the norm/MLP layers of a few model families."""
    try:
        import transformers.activations as A
    except Exception as e:   # noqa: BLE001
        skipped["transformers"] = f"not importable: {type(e).__name__}"
        return []
    out = []
    for key in sorted(A.ACT2CLS):
        v = A.ACT2CLS[key]
        cls, kw = (v if isinstance(v, tuple) else (v, {}))
        name = f"{cls.__module__}:{cls.__name__}"
        if cls.__module__ != A.__name__:
            skipped[f"transformers.{key}"] = "same class as a torch op (mined there)"
        elif not kw and all(c["name"] != name for c in out):
            out.append({"name": name, "kind": "transformers", "source": "transformers", "req": []})
        else:
            skipped[f"transformers.{key}"] = "variant of another activation (constructor flags)"
    for fam in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "t5"):
        try:
            m = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
        except Exception as e:   # noqa: BLE001
            skipped[f"transformers.{fam}"] = f"not importable: {type(e).__name__}"
            continue
        for n, c in sorted(vars(m).items()):
            if not (inspect.isclass(c) and c.__module__ == m.__name__ and n.endswith(("RMSNorm", "LayerNorm", "MLP"))):
                continue
            e = {"name": f"{m.__name__}:{n}", "kind": "transformers", "source": "transformers",
                 "req": _required(c.__init__, False)}
            if e["req"] == ["config"]:
                cfg = f"transformers.models.{fam}.configuration_{fam}:{n.replace('MLP', 'Config')}"
                e["config_cls"] = cfg
            out.append(e)
    return out


@functools.lru_cache(maxsize=2)
def mine_catalogue(use_transformers: bool = True) -> tuple[tuple[dict, ...], tuple[tuple[str, str], ...]]:
    """-> (entries, skipped). entry: {name, kind, source, params, ranks, args, index0, pointwise}.
    Leaves the caller's global RNG state and warning filters as they were."""
    import torch
    import warnings
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        cands, skipped = _candidates(use_transformers)
        entries = [e for c in cands if (e := _mine_one(c, skipped)) is not None]
    return tuple(entries), tuple(sorted(skipped.items()))


def _mine_one(c: dict, skipped: dict) -> dict | None:
    """The first call variant that probes fine on some rank (tensor ops try dim=-1, a scalar, clamp bounds)."""
    e = {"name": c["name"], "kind": c["kind"], "source": c["source"], "params": c["req"], "args": [],
         "index0": False, **({"config_cls": c["config_cls"]} if "config_cls" in c else {})}
    variants = [{}] if c["kind"] != "tensor" else [
        {"args": []}, {"params": ["dim"]}, {"params": ["dim"], "index0": True}, {"args": [2.0]},
        {"args": [-1.0, 1.0]}]
    hint = re.search(r"([123])d$", c["name"], re.I)   # Conv2d -> rank 4, BatchNorm1d -> rank 2 or 3
    ranks = ([2, 3] if hint.group(1) == "1" else [int(hint.group(1)) + 2]) if hint else [2, 3, 4, 5]
    reasons: list[str] = []
    for v in variants:
        ev = {**e, **v}
        res = {r: _probe(ev, r) for r in ranks}
        ok = [r for r, why in res.items() if why is None]
        if ok:
            ev["ranks"] = ok
            ev["pointwise"] = _c_expr(ev, {}) is not None
            return ev
        reasons += list(res.values())
    skipped[c["name"]] = "probe failed: " + _main_reason(reasons)
    return None


def _main_reason(vals: list[str]) -> str:
    for key in ("stochastic", "non-finite", "scalar", "non-float", "non-tensor", "returns its input", "view"):
        hit = [v for v in vals if key in v]
        if hit:
            return hit[0]
    return vals[0] if vals else "no variant applies"


def catalogue_report(use_transformers: bool = True) -> dict:
    """What was mined (per kind) and what was skipped (counts per reason + the full list)."""
    entries, skipped = mine_catalogue(use_transformers)
    by_kind: dict[str, int] = {}
    for e in entries:
        by_kind[e["kind"]] = by_kind.get(e["kind"], 0) + 1
    reasons: dict[str, int] = {}
    for _, why in skipped:
        key = why
        if why.startswith("needs tensor argument"):
            key = "needs tensor arguments (parameters/targets)"
        elif why.startswith("probe failed: "):
            exc = re.match(r"(\w+(Error|Exception))", why[len("probe failed: "):])
            key = (why if not exc else "probe failed: TypeError (needs other arguments or inputs)"
                   if exc.group(1) == "TypeError" else f"probe failed: {exc.group(1)} on randn inputs")
        reasons[key] = reasons.get(key, 0) + 1
    return {"mined": len(entries), "mined_by_kind": by_kind, "pointwise": sum(e["pointwise"] for e in entries),
            "skipped": len(skipped), "skipped_by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
            "mined_names": [e["name"] for e in entries], "skipped_list": dict(skipped)}


# --------------------------------------------------------------------------------------------------
# pointwise ops with exact C equivalents (torch's default arguments); used by the demo codegen
# --------------------------------------------------------------------------------------------------

_SOFTPLUS = "(v > 20.0f ? v : log1pf(expf(v)))"   # torch softplus: beta=1, threshold=20
_C_UNARY = {
    "relu": "fmaxf(v, 0.0f)", "relu6": "fminf(fmaxf(v, 0.0f), 6.0f)", "sigmoid": "1.0f / (1.0f + expf(-v))",
    "tanh": "tanhf(v)", "gelu": "0.5f * v * (1.0f + erff(v * 0.70710678118654752f))",   # exact (erf) GELU
    "silu": "v / (1.0f + expf(-v))", "elu": "(v > 0.0f ? v : expm1f(v))", "celu": "(v > 0.0f ? v : expm1f(v))",
    "selu": "1.0507009848776436f * (v > 0.0f ? v : 1.6732632423543772f * expm1f(v))",
    "leakyrelu": "(v > 0.0f ? v : 0.01f * v)", "leaky_relu": "(v > 0.0f ? v : 0.01f * v)",
    "hardtanh": "fminf(fmaxf(v, -1.0f), 1.0f)", "hardsigmoid": "fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f",
    "hardswish": "v * fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f", "softplus": _SOFTPLUS,
    "softsign": "v / (1.0f + fabsf(v))", "mish": "v * tanhf" + _SOFTPLUS, "tanhshrink": "v - tanhf(v)",
    "logsigmoid": "(v < 0.0f ? v - log1pf(expf(v)) : -log1pf(expf(-v)))",
    "hardshrink": "(fabsf(v) > 0.5f ? v : 0.0f)",
    "softshrink": "(v > 0.5f ? v - 0.5f : (v < -0.5f ? v + 0.5f : 0.0f))",
    "abs": "fabsf(v)", "absolute": "fabsf(v)", "neg": "-v", "negative": "-v", "exp": "expf(v)",
    "expm1": "expm1f(v)", "exp2": "exp2f(v)", "sin": "sinf(v)", "cos": "cosf(v)", "atan": "atanf(v)",
    "arctan": "atanf(v)", "sinh": "sinhf(v)", "cosh": "coshf(v)", "asinh": "asinhf(v)", "arcsinh": "asinhf(v)",
    "erf": "erff(v)", "erfc": "erfcf(v)", "square": "v * v", "trunc": "truncf(v)", "fix": "truncf(v)",
    "deg2rad": "v * 0.017453292519943295f", "rad2deg": "v * 57.295779513082323f",
}
_C_SCALAR = {   # torch.<op>(x, 2.0)
    "add": "v + 2.0f", "sub": "v - 2.0f", "subtract": "v - 2.0f", "mul": "v * 2.0f", "multiply": "v * 2.0f",
    "div": "v / 2.0f", "divide": "v / 2.0f", "true_divide": "v / 2.0f", "pow": "v * v",
    "fmod": "fmodf(v, 2.0f)", "remainder": "v - 2.0f * floorf(v / 2.0f)",
}


def _c_expr(entry: dict, kwargs: dict) -> str | None:
    """C expression in `v` computing this op exactly as torch does, or None (not a supported pointwise op)."""
    if entry["kind"] == "transformers" or entry.get("params") or kwargs or entry.get("index0"):
        return None
    base = entry["name"].split(".")[-1].lower()
    args = list(entry.get("args", []))
    if entry["kind"] == "tensor" and args == [2.0]:
        return _C_SCALAR.get(base)
    return _C_UNARY.get(base) if not args else None


# --------------------------------------------------------------------------------------------------
# 2) composer: seeded program (default) and LLM (optional)
# --------------------------------------------------------------------------------------------------

KIND_WEIGHTS = {"module": 0.5, "functional": 0.25, "tensor": 0.25}   # nn classes are the paper's seeds
RANK_WEIGHTS = {2: 0.3, 3: 0.2, 4: 0.4, 5: 0.1}
_DIM_NAMES = {2: ("batch_size", "features"), 3: ("batch_size", "channels", "length"),
              4: ("batch_size", "channels", "height", "width"),
              5: ("batch_size", "channels", "depth", "height", "width")}


def parse_mix(mix: str) -> list[float]:
    w = [float(v) for v in mix.split(",")]
    assert len(w) == 6 and all(v >= 0 for v in w) and sum(w) > 0, f"--mix needs 6 non-negative numbers, got {mix!r}"
    return w


def candidate_rng(seed: int, index: int) -> random.Random:
    """Candidate i's own RNG: results do not depend on worker count or order (resumable, reproducible)."""
    return random.Random(int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little"))


def _fit(shape: list[int], lo: int, hi: int) -> tuple:
    """Halve the largest even dim until numel <= hi; double the batch until numel >= lo."""
    while math.prod(shape) > hi:
        evens = [i for i, s in enumerate(shape) if s % 2 == 0 and s >= 4]
        if not evens:
            break
        i = max(evens, key=lambda j: (shape[j], -j))
        shape[i] //= 2
    while math.prod(shape) < lo:
        shape[0] *= 2
    return tuple(shape)


def start_shape(rank: int, rng: random.Random, preset: str) -> tuple:
    """A realistic input shape (KernelBench-like sizes) scaled into the preset's numel range."""
    lo, hi = PRESETS[preset][2:]
    c = rng.choice
    if rank == 2:
        s = [c([128, 256, 512, 1024, 2048, 4096]), c([256, 512, 1024, 2048, 4096, 8192])]
    elif rank == 3:
        s = [c([8, 16, 32, 64]), c([16, 32, 64, 128, 256]), c([128, 256, 512, 1024, 2048])]
    elif rank == 4:
        h = c([32, 64, 128, 224, 256])
        s = [c([8, 16, 32, 64]), c([3, 16, 32, 64, 128]), h, h]
    else:
        h = c([32, 64, 128])
        s = [c([2, 4, 8, 16]), c([3, 8, 16, 32]), c([8, 16, 32]), h, h]
    return _fit(s, lo, hi)


def _meta_shape(entry: dict, kw: dict, shape: tuple) -> tuple | None:
    import torch
    try:
        with torch.no_grad():
            y = _call_op(entry, kw, device="meta")(torch.empty(shape, device="meta"))
        return tuple(y.shape) if isinstance(y, torch.Tensor) and y.is_floating_point() else None
    except Exception:   # noqa: BLE001
        return None


def _pick(rng: random.Random, pool: list[dict], rank: int) -> dict | None:
    ok = [e for e in pool if rank in e["ranks"]]
    kinds = sorted({e["kind"] for e in ok})
    if not kinds:
        return None
    kind = rng.choices(kinds, weights=[KIND_WEIGHTS.get(k, 0.25) for k in kinds])[0]
    return rng.choice([e for e in ok if e["kind"] == kind])


def compose_program(entries, rng: random.Random, preset: str, mix: list[float],
                    pointwise_only: bool = False) -> dict | None:
    """One candidate: {code, ops, spec, data_source}; None if no consistent chain was found."""
    lo, hi = PRESETS[preset][2:]
    k = rng.choices([1, 2, 3, 4, 5, 0], weights=mix)[0]          # 0 = standalone transformers layer
    tf = [e for e in entries if e["kind"] == "transformers"]
    if k == 0 and tf and not pointwise_only:
        pool, k = tf, 1
    else:
        k = max(k, 1)
        pool = [e for e in entries if e["kind"] != "transformers" and (e["pointwise"] or not pointwise_only)]
    ranks = [r for r in RANK_WEIGHTS if any(r in e["ranks"] for e in pool)]
    rank = 3 if pool is tf and 3 in ranks else rng.choices(ranks, weights=[RANK_WEIGHTS[r] for r in ranks])[0]
    shape0 = shape = start_shape(rank, rng, preset)
    chain = []
    for _ in range(k):
        for _attempt in range(30):
            e = _pick(rng, pool, len(shape))
            kw = instantiate(e, shape, rng) if e else None
            out = _meta_shape(e, kw, shape) if kw is not None else None
            if out and 2 <= len(out) <= 5 and lo // 16 <= math.prod(out) <= hi * 4:
                break
        else:
            return None
        chain.append((e, kw))
        shape = out
    src = "transformers" if pool is tf else f"torch#{k}"
    return {"code": emit_source(chain, shape0, src), "data_source": src,
            "ops": [_op_label(e) for e, _ in chain],
            "spec": [{"name": e["name"], "kind": e["kind"], "args": e.get("args", []), "kwargs": kw,
                      "index0": e.get("index0", False)} for e, kw in chain]}


def _op_label(e: dict) -> str:
    return "transformers." + e["name"].split(":")[1] if e["kind"] == "transformers" else e["name"]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def emit_source(chain: list, shape: tuple, data_source: str) -> str:
    """KernelBench-format source for a chain of (entry, kwargs) applied to one input of `shape`."""
    imports, init, fwd, params, consts, attrs = [], [], [], [], {}, set()
    for i, (e, kw) in enumerate(chain):
        if e["kind"] in ("module", "transformers"):
            cls = e["name"].split(":")[-1].split(".")[-1]
            if e["kind"] == "transformers":
                imports.append(f"from {e['name'].split(':')[0]} import {cls}")
            attr = _snake(cls) if _snake(cls) not in attrs else f"{_snake(cls)}_{i}"
            attrs.add(attr)
            flat = {**{k: v for k, v in kw.items() if k != "config"}, **kw.get("config", {})}
            names = {}
            for k, v in flat.items():
                if isinstance(v, str):
                    continue
                n = k if k not in consts else f"{k}_{i}"
                consts[n], names[k] = v, n
                params.append(n)
            if "config" in kw:
                ccls = e["config_cls"].split(":")[1]
                imports.append(f"from {e['config_cls'].split(':')[0]} import {ccls}")
                cargs = ", ".join(f"{k}={names[k]}" if k in names else f"{k}={v!r}" for k, v in kw["config"].items())
                ctor = f"{cls}({ccls}({cargs}))"
            else:
                ctor = f"{cls if e['kind'] == 'transformers' else 'nn.' + cls}(" + ", ".join(
                    f"{k}={names[k]}" for k in kw) + ")"
            init.append(f"        self.{attr} = {ctor}")
            fwd.append(f"        x = self.{attr}(x)")
        else:
            call_args = [repr(a) for a in e.get("args", [])] + [f"{k}={v!r}" for k, v in kw.items()]
            call = f"{e['name']}(" + ", ".join(["x"] + call_args) + ")" + ("[0]" if e.get("index0") else "")
            fwd.append(f"        x = {call}")
    dims = _DIM_NAMES[len(shape)]
    lines = ["import torch", "import torch.nn as nn", "import torch.nn.functional as F"] + sorted(set(imports))
    lines += ["", "", "class Model(nn.Module):",
              f'    """Synthesized task ({data_source}): ' + " -> ".join(_op_label(e) for e, _ in chain) + '."""',
              "", f"    def __init__(self{''.join(', ' + p for p in params)}):", "        super().__init__()"]
    lines += init + ["", "    def forward(self, x):"] + fwd + ["        return x", "", ""]
    lines += [f"{d} = {s}" for d, s in zip(dims, shape)] + [f"{k} = {v!r}" for k, v in consts.items()]
    lines += ["", "", "def get_inputs():", f"    return [torch.randn({', '.join(dims)})]", "", "",
              "def get_init_inputs():", f"    return [{', '.join(params)}]", ""]
    return "\n".join(lines)


LLM_PROMPT = """You write PyTorch reference modules for a GPU-kernel benchmark (KernelBench format).
Write ONE module that applies these operators in sequence, with consistent shapes: {ops}.
Reply with a single ```python code block containing: the imports, `class Model(nn.Module)` whose
__init__ takes the hyperparameters as arguments, `forward`, module-level size constants, `get_inputs()`
returning a list of CPU tensors of realistic size made with torch.randn, and `get_init_inputs()` returning
the __init__ arguments. No randomness in forward (no dropout), no in-place input mutation."""


def compose_llm(policy, entries, rngs: list[random.Random], mix: list[float]) -> list[dict | None]:
    """Paper §3.1's composer: the policy picks/stacks the sampled operators and writes the module."""
    from policy import EpisodeState
    torch_entries = [e for e in entries if e["kind"] != "transformers"]
    picks = []
    for rng in rngs:
        k = max(1, rng.choices([1, 2, 3, 4, 5, 0], weights=mix)[0])
        picks.append([_op_label(e) for e in rng.sample(torch_entries, k)])
    states = [EpisodeState(episode_id=i, messages=[{"role": "user", "content": LLM_PROMPT.format(ops=", ".join(p))}])
              for i, p in enumerate(picks)]
    out = []
    for p, act in zip(picks, policy.act(states)):
        m = re.search(r"```(?:python)?\n(.*?)```", act.text or act.content or "", re.S)
        out.append({"code": m.group(1), "ops": p, "spec": [], "data_source": f"torch#{len(p)}"} if m else None)
    return out


def make_policy(cfg: SynthConfig):
    import policy
    if cfg.policy == "openai":
        return policy.OpenAIPolicy(cfg.model, endpoint=cfg.endpoint, max_tokens=2048)
    model, tok = policy.load_policy_model(cfg.model)
    return policy.HFPolicy(model, tok, max_new_tokens=2048, seed=cfg.seed)


# --------------------------------------------------------------------------------------------------
# 3) filters (§3.1). Static ones run in the parent; execution ones in an isolated child.
# --------------------------------------------------------------------------------------------------


def normalize_source(code: str) -> str:
    """Canonical text: parsed and unparsed (comments/whitespace gone), docstrings dropped."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def source_hash(code: str) -> str:
    try:
        text = normalize_source(code)
    except SyntaxError:
        text = code
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def filter_duplicate(code: str, seen: set) -> tuple[bool, str]:
    """Drop a task whose normalized source was seen before (adds it to `seen` when kept)."""
    h = source_hash(code)
    if h in seen:
        return False, f"duplicate of hash {h}"
    seen.add(h)
    return True, ""


def ast_tokens(code: str) -> list[str]:
    """Node-type sequence (ast.walk order) with identifiers kept and constants abstracted (see module doc)."""
    toks = []
    for node in ast.walk(ast.parse(code)):
        t = type(node).__name__
        ident = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            ident = node.name
        toks.append(f"{t}:{ident}" if isinstance(ident, str) else t)
    return toks


def ast_similarity(a: list[str], b: list[str], floor: float = 0.0) -> float:
    """difflib ratio of two token sequences; returns early (an upper bound < floor) when it cannot reach floor."""
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    if sm.real_quick_ratio() <= floor or sm.quick_ratio() <= floor:
        return min(sm.quick_ratio(), sm.real_quick_ratio())
    return sm.ratio()


def load_kernelbench(root: str) -> list[tuple[str, list[str]]]:
    """[(relative path, tokens)] for KernelBench/level*/*.py under `root` (or root itself being KernelBench/)."""
    import glob
    base = os.path.join(root, "KernelBench") if os.path.isdir(os.path.join(root, "KernelBench")) else root
    files = sorted(glob.glob(os.path.join(base, "level*", "*.py")))
    assert files, f"no KernelBench problems under {base} (expected level{{N}}/{{id}}_{{Name}}.py)"
    refs = []
    for f in files:
        try:
            refs.append((os.path.relpath(f, base), ast_tokens(open(f).read())))
        except SyntaxError:
            continue
    return refs


def filter_contamination(code: str, refs: list, threshold: float = 0.9) -> tuple[bool, str]:
    """Drop a task whose AST similarity to any KernelBench problem is above `threshold` (paper §3.1)."""
    toks = ast_tokens(code)
    best, where = 0.0, ""
    for name, ref in refs:
        s = ast_similarity(toks, ref, floor=threshold)
        if s > best:
            best, where = s, name
    return (best <= threshold), (f"AST similarity {best:.3f} to {where}" if best > threshold else "")


@dataclass
class Prepared:
    """A task instantiated on a device: model, two input sets (seeds s and s+1), the eager output on set 1."""
    model: object
    inputs: list
    inputs2: list
    device: str
    y: object = None
    info: dict = field(default_factory=dict)


def _to(xs, device):
    import torch
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


def prepare(code: str, device: str = "cpu", seed: int = 0) -> Prepared:
    """exec the task source, build Model(*get_init_inputs()) and two seeded input sets on `device`."""
    import torch
    ns: dict = {"__name__": "synth_task"}
    exec(compile(code, "<task>", "exec"), ns)
    for k in ("Model", "get_inputs", "get_init_inputs"):
        assert k in ns, f"task does not define {k}"
    torch.manual_seed(seed)
    model = ns["Model"](*ns["get_init_inputs"]()).to(device)
    torch.manual_seed(seed)
    inputs = _to(ns["get_inputs"](), device)
    torch.manual_seed(seed + 1)
    inputs2 = _to(ns["get_inputs"](), device)
    return Prepared(model, inputs, inputs2, device)


def _forward(model, inputs):
    import torch
    with torch.no_grad():
        return model(*inputs)


def filter_runs_eager(p: Prepared) -> tuple[bool, str]:
    """The task runs in eager mode and returns one floating-point tensor."""
    import torch
    try:
        y = _forward(p.model, p.inputs)
    except Exception as e:   # noqa: BLE001
        return False, f"eager error: {type(e).__name__}: {str(e)[:160]}"
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        return False, f"output is {type(y).__name__}, not a float tensor"
    p.y = y
    return True, ""


def filter_deterministic(p: Prepared) -> tuple[bool, str]:
    """Same inputs, a different global RNG state -> the same output (catches dropout & co.)."""
    import torch
    torch.manual_seed(12345)
    y2 = _forward(p.model, p.inputs)
    if not torch.allclose(p.y, y2, rtol=1e-5, atol=1e-6, equal_nan=True):
        return False, f"two runs differ (max |diff| {(p.y - y2).abs().max().item():.3g})"
    return True, ""


def filter_nondegenerate(p: Prepared) -> tuple[bool, str]:
    """Finite, not constant, not all |y| < 0.01, and different inputs give distinguishable outputs."""
    import torch
    y = p.y.float()
    if not torch.isfinite(y).all():
        return False, "non-finite output"
    if y.numel() < 2 or (y.max() - y.min()).item() <= 1e-6:
        return False, "constant output"
    if y.abs().max().item() < 0.01:
        return False, "all |y| < 0.01"
    y2 = _forward(p.model, p.inputs2).float()
    if y2.shape == y.shape and torch.allclose(y, y2, rtol=RTOL, atol=ATOL):
        return False, "outputs for different inputs are indistinguishable at atol=rtol=1e-2"
    return True, ""


def time_ms(fn, device: str, warmup: int, iters: int) -> float:
    """Median wall time of fn() in ms (CUDA: events around each call)."""
    import torch
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def filter_runtime(p: Prepared, min_ms: float, max_ms: float, warmup: int = 3, iters: int = 10) -> tuple[bool, str]:
    """Eager runtime within [min_ms, max_ms] on the target device (paper: 1-100 ms)."""
    ms = time_ms(lambda: _forward(p.model, p.inputs), p.device, warmup, iters)
    p.info["eager_ms"] = ms
    if not (min_ms <= ms <= max_ms):
        return False, f"eager {ms:.3f} ms outside [{min_ms}, {max_ms}]"
    return True, ""


def filter_runs_compile(p: Prepared, backend: str = "inductor", warmup: int = 3, iters: int = 10) -> tuple[bool, str]:
    """torch.compile(model) runs and agrees with eager at the verification tolerance."""
    import torch
    try:
        torch._dynamo.reset()
        cm = torch.compile(p.model, backend=backend)
        yc = _forward(cm, p.inputs)
    except Exception as e:   # noqa: BLE001
        return False, f"compile error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if not isinstance(yc, torch.Tensor) or yc.shape != p.y.shape or not torch.allclose(yc, p.y, rtol=RTOL, atol=ATOL):
        return False, "compiled output differs from eager"
    p.info["compile_ms"] = time_ms(lambda: _forward(cm, p.inputs), p.device, warmup, iters)
    return True, ""


MAX_CALIBRATED_NUMEL = 2 ** 29   # calibration stops growing the batch at this many input elements (2 GiB fp32)


def calibrated_code(code: str, numel: int, ms: float, min_ms: float, max_ms: float) -> tuple[str, int] | None:
    """(code with `batch_size` times 2^k, 2^k) aiming at ~2*min_ms (inside the window), or None if the task
    has no module-level batch_size or cannot grow. Runtime scales ~linearly with the batch once the GPU is
    busy; a launch-bound candidate needs more than one round (the caller allows two)."""
    m = re.search(r"^batch_size = (\d+)$", code, re.M)
    if not m or ms <= 0 or ms >= min_ms:
        return None
    target = min(2 * min_ms, math.sqrt(min_ms * max_ms))
    f = 2 ** math.ceil(math.log2(target / ms))
    while f > 1 and numel * f > MAX_CALIBRATED_NUMEL:
        f //= 2
    if f < 2:
        return None
    return code[:m.start()] + f"batch_size = {int(m.group(1)) * f}" + code[m.end():], f


def _run_filters(code: str, device: str, seed: int, min_ms: float, max_ms: float, backend: str,
                 warmup: int, iters: int) -> tuple[dict, int | None]:
    """The execution filters, in order, on one candidate: (result, its input elements; None if it never ran)."""
    r = {"ok": False, "filter": "runs_eager", "reason": "", "eager_ms": None, "compile_ms": None}
    try:
        p = prepare(code, device, seed)
        steps = [("runs_eager", lambda: filter_runs_eager(p)), ("deterministic", lambda: filter_deterministic(p)),
                 ("nondegenerate", lambda: filter_nondegenerate(p)),
                 ("runtime", lambda: filter_runtime(p, min_ms, max_ms, warmup, iters)),
                 ("runs_compile", lambda: filter_runs_compile(p, backend, warmup, iters))]
        for name, f in steps:
            r["filter"] = name
            ok, r["reason"] = f()
            if not ok:
                break
        else:
            r.update(ok=True, filter=None)
        r["eager_ms"], r["compile_ms"] = p.info.get("eager_ms"), p.info.get("compile_ms")
        return r, sum(x.numel() for x in p.inputs)
    except Exception as e:   # noqa: BLE001 - a broken task is a rejection, never a crash of the job
        r["reason"] = f"{type(e).__name__}: {str(e)[:160]}"
        return r, None


def _filter_job(codes: list[str], device: str, seed: int, min_ms: float, max_ms: float, backend: str,
                warmup: int, iters: int, calibrate: bool = False) -> list[dict]:
    """Runs in an isolated child: the execution filters on each candidate of a chunk. With `calibrate`, a
    candidate faster than min_ms is resized (calibrated_code) and filtered again, twice at most; its result
    then carries the new `code` and the total `batch_factor`."""
    import torch
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = 1   # parallelism comes from several children, not compile pools
    free = torch.cuda.empty_cache if device.startswith("cuda") else (lambda: None)
    args = (device, seed, min_ms, max_ms, backend, warmup, iters)
    out = []
    for code in codes:
        r, numel = _run_filters(code, *args)
        factor = 1
        for _ in range(2 if calibrate else 0):
            grown = calibrated_code(code, numel, r["eager_ms"], min_ms, max_ms) \
                if r["filter"] == "runtime" and numel else None
            if grown is None:
                break
            code, factor = grown[0], factor * grown[1]
            free()
            r, numel = _run_filters(code, *args)
            r.update(code=code, batch_factor=factor)
        out.append(r)
        free()
    return out


def run_isolated(fn: str, args: dict, timeout_s: float, device: str, mem_limit_mb: int = 16384,
                 workers: int = 1) -> tuple[bool, object, str]:
    """Run `module:function`(**args) in the sandbox's isolated child (candidate tasks can crash or hang).
    With `workers` children at once, each gets a share of the cores for inductor's compile threads."""
    import sandbox
    scfg = sandbox.SandboxConfig(device=device, mem_limit_mb=mem_limit_mb)
    threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    return sandbox.run_isolated(fn, args, scfg, timeout_s, device, env={"TORCHINDUCTOR_COMPILE_THREADS": str(threads)})


def run_chunk(codes: list[str], cfg: SynthConfig, window: tuple[float, float]) -> list[dict]:
    """Filter a chunk in one child; if the child crashes or times out, retry one candidate at a time."""
    args = {"device": cfg.device, "seed": cfg.seed, "min_ms": window[0], "max_ms": window[1],
            "backend": cfg.compile_backend, "warmup": cfg.warmup, "iters": cfg.iters, "calibrate": cfg.calibrate}
    ok, res, err = run_isolated("synth:_filter_job", {"codes": codes, **args}, cfg.timeout_s, cfg.device,
                                cfg.mem_limit_mb, cfg.workers)
    if ok:
        return res
    if len(codes) == 1:
        return [{"ok": False, "filter": "runs_eager", "reason": f"isolated run failed: {err[:200]}",
                 "eager_ms": None, "compile_ms": None}]
    return [r for c in codes for r in run_chunk([c], cfg, window)]


# --------------------------------------------------------------------------------------------------
# 6) demonstration solutions: a generated fused elementwise kernel for all-pointwise tasks
# --------------------------------------------------------------------------------------------------

_DEMO_PY = '''"""Generated demo (synth.emit_demo): {ops} fused into one elementwise kernel."""
import ctypes

import torch
import torch.nn as nn

from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("fused_pointwise")
lib.fused_pointwise_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.fused_pointwise_forward.restype = None


class ModelNew(nn.Module):
    def __init__(self, *init_inputs):   # same constructor as Model (pointwise tasks take no arguments)
        super().__init__()

    def forward(self, x):
        assert x.dtype == torch.float32 and x.is_contiguous(), "the kernel expects contiguous float32"
        y = torch.empty_like(x)
        lib.fused_pointwise_forward(ptr(x), ptr(y), x.numel(), stream())
        return y
'''
_DEMO_CPP = '''// Generated by synth.emit_demo: {ops}
#include <math.h>

extern "C" void fused_pointwise_forward(const float* x, float* y, long n, void* stream) {{
    (void)stream;
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < n; ++i) {{
        float v = x[i];
{body}
        y[i] = v;
    }}
}}
'''
_DEMO_CU = '''// Generated by synth.emit_demo: {ops}
#include <cuda_runtime.h>
#include <math.h>

__global__ void fused_pointwise_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {{
        float v = x[i];
{body}
        y[i] = v;
    }}
}}

extern "C" void fused_pointwise_forward(const float* x, float* y, long n, void* stream) {{
    const int threads = 256;
    long blocks = (n + threads - 1) / threads;
    if (blocks > 65535L * 16) blocks = 65535L * 16;   // grid-stride loop covers the rest
    fused_pointwise_kernel<<<(unsigned)blocks, threads, 0, (cudaStream_t)stream>>>(x, y, n);
}}
'''


def emit_demo(task: dict, backend: str = "cpu") -> dict[str, str] | None:
    """{relative path: text} of a workspace solving an all-pointwise task; None if an op has no C form."""
    spec = task.get("spec") or []
    exprs = [_c_expr({"name": s["name"], "kind": s["kind"], "args": s.get("args", []), "params": [],
                      "index0": s.get("index0")}, s.get("kwargs") or {}) for s in spec]
    if not spec or any(e is None for e in exprs):
        return None
    body = "\n".join(f"        v = {e};" for e in exprs)
    ops = " -> ".join(task["ops"])
    kern = (_DEMO_CPP if backend == "cpu" else _DEMO_CU).format(ops=ops, body=body)
    return {"model_new.py": _DEMO_PY.format(ops=ops),
            f"kernels/fused_pointwise.{'cpp' if backend == 'cpu' else 'cu'}": kern}


def write_demos(rows: list[dict], out_dir: str, backends=("cpu", "cuda")) -> list[dict]:
    """Write data/demos/<hash>/<backend>/... for each pointwise row; returns the index records."""
    index = []
    for row in rows:
        for b in backends:
            files = emit_demo(row, b)
            if files is None:
                continue
            rel = os.path.join(row["hash"], b)
            for path, text in files.items():
                full = os.path.join(out_dir, rel, path)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "w") as f:
                    f.write(text)
            index.append({"task_hash": row["hash"], "backend": b, "path": rel})
    with open(os.path.join(out_dir, "index.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in index)
    return index


# --------------------------------------------------------------------------------------------------
# 5) loading tasks: ours, CUDA-Agent-Ops-6K (local JSONL/parquet or the HF id)
# --------------------------------------------------------------------------------------------------

OPS6K_ID = "BytedTsinghua-SIA/CUDA-Agent-Ops-6K"   # columns: code, ops, data_source ("torch#k" | "transformers")


def _ops_list(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        for parse in (json.loads, ast.literal_eval):
            try:
                got = parse(v)
                return [str(o) for o in got] if isinstance(got, (list, tuple)) else [str(got)]
            except (ValueError, SyntaxError):
                continue
        return [v]
    return [str(o) for o in list(v)]


def _row(r: dict, i: int) -> dict:
    assert isinstance(r.get("code"), str) and r["code"].strip(), f"row {i} has no 'code' string"
    out = dict(r)
    out["ops"] = _ops_list(r.get("ops"))
    out["data_source"] = str(r.get("data_source") or "unknown")
    out["hash"] = r.get("hash") or source_hash(r["code"])
    return out


def load_tasks(source: str, split: str = "train", limit: int | None = None) -> list[dict]:
    """Tasks as dicts with at least {code, ops, data_source, hash}, from any supported source.

    source: our synth JSONL, a local CUDA-Agent-Ops-6K dump (.jsonl/.json or .parquet), a directory
    holding such files, or an HF dataset id (e.g. "BytedTsinghua-SIA/CUDA-Agent-Ops-6K", needs `datasets`).
    """
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith((".jsonl", ".parquet")) and ".progress" not in f)
        rows = [r for f in files for r in load_tasks(os.path.join(path, f), split)]
    elif path.endswith((".jsonl", ".json")):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    elif path.endswith(".parquet"):
        try:
            import pandas as pd
            rows = pd.read_parquet(path).to_dict("records")
        except ImportError:
            import pyarrow.parquet as pq   # optional dependency
            rows = pq.read_table(path).to_pylist()
    elif not os.path.exists(path) and re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        import datasets   # optional dependency: the HF hub dataset
        rows = list(datasets.load_dataset(source, split=split))
    else:
        raise FileNotFoundError(f"no tasks at {source!r} (want .jsonl, .parquet, a directory or an HF dataset id)")
    rows = [_row(r, i) for i, r in enumerate(rows)]
    return rows[:limit] if limit else rows


# --------------------------------------------------------------------------------------------------
# 4) the pipeline
# --------------------------------------------------------------------------------------------------


def _command(cfg: SynthConfig) -> str:
    """The CLI command that reproduces this run (non-default flags only)."""
    parts = ["python cuda_agent.py synth"]
    for f in fields(cfg):
        v, d = getattr(cfg, f.name), f.default
        if v == d:
            continue
        flag = "--" + f.name.replace("_", "-")
        parts.append(flag if v is True else f"--no-{f.name.replace('_', '-')}" if v is False else f"{flag} {v}")
    return " ".join(parts)


def _run_key(cfg: SynthConfig) -> str:
    """Hash of the settings that decide the output (resume refuses to mix runs with different ones)."""
    keep = ("seed", "device", "scale", "min_ms", "max_ms", "mix", "pointwise_frac", "composer", "model",
            "kernelbench_dir", "contamination_threshold", "use_transformers", "compile_backend", "timings", "calibrate")
    return hashlib.sha256(json.dumps({k: getattr(cfg, k) for k in keep}).encode()).hexdigest()[:16]


def _versions() -> dict:
    import platform
    import torch
    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers
        v["transformers"] = transformers.__version__
    except ImportError:
        v["transformers"] = None
    return v


def compose_all(cfg: SynthConfig, entries, preset: str) -> list[dict | None]:
    """Candidate i is composed from candidate_rng(seed, i) alone."""
    mix = parse_mix(cfg.mix)
    if cfg.composer == "llm":
        pol, out = make_policy(cfg), []
        for s in range(0, cfg.n_candidates, 32):
            out += compose_llm(pol, entries, [candidate_rng(cfg.seed, i)
                                              for i in range(s, min(s + 32, cfg.n_candidates))], mix)
        return out
    assert cfg.composer == "program", f"--composer must be program or llm, got {cfg.composer!r}"
    out = []
    for i in range(cfg.n_candidates):
        rng = candidate_rng(cfg.seed, i)
        out.append(compose_program(entries, rng, preset, mix, pointwise_only=rng.random() < cfg.pointwise_frac))
    return out


def _static_filters(cands: list, refs: list | None, threshold: float) -> list[dict | None]:
    """duplicate + contamination, in candidate order (deterministic); None = passed."""
    seen: set = set()
    verdicts = []
    for c in cands:
        if c is None:
            verdicts.append({"ok": False, "filter": "compose", "reason": "no shape-consistent chain found"})
            continue
        ok, why = filter_duplicate(c["code"], seen)
        if ok and refs:
            ok, why = filter_contamination(c["code"], refs, threshold)
            verdicts.append(None if ok else {"ok": False, "filter": "contamination", "reason": why})
        else:
            verdicts.append(None if ok else {"ok": False, "filter": "duplicate", "reason": why})
    return verdicts


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _manifest(cfg: SynthConfig, progress: list[dict], rows: list[dict], window, preset, wall_s, cat) -> dict:
    rej = {f: 0 for f in ("compose",) + FILTERS}
    entered = {f: 0 for f in FILTERS}
    for p in progress:
        stop = p["filter"]
        if stop:
            rej[stop] = rej.get(stop, 0) + 1
        for f in FILTERS:
            if stop == "compose":
                break
            entered[f] += 1
            if f == stop:
                break
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["data_source"]] = counts.get(r["data_source"], 0) + 1
    return {"command": _command(cfg), "seed": cfg.seed, "config": asdict(cfg), "versions": _versions(),
            "device": cfg.device, "scale": preset, "window_ms": list(window),
            "n_candidates": len(progress), "n_accepted": len(rows), "counts": dict(sorted(counts.items())),
            "rejections": rej, "filter_pass_rate": {f: round(1 - rej[f] / entered[f], 4) if entered[f] else None
                                                    for f in FILTERS},
            "wall_s_this_run": round(wall_s, 1),
            "catalogue": {k: v for k, v in cat.items() if k not in ("mined_names", "skipped_list")}}


def main(cfg: SynthConfig) -> int:
    t0 = time.time()
    preset = cfg.device.split(":")[0] if cfg.scale == "auto" else cfg.scale
    assert preset in PRESETS, f"--scale must be one of {sorted(PRESETS)} or auto, got {cfg.scale!r}"
    window = (cfg.min_ms if cfg.min_ms is not None else PRESETS[preset][0],
              cfg.max_ms if cfg.max_ms is not None else PRESETS[preset][1])
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    prog_path, man_path = cfg.out + ".progress.jsonl", cfg.out + ".manifest.json"
    entries, _ = mine_catalogue(cfg.use_transformers)
    cat = catalogue_report(cfg.use_transformers)
    with open(cfg.out + ".catalogue.json", "w") as f:
        json.dump(cat, f, indent=1)
    refs = load_kernelbench(os.path.expanduser(cfg.kernelbench_dir)) if cfg.kernelbench_dir else None
    cands = compose_all(cfg, entries, preset)
    static = _static_filters(cands, refs, cfg.contamination_threshold)

    key = _run_key(cfg)
    progress = _read_jsonl(prog_path) if cfg.resume else []
    if progress:
        assert progress[0].get("run_key") == key, \
            f"{prog_path} was made with other settings (seed/device/mix/...); pass --no-resume or another --out"
    progress = progress[1:]
    assert all(p["index"] == i for i, p in enumerate(progress)), f"{prog_path} is not a prefix; delete it"
    rows = _read_jsonl(cfg.out) if progress else []
    fout, fprog = open(cfg.out, "a" if progress else "w"), open(prog_path, "a" if progress else "w")
    if not progress:
        fprog.write(json.dumps({"run_key": key}) + "\n")
    print(f"[synth] {len(entries)} ops mined; {cfg.n_candidates} candidates ({len(progress)} done), "
          f"device {cfg.device}, window {window} ms, {cfg.workers} workers")

    todo = [i for i in range(len(progress), cfg.n_candidates) if static[i] is None]
    chunks = [todo[s:s + cfg.chunk] for s in range(0, len(todo), cfg.chunk)]
    results: dict[int, dict] = {}
    nxt = len(progress)

    def flush():   # write the finished prefix in candidate order (byte-identical output for a seed)
        nonlocal nxt
        while nxt < cfg.n_candidates and (static[nxt] is not None or nxt in results):
            if cfg.n_tasks is not None and len(rows) >= cfg.n_tasks:
                return
            v = static[nxt] or results.pop(nxt)
            c = cands[nxt] and {**cands[nxt], "code": v.get("code", cands[nxt]["code"])}  # calibrated size
            rec = {"index": nxt, "ok": v["ok"], "filter": v.get("filter"), "reason": v.get("reason", ""),
                   "data_source": c["data_source"] if c else None, "hash": source_hash(c["code"]) if c else None}
            if v["ok"]:
                row = {"index": nxt, "hash": rec["hash"], "data_source": c["data_source"], "ops": c["ops"],
                       "device": cfg.device, "seed": cfg.seed}
                if cfg.timings:
                    row.update(eager_ms=round(v["eager_ms"], 4), compile_ms=round(v["compile_ms"], 4))
                if v.get("batch_factor"):
                    row["batch_factor"] = v["batch_factor"]
                row.update(spec=c["spec"], code=c["code"])
                rows.append(row)
                fout.write(json.dumps(row) + "\n")
            fprog.write(json.dumps(rec) + "\n")
            progress.append(rec)
            nxt += 1
        fout.flush()
        fprog.flush()

    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.n_candidates, initial=len(progress), desc="synth", unit="cand")
    flush()
    with ThreadPoolExecutor(max(1, cfg.workers)) as ex:
        pending = {ex.submit(run_chunk, [cands[i]["code"] for i in ch], cfg, window): ch for ch in chunks}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                ch = pending.pop(fut)
                results.update(zip(ch, fut.result()))
            before = nxt
            flush()
            if bar is not None:
                bar.update(nxt - before)
                bar.set_postfix(accepted=len(rows))
            if cfg.n_tasks is not None and len(rows) >= cfg.n_tasks:
                for f in pending:
                    f.cancel()
                break
    if bar is not None:
        bar.close()
    fout.close()
    fprog.close()
    man = _manifest(cfg, progress, rows, window, preset, time.time() - t0, cat)
    if cfg.demos_dir:
        man["demos"] = len(write_demos(rows, cfg.demos_dir))
    with open(man_path, "w") as f:
        json.dump(man, f, indent=1)
    print(f"[synth] accepted {len(rows)}/{len(progress)}; rejections {man['rejections']}; "
          f"counts {man['counts']} -> {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(SynthConfig()))
