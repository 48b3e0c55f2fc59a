"""The operator catalogue of task synthesis (paper §3.1): the torch and transformers operators that
`synth.py` composes into tasks, mined by introspection and probed by running them.

Sources: every `torch.nn` Module class, every public `torch.nn.functional` callable, every `torch.*` function
that is also a Tensor method, and, when transformers is importable, its activation classes and the
RMSNorm/LayerNorm/MLP layers of a few model families. Required constructor/call arguments are filled by name
rules (`_arg_value`: `in_channels` = the input's channel dim, `kernel_size` = 3 or 5, ...). Each candidate
is probed (`_probe`) on small random inputs of rank 2-5: twice, to catch stochastic ops, and on the meta
device, for the shape inference the composer relies on. Everything not mined gets a one-line reason
(stochastic, loss needs targets, needs integer inputs, no rule for a required argument, probe error, ...);
`catalogue_report()` counts them. An entry is `pointwise` when `c_expr` knows an exact C expression for it
(torch's default arguments, erf GELU, threshold-20 softplus, ...).

Demonstration solutions for the tiny preset's warm-up (data/demos/) come from those expressions: for a task
made only of pointwise ops, `emit_demo` writes a sandbox workspace that fuses the whole chain into one
elementwise kernel (C++/OpenMP for cpu, CUDA for cuda); nothing is hand-written. `write_demos` lays the
workspaces out for many tasks, as the trainer's `load_demos` reads them:
    <out>/<task hash>/<backend>/model_new.py, <out>/<task hash>/<backend>/kernels/fused_pointwise.{cpp,cu}
    <out>/index.jsonl: one {"task_hash", "backend", "path"} per workspace

Departures from the paper
  1. Op arguments come from name rules, not an LLM, so some ops (e.g. Bilinear, Fold) are skipped and
     listed with their reason instead.
  2. The paper warms the policy up on its own agent trajectories; the tiny preset, which has no strong
     model to sample from, warms up on the generated demos instead.

Smoke: python -c "import synth_ops; print(synth_ops.catalogue_report()['mined_by_kind'])"
       python synth_ops.py data/tasks_tiny.jsonl /tmp/demos && diff -r /tmp/demos data/demos   (no output)
Full:  the catalogue is mined once per `python cuda_agent.py synth` run and written to <out>.catalogue.json;
       python cuda_agent.py synth --pointwise-frac 0.5 --demos-dir data/demos ...   (data/README.md)
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import random
import re
import sys
import warnings

import torch

# --------------------------------------------------------------------------------------------------
# 1) rules: what is skipped by name before probing, and a value for each required argument
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


# --------------------------------------------------------------------------------------------------
# 2) calling and probing an entry
# --------------------------------------------------------------------------------------------------


def _resolve(name: str):
    """'nn.Conv2d' | 'F.gelu' | 'torch.tanh' | 'transformers.models.x.modeling_x:Cls' -> the callable."""
    if ":" in name:
        mod, attr = name.split(":")
        return getattr(importlib.import_module(mod), attr)
    head, attr = name.split(".", 1)
    return getattr({"nn": torch.nn, "F": torch.nn.functional, "torch": torch}[head], attr)


def call_op(entry: dict, kwargs: dict, device=None):
    """A callable x -> y for a catalogue entry with instantiated args (module built on `device`)."""
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
    shape = PROBE_SHAPES[rank]
    kw = instantiate(entry, shape, random.Random(0))
    if kw is None:
        return "no rule value for an argument at this rank"
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=g)
        fn = call_op(entry, kw)
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
            ym = call_op(entry, kw, device="meta")(torch.empty(shape, device="meta"))
        assert tuple(ym.shape) == tuple(y1.shape), "meta shape differs"
    except Exception as e:   # noqa: BLE001
        return f"no meta shape inference ({type(e).__name__})"
    return None


# --------------------------------------------------------------------------------------------------
# 3) mining: introspect, pre-skip by name, probe what is left
# --------------------------------------------------------------------------------------------------


def _candidates(use_transformers: bool) -> tuple[list[dict], dict[str, str]]:
    """Introspect torch (and transformers) for operator candidates; pre-skip the obvious ones."""
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
        import transformers.activations as A   # optional: only with use_transformers
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
            ev["pointwise"] = c_expr(ev, {}) is not None
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
# 4) pointwise ops with exact C equivalents (torch's default arguments): the `pointwise` flag, and the demos (5)
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


def c_expr(entry: dict, kwargs: dict) -> str | None:
    """C expression in `v` computing this op exactly as torch does, or None (not a supported pointwise op)."""
    if entry["kind"] == "transformers" or entry.get("params") or kwargs or entry.get("index0"):
        return None
    base = entry["name"].split(".")[-1].lower()
    args = list(entry.get("args", []))
    if entry["kind"] == "tensor" and args == [2.0]:
        return _C_SCALAR.get(base)
    return _C_UNARY.get(base) if not args else None


# --------------------------------------------------------------------------------------------------
# 5) demos: a workspace fusing an all-pointwise task into one kernel
# --------------------------------------------------------------------------------------------------
# The header lines name `synth.emit_demo`, the command that writes demos (`synth --demos-dir`); they are
# part of the shipped data/demos/, which this module regenerates byte for byte.
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
    exprs = [c_expr({"name": s["name"], "kind": s["kind"], "args": s.get("args", []), "params": [],
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
    os.makedirs(out_dir, exist_ok=True)
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


if __name__ == "__main__":   # python synth_ops.py TASKS.jsonl OUT_DIR: the demos of an existing task file
    assert len(sys.argv) == 3, "usage: python synth_ops.py TASKS.jsonl OUT_DIR"
    with open(sys.argv[1]) as f:
        n = len(write_demos([json.loads(line) for line in f if line.strip()], sys.argv[2]))
    print(f"[demos] {n} workspaces -> {sys.argv[2]}")
