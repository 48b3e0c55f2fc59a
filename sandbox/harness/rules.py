"""The sandbox's rules, as pure functions of source text and tensors: what a candidate may write (the static
scan, layer 3 of the no-torch rule), when an output counts as correct (`compare`, which the driver applies to
every call, timed ones included), and what a check's timed calls come to (`timing`: the candidate's
statistic and the baselines it is compared with). The host and the driver (in its child: this file is bound
beside the worker) apply them; the tests call them directly. No process or file is touched here (a
re-timing is the caller's callback).

Rule profiles of the static scan (`SandboxConfig.rules`, --sandbox.rules; a verdict names its profile in
`timings["rules"]`). Both refuse torch compute in functions and allow allocation; they differ in how they read
a torch name that is on neither of their lists:
  * "cuda-agent" (the default; the paper's §3.2 rule as the agent's prompt states it: in forward, torch may
    only allocate tensors and make views) is an allow-list. In a function, a call into the torch namespace
    is refused unless it is allocation, a view or metadata: `torch.X` for X in TORCH_OK, `torch.nn` layers and
    containers, `torch.cuda` / `torch.utils` / `torch.backends` / `torch.ops`; C++ `at::X` / `torch::X` for X
    in CPP_OK. A tensor method in METHODS_BAD (dtype casts included) is refused.
  * "kernelbench" (KernelBench's own rule, the one its published samples follow: outputs may be allocated with
    torch, `torch::zeros_like` included, nothing may be computed with it) is a deny-list. A call is refused if
    it names torch compute: X in TORCH_COMPUTE for `torch.X`, `torch.Y.X`, `at::X`, `torch::X`; anything in
    `torch.nn.functional`, `torch.linalg`, `torch.fft`, `torch.special`, `torch.ops.aten` or torch's private
    `torch._*`. A tensor method in METHODS_BAD is refused, except the dtype casts: a cast to the dtype a
    tensor already has computes nothing and is common in samples, and the dispatch guard refuses a real one
    (`_to_copy`). A torch name on neither list passes the scan and is judged by the dynamic layers when it runs.
In both profiles:
  * Allocation and fills are allocation. The paper forbids torch compute and allows memory allocation; it draws
    no line between an uninitialised and a constant-filled buffer, so `empty`, `zeros`, `ones`, `full`, their
    `_like` and `new_` forms, `zero_` and `fill_` are allowed here and in the dynamic layers' allow-list
    (sandbox_worker.ALLOWED_OPS), and so is the legacy constructor `torch.Tensor(...)` (by sizes, from a list,
    or an alias: the dispatch guard sees no compute in any of them). A KernelBench Conv2D sample's
    `nn.Parameter(torch.Tensor(n))` under an `if bias:` passes for that reason: the branch is still read (the
    scan reads code, not traces), and `torch.Tensor` as a type (an annotation, isinstance) never was a call.
  * The torch-compute rules read only what can run (`live_regions`): class ModelNew with all its methods,
    everything that runs at import (module and class bodies, decorators, default values, annotations; not the
    body of `if __name__ == "__main__":`, which an imported module never runs), every decorated function,
    and, transitively, every module-level function or class that live code names. A helper nothing live
    names (a sample's own `get_inputs` with `torch.randn`) is not read; a file with no class ModelNew is read
    whole. Import and every `__init__` are read with the init rules (creation, init and scaling:
    TORCH_INIT_OK, METHODS_INIT_OK), every other function with forward's.
  * Harness introspection, library patches, imports, dynamic imports, eval/exec, computed getattr and the ways
    out of torch into numpy are refused wherever they stand in a file: the dynamic layers cannot back those
    rules up, while the torch-compute rules have the dispatch guard and the profiler behind them. So do C++
    calls that reach a kernel around the dispatcher (`at::native::`, `at::cpu::relu`, `at::_ops::`), which
    neither dynamic layer would see.
  * Not covered: arithmetic operators on tensors (`x * 2`, left to the dynamic layers); values a forward
    computes in Python from `.item()` reads and writes into an output with a fill, one launch per element.

Smoke: python -m pytest tests/test_sandbox.py tests/test_sandbox_rules.py -q -k "scan or compare or rules"
"""
from __future__ import annotations

import ast
import contextlib
import io
import re
import statistics
import tokenize

if __package__:  # on the host: a module of the package sandbox.harness
    from . import measure
else:  # in a child: beside the other harness files (sandbox.child.HARNESS_FILES), imported by flat name
    import measure

# ----------------------------------------------------------------------------- static scan (layer 3)
RULES = ("cuda-agent", "kernelbench")  # the profiles (module docstring)
# Allocation and fills, allowed in forward by both profiles (and by sandbox_worker.ALLOWED_OPS).
ALLOC = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
         "Tensor"}
TORCH_OK = ALLOC | {"from_numpy", "is_tensor", "Size", "device", "dtype", "no_grad", "inference_mode",
                    "get_default_dtype", "is_grad_enabled", "set_grad_enabled", "finfo", "iinfo"}
TORCH_OK_PREFIX = ("torch.cuda.", "torch.utils.", "torch.backends.", "torch.nn.Parameter", "torch.nn.Module",
                   "torch.ops.")
METHODS_BAD = set("""add add_ sub sub_ mul mul_ div div_ matmul mm bmm addmm baddbmm einsum sum mean max min amax
amin argmax argmin softmax log_softmax relu relu_ sigmoid tanh gelu exp log sqrt rsqrt pow abs neg clamp clamp_
clip where masked_fill masked_fill_ copy_ clone cumsum cumprod prod norm std var sort topk gather
scatter scatter_ scatter_add index_select index_add_ conv1d conv2d conv3d linear float half double bfloat16
long int bool round floor ceil sign maximum minimum lerp addcmul addcdiv tril triu diag outer dot cross
logsumexp all any nonzero masked_select repeat tile flip roll cat stack""".split())
CASTS = {"float", "half", "double", "bfloat16", "long", "int", "bool"}
# Torch compute by name, for the kernelbench profile's deny-list: the tensor methods above (casts aside), the
# operators KernelBench's own checker names, and their relatives.
TORCH_COMPUTE = METHODS_BAD - CASTS | set("""mv addmv addr addbmm chain_matmul tensordot kron matrix_power cdist
pdist conv_transpose1d conv_transpose2d conv_transpose3d convolution conv_tbc avg_pool1d avg_pool2d avg_pool3d
max_pool1d max_pool2d max_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d
adaptive_max_pool2d adaptive_max_pool3d hardtanh elu selu celu leaky_relu rrelu prelu relu6 hardswish hardsigmoid
silu mish softplus softsign softmin threshold glu logsigmoid hardshrink softshrink tanhshrink batch_norm
group_norm layer_norm instance_norm rms_norm local_response_norm normalize cross_entropy nll_loss kl_div mse_loss
l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits triplet_margin_loss
margin_ranking_loss hinge_embedding_loss cosine_embedding_loss cosine_similarity pairwise_distance dropout
alpha_dropout feature_dropout embedding embedding_bag bilinear pixel_shuffle pixel_unshuffle interpolate
grid_sampler affine_grid constant_pad_nd sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh erf erfc
erfinv expm1 exp2 log1p log2 log10 reciprocal square logit lgamma digamma polygamma fmod remainder true_divide
floor_divide multiply divide subtract rsub negative hypot logaddexp logaddexp2 heaviside trunc frac cummax cummin
logcumsumexp median nanmedian mode quantile nanquantile kthvalue argsort msort histc bincount unique
unique_consecutive count_nonzero nansum nanmean var_mean std_mean aminmax eq ne lt le gt ge isclose allclose
equal isnan isinf isfinite logical_and logical_or logical_xor logical_not bitwise_and bitwise_or bitwise_xor
bitwise_not fmax fmin trace diff trapz trapezoid renorm dist index_put index_put_ put_ take take_along_dim
masked_scatter index_copy index_fill scatter_reduce searchsorted bucketize""".split())
COMPUTE_NAMESPACES = ("torch.nn.functional.", "torch.ops.aten.", "torch.ops.prims.", "torch.linalg.", "torch.fft.",
                      "torch.special.", "torch._")
# Ways out of torch into another array library without importing it (`x.numpy() * (x.numpy() > 0)` is a
# numpy ReLU with no import): refused unless the config allows numpy.
METHODS_ESCAPE = {"numpy", "tolist", "__dlpack__", "__array__"}
CPP_OK = {"empty", "empty_like", "empty_strided", "from_blob", "zeros", "zeros_like", "ones", "ones_like", "full",
          "full_like"}
CPP_CALL = re.compile(r"\b(?:at|torch)::((?:nn::functional|linalg|fft|special)::)?([a-z_]\w*)\s*\(")
# Kernels called around the dispatcher (structured kernels, the native implementations, composite bodies):
# neither the dispatch guard nor the profiler sees them, so only this scan can refuse them. Lower-case names
# there are ops; the camel-case ones (`at::cuda::getCurrentCUDAStream`) are runtime helpers.
CPP_AROUND = re.compile(r"\bat::(native|_ops|cpu|cuda|meta|mps|composite\w*)::((?:\w+::)*)([a-z_]\w*)\s*\(")
CPP_RUNTIME = {"current_device", "device_count", "set_device", "warp_size", "device_synchronize",
               "stream_synchronize"}


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
    r"sandbox_worker\.(?!load_kernel|ptr|stream)\w+|\b(?:measure|wire|inline)\.\w|[\"'](?:measure|wire|inline)[\"']|"
    r"\bsys\.modules|"
    r"\b__class__\.__subclasses__|"
    # the C++ guard's own names and the dispatcher's key-set controls that would step around it
    r"sandbox_guard|CUDA_AGENT_GUARD|DispatchKey|dispatch_key|_dispatch_tls|redispatch|TESTING_ONLY|"
    r"PythonDispatcher|python_dispatcher")
HARNESS_NAMES = {"load_kernel", "ptr", "stream"}  # all that `from sandbox_worker import ...` may take
EXTENSION_MODULE = "cuda_extension"  # form (c)'s one module, built from the workspace's C++ (sandbox/extension.py)


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


def _resolve(node: ast.Call, alias: dict) -> str:
    """The called name with import aliases undone: `F.relu` -> `torch.nn.functional.relu`."""
    name = _dotted(node.func)
    head, _, rest = name.partition(".")
    return f"{alias[head]}.{rest}".rstrip(".") if head in alias else name


def _escape_call(node: ast.Call, alias: dict, allow: tuple) -> str | None:
    """Why this call steps around the rules (a dynamic import, eval, a computed attribute, a way out to numpy),
    in whatever code it stands: no dynamic layer backs these up."""
    name = _resolve(node, alias)
    method = node.func.attr if isinstance(node.func, ast.Attribute) else None
    if name.startswith(CALLS_BAD_IN_FORWARD) or name == "__import__":
        return name
    if method in METHODS_ESCAPE and "numpy" not in allow:
        return f".{method}()"
    if name in ("eval", "exec", "compile", "globals", "locals", "vars", "breakpoint"):
        return f"{name}(...)"
    if name in ("getattr", "setattr", "delattr") and len(node.args) >= 2 and (
            _dotted(node.args[0]) in ("torch", "F", "nn", "torch.nn.functional") or
            not (isinstance(node.args[1], ast.Constant) or _dotted(node.args[0]) == "self")):
        return f"{name}(...)"  # a computed attribute name could spell anything the scan refuses
    return None


def _compute_call(node: ast.Call, alias: dict, libs: set, init: bool, rules: str) -> str | None:
    """Why this call is torch compute under `rules`, by forward's rules or, with `init`, the looser rules of
    module import and `__init__` (creation, init and scaling allowed)."""
    name = _resolve(node, alias)
    head = _dotted(node.func).partition(".")[0]
    method = node.func.attr if isinstance(node.func, ast.Attribute) else None
    last = name.rsplit(".", 1)[-1]
    if name.startswith(COMPUTE_NAMESPACES):
        return name
    if name.startswith("torch.") and init and name.count(".") == 1 and last in TORCH_INIT_OK:
        return None
    if name.startswith("torch.") and rules == "kernelbench":
        return name if last in TORCH_COMPUTE else None
    if name.startswith("torch.") and name.count(".") == 1:   # cuda-agent: allocation, views, metadata only
        return None if last in TORCH_OK else name
    if name.startswith("torch.") and not name.startswith(TORCH_OK_PREFIX):
        return name if not name.startswith("torch.nn.") else None
    bad = METHODS_BAD if rules == "cuda-agent" else METHODS_BAD - CASTS
    if method in bad and head not in libs and not (init and method in METHODS_INIT_OK) and \
            not name.startswith(("math.", "np.", "numpy.", "os.", "ctypes.")):
        return f".{method}()"
    return None


def cpp_scan(text: str, name: str, rules: str = "cuda-agent") -> str | None:
    """The static scan of a C++ / CUDA source file of form (c) (a kernel, a binding, a header: they include
    torch's headers), as load_inline strings are scanned in form (a): harness introspection, torch compute, kernels
    called around the dispatcher. Comments are left out."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    m = INTROSPECTION.search(code)
    if m:
        line = code.count("\n", 0, m.start()) + 1
        return f"static scan: harness introspection {m.group(0)!r} ({name}, line {line}) is not allowed"
    bad = _cpp_violation(code, rules)
    return bad and bad.replace("static scan: C++", f"static scan: {name}", 1)


def _cpp_violation(text: str, rules: str) -> str | None:
    """Torch compute called from a C++ source (a load_inline string) under `rules`."""
    for m in CPP_CALL.finditer(text):
        sub, name = m.group(1), m.group(2)
        bad = name not in CPP_OK if rules == "cuda-agent" else bool(sub) or name in TORCH_COMPUTE
        if bad:
            return f"static scan: C++ calls {m.group(0).rstrip('(').strip()} (torch compute)"
    for m in CPP_AROUND.finditer(text):
        ns, name = m.group(1), m.group(3)
        if ns not in ("cpu", "cuda") or (name.islower() and name not in CPP_OK | CPP_RUNTIME):
            return f"static scan: C++ calls {m.group(0).rstrip('(').strip()} (a kernel called around the " \
                   f"dispatcher)"
    bad = METHODS_BAD if rules == "cuda-agent" else METHODS_BAD - CASTS
    for m in re.finditer(r"\.\s*([a-z_]\w*)\s*\(", text):
        if m.group(1) in bad:
            return f"static scan: C++ calls tensor method .{m.group(1)}() (torch compute)"
    return None


# ----------------------------------------------------------------------------- what can run
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_UNITS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _main_guard(node) -> bool:
    """`if __name__ == "__main__":` (either order): its body never runs in a module that is imported."""
    t = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(t, ast.Compare) and len(t.ops) == 1 and \
        isinstance(t.ops[0], ast.Eq) and {ast.dump(t.left), ast.dump(t.comparators[0])} == \
        {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def _runs(nodes: list, main_dead: bool) -> tuple[list, list]:
    """(every node that executes when `nodes` do, the functions they define, whose bodies do not). A function's
    decorators, default values and annotations execute where it is defined; a class body does too."""
    ran, fns, todo = [], [], list(nodes)
    while todo:
        n = todo.pop()
        ran.append(n)
        if isinstance(n, _FUNCS):
            fns.append(n)
            todo += [*getattr(n, "decorator_list", ()), n.args, *filter(None, [getattr(n, "returns", None)])]
        elif main_dead and _main_guard(n):
            todo += [n.test, *n.orelse]
        else:
            todo += ast.iter_child_nodes(n)
    return ran, fns


def _module_level(body: list):
    """The statements of a module body, those inside its if / for / while / try / with blocks included (a def
    there binds a module-level name too), without descending into functions or classes."""
    for s in body:
        yield s
        if not isinstance(s, _UNITS):
            for f in ("body", "orelse", "finalbody", "handlers", "cases"):
                yield from _module_level(getattr(s, f, None) or [])


def live_regions(tree: ast.Module, root: str = "ModelNew") -> list[tuple[ast.AST | None, list]]:
    """What of a module can run once it is imported and `root` is built and called, as (region, nodes) pairs:
    region None holds everything that runs at import, a function node the statements of its body (a nested
    function is its own region). Live: import-time code, all methods of the classes named `root`, every
    decorated function (its decorator has it), module-level dunder functions, and every module-level function
    or class that live code names, transitively (a class with all its methods). With no class or def named
    `root`, or with `__subclasses__` anywhere (it reaches classes without naming them), the whole module.
    Meant to over-approximate: code that cannot run may be kept. What it misses is still judged by the dynamic
    layers when it runs."""
    code = ast.unparse(tree)
    main_dead = len(re.findall(r"\b__name__\b", code)) == sum(map(_main_guard, ast.walk(tree)))
    ran, fns = _runs(tree.body, main_dead)
    units: dict[str, list] = {}
    for s in _module_level(tree.body):
        if isinstance(s, _UNITS):
            units.setdefault(s.name, []).append(s)
    owner = {}   # function -> the module-level def or class it belongs to (none: a lambda run at import)
    for us in units.values():
        for u in us:
            for f in [u] if not isinstance(u, ast.ClassDef) else _runs(u.body, main_dead)[1]:
                owner[f] = u
    regions, seen, live = [(None, ran)], set(), set()
    todo = [f for f in fns if f not in owner or getattr(f, "decorator_list", None)]
    names = [n.id for n in ran if isinstance(n, ast.Name)]
    names += [root] + [k for k in units if k.startswith("__") and k.endswith("__")]
    if root not in units or "__subclasses__" in code:
        names += list(units)
    while todo or names:
        if names:
            for u in units.get(names.pop(), []):
                if u not in live:
                    live.add(u)
                    todo += [f for f, o in owner.items() if o is u]
            continue
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        body, inner = _runs(f.body if isinstance(f.body, list) else [f.body], main_dead)
        regions.append((f, body))
        todo += inner
        names += [n.id for n in body if isinstance(n, ast.Name)]
    return regions


# ----------------------------------------------------------------------------- the scan
def static_scan(source: str, allow_imports: tuple[str, ...] = (), rules: str = "cuda-agent") -> str | None:
    """Conservative scan of candidate Python (+ C++ strings) under the profile `rules` (module docstring):
    harness introspection, library patches, imports and escapes anywhere in the file; torch compute in the
    code that can run (forward's rules in functions, init rules at import and in `__init__`)."""
    assert rules in RULES, f"unknown rules {rules!r}: one of {', '.join(RULES)}"
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
    for node in ast.walk(tree):
        bad = _escape_call(node, alias, allow_imports) if isinstance(node, ast.Call) else None
        if bad:
            return f"static scan: {bad} (line {node.lineno}) is not allowed: it steps around the rules"
    # Names bound to a compiled library (`lib = load_kernel("k")`, `ctypes.CDLL(...)`, form (c)'s `import
    # cuda_extension`): `lib.mm(...)` is the candidate's own launcher, not a tensor method, and must not trip the
    # METHODS_BAD rule.
    libs = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
            and _dotted(n.value.func).rsplit(".", 1)[-1] in ("load_kernel", "CDLL", "LoadLibrary")
            for t in n.targets if isinstance(t, ast.Name)}
    libs |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
             if a.name == EXTENSION_MODULE}
    regions = live_regions(tree)
    for fn, nodes in regions:
        where = "module import" if fn is None else getattr(fn, "name", "lambda")
        for node in nodes:
            bad = _compute_call(node, alias, libs, where in ("module import", "__init__"), rules) \
                if isinstance(node, ast.Call) else None
            if bad:
                return f"static scan: torch compute {bad} in {where} (line {node.lineno})"
    for _, nodes in regions:  # C++ sources of load_inline (form a) that live code holds
        for node in nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "#include" in node.value:
                bad = _cpp_violation(node.value, rules)
                if bad:
                    return bad
    return None


# ----------------------------------------------------------------------------- comparison (host side)
def compare(ref: list, cand: list, devices: list | None, device: str, atol: float, rtol: float,
            work_device: str = "cpu") -> dict:
    """One call's outputs against the reference: {"ok", "max_abs_err", "max_rel_err", "rel_l2",
    "first_bad_index", "reason"}. Floating outputs: allclose AND relative L2 <= rtol, finite wherever the
    reference is; complex ones the same over both parts; integer and bool ones exactly. The elementwise work
    runs on `work_device` (tensors elsewhere are copied there a chunk at a time)."""
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
        cplx = r.is_complex()
        if cplx:  # both parts: a complex tensor cast to a real dtype silently drops the imaginary one
            r, c = torch.view_as_real(r), torch.view_as_real(c)
        if not r.is_floating_point():  # integers and bools (indices, masks, counts) are right or wrong
            ne = (r != c).reshape(-1)
            if bool(ne.any()):
                at = int(ne.nonzero()[0])
                return {**res, "first_bad_index": list(_unravel(at, r.shape)), "reason": f"{where}not equal at "
                        f"{list(_unravel(at, r.shape))} ({r.dtype} outputs are compared exactly)"}
            res = {**res, "max_abs_err": res["max_abs_err"] or 0.0, "max_rel_err": res["max_rel_err"] or 0.0,
                   "rel_l2": res["rel_l2"] or 0.0}
            continue
        part = (lambda at: " in the " + ("imaginary" if at % 2 else "real") + " part") if cplx else (lambda at: "")
        st = _compare_chunks(r.reshape(-1), c.reshape(-1), atol, rtol, work_device)
        rel_l2 = st["sq_diff"] ** 0.5 / st["sq_ref"] ** 0.5 if st["sq_ref"] > 1e-24 else 0.0
        mae = st["max_abs"]
        res = {**res, "max_abs_err": max(mae, res["max_abs_err"] or 0.0),
               "max_rel_err": max(st["max_rel"], res["max_rel_err"] or 0.0),
               "rel_l2": max(rel_l2, res["rel_l2"] or 0.0)}
        if st["nonfinite_at"] is not None:
            return {**res, "reason": f"{where}non-finite value where the reference is finite{part(st['nonfinite_at'])}",
                    "first_bad_index": list(_unravel(st["nonfinite_at"], r.shape))}
        if st["far_at"] is not None:
            return {**res, "first_bad_index": list(_unravel(st["far_at"], r.shape)),
                    "reason": f"{where}not allclose(atol={atol}, rtol={rtol}){part(st['far_at'])}: max abs err "
                              f"{mae:.3g}"}
        if rel_l2 > rtol:
            return {**res, "reason": f"{where}relative L2 error {rel_l2:.3g} > rtol {rtol}"}
    return {**res, "ok": True}


COMPARE_CHUNK = {"cpu": 1 << 22, "cuda": 1 << 25}  # elements per step: on the CPU host memory stays ~100 MB above
# the two outputs, whatever their size; on a GPU ~0.6 GB of temporaries, and a 4096 x 4096 output is one step


def _compare_chunks(r, c, atol: float, rtol: float, dev: str = "cpu") -> dict:
    """Statistics of flat `c` against flat `r`, a chunk at a time: the first index where the reference is
    finite and `c` is not, the first index that is not isclose(equal_nan), max abs and relative error, and
    sums of squares of the error and of the reference (finite reference positions only). Elementwise work is
    in float32 (float64 for float64 outputs): far below the tolerances; each chunk's sums are added in
    Python floats (float64), so their rounding is relative ~1e-4 at worst."""
    import torch
    st = {"nonfinite_at": None, "far_at": None, "max_abs": 0.0, "max_rel": 0.0, "sq_diff": 0.0, "sq_ref": 0.0}
    work = torch.float64 if r.dtype == torch.float64 else torch.float32
    step = COMPARE_CHUNK["cuda" if torch.device(dev).type == "cuda" else "cpu"]
    for i in range(0, r.numel(), step):
        rc, cc = r[i:i + step].to(dev, work), c[i:i + step].to(dev, work)
        fin_r = torch.isfinite(rc)
        d = cc.sub(rc).abs_()
        ra = rc.abs()
        bad = ~(d <= ra.mul(rtol).add_(atol))  # NaN or inf in c -> not <= -> bad
        # the usual case (a finite reference, every element close) in one device-to-host read: a GPU call's
        # comparison waits on the device once, not once per statistic
        fin, far, mx, mr, sd, sr = torch.stack([fin_r.all().to(work), bad.any().to(work), d.max(),
                                                (d / ra.clamp_min(1e-6)).max(), torch.dot(d, d),
                                                torch.dot(rc, rc)]).tolist()
        all_fin = bool(fin)
        if all_fin and not far:
            st.update(max_abs=max(st["max_abs"], mx), max_rel=max(st["max_rel"], mr))
            st["sq_diff"] += sd
            st["sq_ref"] += sr
            continue
        if not all_fin:
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


# ----------------------------------------------------------------------------- timing (host side)
def timing(calls: list, end: dict, base: dict, v, cfg, retime):
    """Fill the verdict `v` from a check's timed calls (the driver's reports) and the baselines it is compared
    with: eager's rounds from the candidate's own child when they came (`end["eager"]`), else the cached
    `base`; a cached baseline that a speedup tier would rest on is re-timed once (`retime()`) when it was
    measured in a single run. The candidate's time is the baselines' statistic: its timed calls after warm-up
    in BASELINE_ROUNDS consecutive rounds, the minimum round median kept (a median over all calls against a
    minimum over the baseline's rounds would favour the baseline by the spread between rounds; every call of
    every round is compared in full, so a fast round is a correct one)."""
    timed = [c for c in calls if c.get("phase") == "time"][cfg.warmup:]
    ms = [c["ms"] for c in timed]
    rounds, mean = measure.round_medians(ms), statistics.fmean(ms)
    cand_ms = min(rounds)
    excess = [c.get("excess_ms") or 0.0 for c in timed]
    v.timings.update({"cand_cv": statistics.pstdev(ms) / mean if mean > 0 else 0.0, "n_iters": len(ms),
                      "cand_rounds": [round(r, 5) for r in rounds], "cand_median_all": statistics.median(ms),
                      # GPU: the driver's preparation of each call, and what of it was charged to the call
                      "prep_ms_median": statistics.median(c.get("prep_ms") or 0.0 for c in timed),
                      "prep_excess_calls": sum(e > 0 for e in excess), "prep_excess_ms_max": max(excess),
                      # the driver's wall time of a call and its parts (where a check's seconds go)
                      **{f"call_{k}_median": statistics.median(c.get(k) or 0.0 for c in timed)
                         for k in ("host_ms", "enqueue_ms", "reply_ms", "stop_ms", "judge_ms")},
                      "variants": {k: sum(c.get("variant") == k for c in timed) for k in ("plain", "affine", "heavy")},
                      # GPU: the queued clock's fixed part taken off each queued call (the pairing's null calls)
                      "floor_ms": end.get("floor_ms"),
                      # GPU: calls whose clock held GPU work only ("queued"), or the forward's host time too
                      "clocks": {k: n for k in ("queued", "fallback", "go-first")
                                 if (n := sum(c.get("clock") == k for c in timed))}})
    beside = end.get("eager") or None  # eager timed in the candidate's child, when it came
    cached = base["compile_ms"] if beside else base["eager_ms"]  # the baseline a tier would rest on
    if cached and cand_ms < 0.95 * cached and base.get("runs", 1) < 2:  # ... measured in a single run
        base = retime()
        v.timings["baseline_retimed"] = True
    v.timings.update({"baseline": f"min of {len(base['eager_rounds'])} round medians over {base['runs']} run(s)",
                      "eager_spread": round(base.get("spread", 0.0), 4), "eager_cached_ms": base["eager_ms"],
                      "compile_error": base.get("compile_error"), "baseline_clocks": base.get("clocks"),
                      "baseline_floor_ms": base.get("floor_ms")})
    eager_ms = base["eager_ms"]
    if beside:  # the same statistic over eager's rounds in the candidate's child, just before its import
        eager_ms = min(beside)
        v.timings.update({"baseline": f"eager: min of {len(beside)} round medians in the candidate's "
                                      f"child; compile: " + v.timings["baseline"],
                          "eager_rounds": [round(r, 5) for r in beside]})
    elif end.get("eager_error"):  # it failed there: the cached baseline, and why
        v.timings["eager_beside_error"] = end["eager_error"]
    v.candidate_ms, v.eager_ms, v.compile_ms = cand_ms, eager_ms, base["compile_ms"]
    if v.candidate_ms > 0:
        v.speedup_eager = v.eager_ms / v.candidate_ms
        v.speedup_compile = v.compile_ms / v.candidate_ms if v.compile_ms else None
    v.stage = "done"
