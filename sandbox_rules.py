"""The sandbox's rules, as pure functions of source text and tensors: what a candidate may write (the static
scan, layer 3 of the no-torch rule) and when its outputs count as correct (`compare` for a trial's full
outputs, `sketch_close` for a timed call's random projections), and what a check's timed calls come to
(`timing`: the candidate's statistic, the clock cross-check, the baselines it is compared with). sandbox.py
applies them; the tests call them directly. No process, file or GPU is touched here (a re-timing is the
caller's callback).

Smoke: python -m pytest tests/test_sandbox.py -q -k "scan or compare"
"""
from __future__ import annotations

import ast
import contextlib
import io
import re
import statistics
import tokenize

import sandbox_measure

# ----------------------------------------------------------------------------- static scan (layer 3)
TORCH_OK = {"empty", "empty_like", "empty_strided", "from_numpy", "is_tensor", "Size", "device", "dtype", "no_grad",
            "inference_mode", "get_default_dtype", "is_grad_enabled", "set_grad_enabled", "finfo", "iinfo"}
TORCH_OK_PREFIX = ("torch.cuda.", "torch.utils.", "torch.backends.", "torch.nn.Parameter", "torch.nn.Module",
                   "torch.ops.")
METHODS_BAD = set("""add add_ sub sub_ mul mul_ div div_ matmul mm bmm addmm baddbmm einsum sum mean max min amax
amin argmax argmin softmax log_softmax relu relu_ sigmoid tanh gelu exp log sqrt rsqrt pow abs neg clamp clamp_
clip where masked_fill masked_fill_ fill_ zero_ copy_ clone cumsum cumprod prod norm std var sort topk gather
scatter scatter_ scatter_add index_select index_add_ conv1d conv2d conv3d linear float half double bfloat16
long int bool round floor ceil sign maximum minimum lerp addcmul addcdiv tril triu diag outer dot cross
logsumexp all any nonzero masked_select repeat tile flip roll cat stack""".split())
# Ways out of torch into another array library without importing it (`x.numpy() * (x.numpy() > 0)` is a
# numpy ReLU with no import): refused unless the config allows numpy.
METHODS_ESCAPE = {"numpy", "tolist", "__dlpack__", "__array__"}
CPP_OK = {"empty", "empty_like", "empty_strided", "from_blob"}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


# Introspection of the harness: the dispatch-mode stack and key sets, the profiler, tracing hooks, frames and
# tracebacks (a traceback's tb_frame.f_back reaches the worker's locals), the garbage collector's object
# lists, raw memory through ctypes, and the worker's internals. Referring to any of them is a violation by
# itself, wherever it stands in the source (C++ strings of load_inline included, hence the ctypes prefix).
INTROSPECTION = re.compile(
    r"_python_dispatch|dispatch_stack|dispatch_mode|DispatchMode|_profiler_enabled|\bprofiler\b|"
    r"\bautograd\.profiler|kineto|setprofile|settrace|_getframe|_current_frames|\binspect\b|\bgc\.|"
    r"\btb_frame\b|\btb_next\b|\bf_back\b|\bf_locals\b|\bf_globals\b|\bf_builtins\b|\bf_code\b|\bgi_frame\b|"
    r"\bcr_frame\b|\bag_frame\b|__traceback__|\bexc_info\b|__globals__|__closure__|__code__|__builtins__|"
    r"get_referrers|get_referents|get_objects|\bpythonapi\b|\bpy_object\b|\bPyDLL\b|\bpydll\b|from_address|"
    r"ctypes\.(?:string_at|wstring_at|memmove|memset|cast|addressof)\b|"
    r"sandbox_worker\.(?!load_kernel|ptr|stream)\w+|\bsandbox_(?:measure|wire|inline)\b|\bsys\.modules|"
    r"\b__class__\.__subclasses__|"
    # the C++ guard's own names and the dispatcher's key-set controls that would step around it
    r"sandbox_guard|CUDA_AGENT_GUARD|DispatchKey|dispatch_key|_dispatch_tls|redispatch|TESTING_ONLY|"
    r"PythonDispatcher|python_dispatcher")
HARNESS_NAMES = {"load_kernel", "ptr", "stream"}  # all that `from sandbox_worker import ...` may take


# Modules a candidate may import. Kernels must be the candidate's own (compiled by the sandbox, or built
# with load_inline / a compiler it runs at import): other compute libraries (numpy, cupy, triton, numba,
# jax, scipy, ...) would be a fallback that never exercises a custom kernel. Seen: a numpy ReLU earned
# reward 3 on the cpu backend before this rule.
IMPORT_OK = {"torch", "torch.nn", "torch.nn.functional", "torch.utils.cpp_extension", "ctypes", "math", "os",
             "os.path", "shutil", "subprocess", "tempfile", "hashlib", "pathlib", "typing", "functools",
             "__future__", "dataclasses", "sandbox_worker"}
CALLS_BAD_IN_FORWARD = ("importlib.", "__import__")   # dynamic imports would dodge IMPORT_OK
# What the import and `__init__` may compute with (layers, parameters, masks): creation, init and scaling.
TORCH_INIT_OK = {"randn", "rand", "randint", "randperm", "zeros", "ones", "full", "arange", "linspace", "eye",
                 "tensor", "as_tensor", "zeros_like", "ones_like", "full_like", "randn_like", "rand_like",
                 "manual_seed", "tril", "triu", "cat", "stack"}
METHODS_INIT_OK = {"float", "half", "double", "bfloat16", "long", "int", "bool", "fill_", "zero_", "copy_", "clone",
                   "mul", "mul_", "div", "div_", "add", "add_", "sub", "sub_", "clamp", "clamp_", "tril", "triu",
                   "masked_fill", "masked_fill_", "repeat", "neg", "abs", "sqrt", "pow"}
PATCHABLE = {"torch", "F", "nn", "np", "numpy", "time", "ctypes", "sandbox_worker", "os", "sys", "threading"}


def _import_violation(tree, allow: tuple[str, ...] = ()) -> str | None:
    ok = IMPORT_OK | set(allow)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "sandbox_worker" for a in node.names):
            return f"static scan: `import sandbox_worker` (line {node.lineno}): use `from sandbox_worker import " \
                   f"load_kernel, ptr, stream`"
        if isinstance(node, ast.ImportFrom) and node.module == "sandbox_worker" and \
                any(a.name not in HARNESS_NAMES for a in node.names):
            return f"static scan: only {', '.join(sorted(HARNESS_NAMES))} may be imported from sandbox_worker " \
                   f"(line {node.lineno})"
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            if name not in ok:
                return (f"static scan: import of {name!r} (line {node.lineno}) is not allowed: compute must go "
                        f"through your own kernels; allowed imports: {', '.join(sorted(IMPORT_OK))}")
    return None


def _patch_violation(tree) -> str | None:
    """Rebinding an attribute of torch, numpy, the clock or the harness (`torch.relu = ...`, `setattr(torch,
    ...)`) changes what the harness's own code calls."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else \
            node.targets if isinstance(node, ast.Delete) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and _dotted(t).split(".")[0] in PATCHABLE:
                return f"static scan: assignment to {_dotted(t)} (line {node.lineno}) patches a library"
        if isinstance(node, ast.Call) and _dotted(node.func) in ("setattr", "delattr") and node.args and \
                _dotted(node.args[0]).split(".")[0] in PATCHABLE:
            return f"static scan: {_dotted(node.func)}({_dotted(node.args[0])}, ...) (line {node.lineno}) patches a library"
    return None


def _strip_comments(source: str) -> str:
    """Source with # comments blanked (line numbers kept), so prose in comments cannot trip the scan."""
    lines = source.splitlines(keepends=True)
    with contextlib.suppress(tokenize.TokenError, IndentationError, SyntaxError):
        for tok in reversed(list(tokenize.generate_tokens(io.StringIO(source).readline))):
            if tok.type == tokenize.COMMENT:
                (r, c0), (_, c1) = tok.start, tok.end
                lines[r - 1] = lines[r - 1][:c0] + lines[r - 1][c1:]
    return "".join(lines)


def _bad_call(node: ast.Call, alias: dict, libs: set, allow: tuple, init: bool) -> str | None:
    """Why this call is torch compute (or a way around the rules), under forward's rules or, with `init`, the
    looser rules of module import and `__init__` (creation, init and scaling allowed)."""
    name = _dotted(node.func)
    head, _, rest = name.partition(".")
    name = f"{alias[head]}.{rest}".rstrip(".") if head in alias else name
    method = node.func.attr if isinstance(node.func, ast.Attribute) else None
    if name.startswith(("torch.nn.functional.", "torch.ops.aten.")) or name.startswith(CALLS_BAD_IN_FORWARD) \
            or name == "__import__":
        return name
    if name.startswith("torch.") and name.count(".") == 1:
        return None if name[6:] in TORCH_OK or (init and name[6:] in TORCH_INIT_OK) else name
    if name.startswith("torch.") and not name.startswith(TORCH_OK_PREFIX):
        return name if not name.startswith("torch.nn.") else None
    if method in METHODS_ESCAPE and "numpy" not in allow:
        return f".{method}()"
    if method in METHODS_BAD and head not in libs and not (init and method in METHODS_INIT_OK) and \
            not name.startswith(("math.", "np.", "numpy.", "os.", "ctypes.")):
        return f".{method}()"
    if name in ("eval", "exec", "compile", "__import__", "globals", "locals", "vars", "breakpoint"):
        return f"{name}(...)"
    if name in ("getattr", "setattr", "delattr") and len(node.args) >= 2 and (
            _dotted(node.args[0]) in ("torch", "F", "nn", "torch.nn.functional") or
            not (isinstance(node.args[1], ast.Constant) or _dotted(node.args[0]) == "self")):
        return f"{name}(...)"  # a computed attribute name could spell anything the scan refuses
    return None


def static_scan(source: str, allow_imports: tuple[str, ...] = ()) -> str | None:
    """Conservative scan of candidate Python (+ C++ strings): harness introspection, library patches,
    imports, and torch compute (forward's rules in functions, init rules at import and in `__init__`)."""
    code = _strip_comments(source)
    m = INTROSPECTION.search(code)
    if m:
        line = code.count("\n", 0, m.start()) + 1
        return f"static scan: harness introspection {m.group(0)!r} (line {line}) is not allowed"
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # the child reports the syntax error as a load error
    bad = _import_violation(tree, allow_imports) or _patch_violation(tree)
    if bad:
        return bad
    alias = {"F": "torch.nn.functional", "nn": "torch.nn"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith("torch"):
                    alias[a.asname] = a.name
    # Names bound to a compiled library (`lib = load_kernel("k")`, `ctypes.CDLL(...)`): `lib.mm(...)` is the
    # candidate's own launcher, not a tensor method, and must not trip the METHODS_BAD rule below.
    libs = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
            and _dotted(n.value.func).rsplit(".", 1)[-1] in ("load_kernel", "CDLL", "LoadLibrary")
            for t in n.targets if isinstance(t, ast.Name)}
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    regions = [(fn, getattr(fn, "name", "lambda"), getattr(fn, "name", "") == "__init__")
               for fn in ast.walk(tree) if isinstance(fn, funcs)]
    regions.append((tree, "module import", True))  # module and class bodies, outside any function
    for region, where, init in regions:
        todo = list(ast.iter_child_nodes(region))
        while todo:
            node = todo.pop()
            if isinstance(node, funcs):
                continue  # a nested function is its own region
            todo += ast.iter_child_nodes(node)
            bad = _bad_call(node, alias, libs, allow_imports, init) if isinstance(node, ast.Call) else None
            if bad:
                return f"static scan: torch compute {bad} in {where} (line {node.lineno})"
    for node in ast.walk(tree):  # C++ sources of load_inline (form a)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "#include" in node.value:
            for m in re.finditer(r"\b(?:at|torch)::([a-z_]\w*)\s*\(", node.value):
                if m.group(1) not in CPP_OK:
                    return f"static scan: C++ calls {m.group(0).rstrip('(').strip()} (torch compute)"
            for m in re.finditer(r"\.\s*([a-z_]\w*)\s*\(", node.value):
                if m.group(1) in METHODS_BAD:
                    return f"static scan: C++ calls tensor method .{m.group(1)}() (torch compute)"
    return None


# ----------------------------------------------------------------------------- comparison (host side)
def compare(ref: list, cand: list, devices: list | None, device: str, atol: float, rtol: float,
            work_device: str = "cpu") -> dict:
    """One trial: {"ok", "max_abs_err", "max_rel_err", "rel_l2", "first_bad_index", "reason"}; the
    elementwise work runs on `work_device` (host tensors are copied there a chunk at a time)."""
    import torch
    res = {"ok": False, "max_abs_err": None, "max_rel_err": None, "rel_l2": None, "first_bad_index": None,
           "reason": None}
    if len(ref) != len(cand):
        return {**res, "reason": f"returned {len(cand)} tensors, expected {len(ref)}"}
    for i, (r, c) in enumerate(zip(ref, cand)):
        where = f"output {i}: " if len(ref) > 1 else ""
        if type(c) is not torch.Tensor:
            return {**res, "reason": f"{where}not a torch.Tensor ({type(c).__name__})"}
        if devices and devices[i] != device:
            return {**res, "reason": f"{where}on {devices[i]}, expected {device}"}
        if c.shape != r.shape:
            return {**res, "reason": f"{where}shape {tuple(c.shape)}, expected {tuple(r.shape)}"}
        if c.dtype != r.dtype:
            return {**res, "reason": f"{where}dtype {c.dtype}, expected {r.dtype}"}
        st = _compare_chunks(r.reshape(-1), c.reshape(-1), atol, rtol, work_device)
        rel_l2 = st["sq_diff"] ** 0.5 / st["sq_ref"] ** 0.5 if st["sq_ref"] > 1e-24 else 0.0
        mae = st["max_abs"]
        res = {**res, "max_abs_err": max(mae, res["max_abs_err"] or 0.0),
               "max_rel_err": max(st["max_rel"], res["max_rel_err"] or 0.0),
               "rel_l2": max(rel_l2, res["rel_l2"] or 0.0)}
        if st["nonfinite_at"] is not None:
            return {**res, "reason": f"{where}non-finite value where the reference is finite",
                    "first_bad_index": list(_unravel(st["nonfinite_at"], r.shape))}
        if st["far_at"] is not None:
            return {**res, "first_bad_index": list(_unravel(st["far_at"], r.shape)),
                    "reason": f"{where}not allclose(atol={atol}, rtol={rtol}): max abs err {mae:.3g}"}
        if rel_l2 > rtol:
            return {**res, "reason": f"{where}relative L2 error {rel_l2:.3g} > rtol {rtol}"}
    return {**res, "ok": True}


COMPARE_CHUNK = 1 << 22  # elements per step: host memory stays ~100 MB above the two outputs, whatever their size


def _compare_chunks(r, c, atol: float, rtol: float, dev: str = "cpu") -> dict:
    """Statistics of flat `c` against flat `r`, a chunk at a time: the first index where the reference is
    finite and `c` is not, the first index that is not isclose(equal_nan), max abs and relative error, and
    sums of squares of the error and of the reference (finite reference positions only). Elementwise work is
    in float32 (float64 for float64 outputs): far below the tolerances; each chunk's sums are added in
    Python floats (float64), so their rounding is relative ~1e-4 at worst."""
    import torch
    st = {"nonfinite_at": None, "far_at": None, "max_abs": 0.0, "max_rel": 0.0, "sq_diff": 0.0, "sq_ref": 0.0}
    work = torch.float64 if r.dtype == torch.float64 else torch.float32
    for i in range(0, r.numel(), COMPARE_CHUNK):
        rc, cc = r[i:i + COMPARE_CHUNK].to(dev, work), c[i:i + COMPARE_CHUNK].to(dev, work)
        fin_r = torch.isfinite(rc)
        all_fin = bool(fin_r.all())
        if all_fin:  # the usual case: four passes
            d = cc.sub(rc).abs_()
            ra = rc.abs()
            bad = ~(d <= ra.mul(rtol).add_(atol))  # NaN or inf in c -> not <= -> bad
        else:
            d = torch.where(fin_r, cc - rc, torch.zeros_like(rc)).abs_()
            ra = torch.where(fin_r, rc.abs(), torch.zeros_like(rc))
            bad = ~torch.isclose(cc, rc, atol=atol, rtol=rtol, equal_nan=True)
        if st["nonfinite_at"] is None and bool(bad.any()):
            lost = fin_r & ~torch.isfinite(cc)
            if bool(lost.any()):
                st["nonfinite_at"] = i + int(lost.nonzero()[0])
                d = torch.where(lost, torch.zeros_like(d), d)
        if st["far_at"] is None and bool(bad.any()):
            st["far_at"] = i + int(bad.nonzero()[0])
        d = torch.nan_to_num(d, nan=0.0, posinf=0.0) if not all_fin or st["nonfinite_at"] is not None else d
        if d.numel():
            st["max_abs"] = max(st["max_abs"], float(d.max()))
            st["max_rel"] = max(st["max_rel"], float((d / ra.clamp_min(1e-6)).max()))
        st["sq_diff"] += float(torch.dot(d, d))
        rf = rc if all_fin else torch.where(fin_r, rc, torch.zeros_like(rc))
        st["sq_ref"] += float(torch.dot(rf, rf))
    return st


def _unravel(idx: int, shape) -> tuple:
    out = []
    for s in reversed(tuple(shape)):
        out.append(idx % s)
        idx //= s
    return tuple(reversed(out))


def sketch_close(cand: list, ref: list, cfg) -> tuple[bool, str | None]:
    """Does a timed call's sketch match the reference's? (ok, reason).

    An output that passes `compare` has an error e with ||e|| <= rtol * ||y|| (the relative L2 rule; when
    ||y|| ~ 0, allclose bounds it by atol * sqrt(n)). A projection <e, r> on r ~ N(0, I) drawn after the call
    is then N(0, ||e||^2): 8 standard deviations of that bound never fail an honest output, while an output
    wrong by about its own norm (stale, from other inputs, zeros) passes one projection with probability
    ~16 * rtol * 0.4 ~ 0.06 and all SKETCH_KEYS with ~2e-4. The norms must also agree to the same bound."""
    if not isinstance(cand, list) or len(cand) != len(ref):
        return False, f"returned {len(cand) if isinstance(cand, list) else '?'} tensors, expected {len(ref)}"
    for j, (c, r) in enumerate(zip(cand, ref)):
        where = f"output {j}: " if len(ref) > 1 else ""
        for k in ("shape", "dtype"):
            if c.get(k) != r[k]:
                return False, f"{where}{k} {c.get(k)}, expected {r[k]}"
        if c.get("device") != cfg.device:
            return False, f"{where}on {c.get('device')}, expected {cfg.device}"
        if c.get("nonfinite") != r["nonfinite"]:
            return False, f"{where}{c.get('nonfinite')} non-finite values, expected {r['nonfinite']}"
        bound = cfg.rtol * r["norm"] if r["norm"] > 1e-12 else cfg.atol * max(r["numel"], 1) ** 0.5
        bound += 1e-9 * (r["norm"] + 1.0)  # float64 rounding of the projections
        if abs(float(c["norm"]) - r["norm"]) > 2 * bound:
            return False, f"{where}output norm {float(c['norm']):.6g}, expected {r['norm']:.6g}"
        for pc, pr in zip(c["proj"], r["proj"]):
            if not abs(float(pc) - pr) <= 8 * bound:
                return False, f"{where}random projection {float(pc):.6g}, expected {pr:.6g} (bound {8 * bound:.3g})"
    return True, None


# ----------------------------------------------------------------------------- timing (host side)
def timing(seen: dict, base: dict, v, cfg, retime):
    """Fill the verdict `v` from a check's timed calls (`seen`): the candidate's time, the timer cross-check, and
    the baselines it is compared with: eager's rounds from the candidate's own child when they came
    (`seen["eager"]`), else the cached `base`; a cached baseline that a speedup tier would rest on is re-timed
    once (`retime()`) when it was measured in a single run. The candidate's time is the baselines' statistic:
    its timed calls after warm-up in BASELINE_ROUNDS consecutive rounds, the minimum round median kept (a
    median over all calls against a minimum over the baseline's rounds would favour the baseline by the
    spread between rounds; every call of every round is checked, so a fast round is a correct one)."""
    calls = seen["calls"][cfg.warmup:]
    ms = [c["ms"] for c in calls]
    child_span, host_span = sum(c["span_ms"] for c in calls), sum(c["host_ms"] for c in calls)
    rounds, mean = sandbox_measure.round_medians(ms), statistics.fmean(ms)
    cand_ms = min(rounds)
    v.timings.update({"cand_cv": statistics.pstdev(ms) / mean if mean > 0 else 0.0, "n_iters": len(ms),
                      "cand_rounds": [round(r, 5) for r in rounds], "cand_median_all": statistics.median(ms),
                      # the host's part of a call (until forward returned); the rest is the wait for the device
                      "cand_launch_ms": statistics.median(c.get("launch_ms", 0.0) for c in calls),
                      "cand_cpus": sorted({c.get("cpu", -1) for c in calls}),  # the cores its calls ran on
                      "host_span_ms": round(host_span, 3), "child_span_ms": round(child_span, 3)})
    # The child's clock must agree with the host's over the same spans (patched or overwritten timers), and the
    # timed calls must fit in those spans. The host's span of a call also holds two pipe hops and its reader
    # thread's wake-up, a few ms on a loaded machine: hence the slack per call.
    slack = max(0.75 * host_span, 5.0 * len(calls) + 50.0)  # a stopped or swapped clock still fails
    if child_span < host_span - slack or sum(ms) > child_span * 1.01 + 1.0:
        v.correct, v.violation = False, (f"timer mismatch: host saw {host_span:.1f} ms, child reported "
                                         f"{child_span:.1f} ms (sum of timed calls {sum(ms):.1f} ms)")
        return
    eager_msg = seen.get("eager") or {}  # eager timed in the candidate's child, when it came
    beside = eager_msg if eager_msg.get("eager") else None
    cached = base["compile_ms"] if beside else base["eager_ms"]  # the baseline a tier would rest on
    if cached and cand_ms < 0.95 * cached and base.get("runs", 1) < 2:  # ... measured in a single run
        base = retime()
        v.timings["baseline_retimed"] = True
    v.timings.update({"baseline": f"min of {len(base['eager_rounds'])} round medians over {base['runs']} run(s)",
                      "eager_spread": round(base.get("spread", 0.0), 4), "eager_cv": base.get("eager_cv"),
                      "eager_launch_ms": base.get("eager_launch_ms"), "eager_cached_ms": base["eager_ms"],
                      "compile_error": base.get("compile_error")})
    eager_ms = base["eager_ms"]
    if beside:  # the same statistic over eager's rounds in the candidate's child, just before its import
        eager_ms = min(beside["eager"])
        v.timings.update({"baseline": f"eager: min of {len(beside['eager'])} round medians in the candidate's "
                                      f"child; compile: " + v.timings["baseline"],
                          "eager_rounds": [round(r, 5) for r in beside["eager"]], "eager_cv": beside["eager_cv"],
                          "eager_launch_ms": min(beside["eager_launch"] or [0.0])})
    elif eager_msg:  # it failed there: the cached baseline, and why
        v.timings["eager_beside_error"] = eager_msg.get("error")
    v.candidate_ms, v.eager_ms, v.compile_ms = cand_ms, eager_ms, base["compile_ms"]
    if v.candidate_ms > 0:
        v.speedup_eager = v.eager_ms / v.candidate_ms
        v.speedup_compile = v.compile_ms / v.candidate_ms if v.compile_ms else None
    v.stage = "done"
