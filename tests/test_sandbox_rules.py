"""The static scan's rule profiles and its reachability (sandbox/harness/rules.py: static_scan, live_regions):
pure functions of source text, no child, no compiler. One property per test, each with an honest control.

Run: python -m pytest tests/test_sandbox_rules.py -q
"""
import ast
import contextlib
import dataclasses
import textwrap

import pytest

import sandbox
from sandbox.harness.rules import RULES, live_regions, static_scan

# A KernelBench-style sample: load_inline C++ that allocates its output, and the task's own helpers copied along
# (get_inputs with torch.randn is never called by the harness: it uses the task's).
SAMPLE = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from torch.utils.cpp_extension import load_inline

    cpp = """
    #include <torch/extension.h>
    torch::Tensor scale(torch::Tensor x, double a) {
        auto y = ALLOC;
        // a loop over x.data_ptr<float>() fills y
        return y;
    }
    """
    ext = load_inline(name="scale_ext", cpp_sources=cpp, functions=["scale"])


    def finish(y):
        return HELPER


    class ModelNew(nn.Module):
        def __init__(self, bias=False):
            super().__init__()
            if bias:
                self.bias = nn.Parameter(torch.Tensor(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            FORWARD
            return ext.scale(x, 2.0)


    def get_inputs():
        return [torch.randn(16, 16)]


    def get_init_inputs():
        return []
    ''')


def sample(forward="pass", helper="y", alloc="torch::empty_like(x)", tail=""):
    """SAMPLE with forward's first statements, the helper's return value, the C++ output allocation, and lines
    appended at module level (always valid Python: the scan leaves a syntax error to the child)."""
    src = SAMPLE.replace("FORWARD", forward.replace("\n", "\n" + " " * 8)).replace("HELPER", helper)
    src = src.replace("ALLOC", alloc) + tail
    ast.parse(src)
    return src


@pytest.mark.parametrize("rules", RULES)
def test_unused_helpers_are_not_read(rules):
    """get_inputs' torch.randn and an uncalled helper's torch.relu never run: no violation."""
    assert static_scan(sample(), (), rules) is None
    assert static_scan(sample(helper="torch.relu(y)"), (), rules) is None


def test_reachable_torch_compute_is_refused_wherever_it_is_reached():
    """The unused get_inputs' own call, moved into forward or made live by a call at import, is refused
    (cuda-agent: random creation is not allocation); compute in a helper forward calls, or at import, under both."""
    assert "torch.randn in forward" in static_scan(sample(forward="x = torch.randn(16, 16)"))
    assert "torch.randn in get_inputs" in static_scan(sample(tail="X = get_inputs()\n"))
    for rules in RULES:
        assert "torch.relu in finish" in static_scan(sample(forward="x = finish(x)", helper="torch.relu(y)"), (), rules)
        assert "torch.matmul in module import" in \
            static_scan(sample(tail="W = torch.matmul(torch.randn(4, 4), torch.randn(4, 4))\n"), (), rules)


def test_helpers_are_followed_through_names_classes_and_bases():
    """Live code that names a function or class makes it live: a call, a reference passed on, a base class."""
    via_ref = sample(forward="self.fn = finish", helper="torch.relu(y)")
    assert "torch.relu in finish" in static_scan(via_ref)
    base = sample(helper="torch.relu(y)").replace("class ModelNew(nn.Module)", "class ModelNew(Base)") + \
        "class Base(nn.Module):\n    def extra(self, y):\n        return finish(y)\n"
    assert "torch.relu in finish" in static_scan(base)
    deco = sample() + "@torch.no_grad()\ndef registered(x):\n    return torch.relu(x)\n"
    assert "torch.relu in registered" in static_scan(deco)  # its decorator holds it, whatever that does


@pytest.mark.parametrize("rules", RULES)
def test_a_never_taken_branch_is_still_read(rules):
    """The scan reads code, not traces: a fallback under a condition that is never true is still refused."""
    assert "torch.relu in forward" in static_scan(sample(forward="if x is None:\n    return torch.relu(x)"), (), rules)


def test_conv2d_bias_branch_with_the_legacy_constructor_passes():
    """`nn.Parameter(torch.Tensor(n))` under `if bias:` is allocation; torch.Tensor as a type never was a call."""
    src = sample()
    assert "torch.Tensor(16)" in src and "x: torch.Tensor" in src
    for rules in RULES:
        assert static_scan(src, (), rules) is None


@pytest.mark.parametrize("rules", RULES)
@pytest.mark.parametrize("alloc", ["torch::zeros_like(x)", "torch::zeros({x.size(0), x.size(1)}, x.options())",
                                   "torch::empty_like(x); y.zero_()", "torch::ones_like(x); y.fill_(0.0)"])
def test_output_allocation_in_cpp_passes_under_both_profiles(rules, alloc):
    assert static_scan(sample(alloc=alloc), (), rules) is None


@pytest.mark.parametrize("rules", RULES)
@pytest.mark.parametrize("call", ["torch::matmul(x, x)", "at::relu(x)", "x.sum()", "torch::nn::functional::gelu(x)",
                                  "at::native::relu(x)", "at::cpu::relu(x)", "at::_ops::relu::call(x)"])
def test_torch_compute_in_cpp_is_refused_under_both_profiles(rules, call):
    assert "C++ calls" in (static_scan(sample(alloc=call), (), rules) or "")


@pytest.mark.parametrize("rules", RULES)
def test_python_allocation_and_fills_pass_in_forward(rules):
    fwd = "y = torch.zeros_like(x)\nz = torch.full((4,), 1.0)\nw = x.new_zeros(4)\ny.zero_()\nz.fill_(2.0)"
    assert static_scan(sample(forward=fwd), (), rules) is None


def test_the_profiles_differ_on_names_that_compute_nothing():
    """cuda-agent allows only its allocation/view/metadata names; kernelbench refuses only names of compute and
    leaves the rest to the dynamic layers (a no-op cast, a C++ runtime helper)."""
    for src in (sample(forward="x = x.float()"), sample(alloc="torch::empty({at::ceil_div(x.size(0), 4L)})")):
        assert static_scan(src, (), "cuda-agent") and static_scan(src, (), "kernelbench") is None
    for fwd in ("x = torch.relu(x)", "x = F.relu(x)", "x = x.clamp(min=0)", "x = torch.linalg.norm(x)"):
        src = sample(forward=fwd).replace("import torch.nn as nn",
                                          "import torch.nn as nn\nfrom torch.nn import functional as F")
        assert static_scan(src, (), "cuda-agent") and static_scan(src, (), "kernelbench"), fwd


@pytest.mark.parametrize("rules", RULES)
def test_rules_that_no_dynamic_layer_backs_are_read_in_the_whole_file(rules):
    """Escapes (eval, a computed getattr, a way out to numpy) and introspection count in dead code too."""
    for dead in ("eval('y')", "getattr(torch, 're' + 'lu')(y)", "y.numpy()",
                 "torch._C._dispatch_tls_local_include_set()"):
        assert static_scan(sample(helper=dead), (), rules), dead


def test_main_block_is_dead_unless_name_is_rebound():
    main = 'if __name__ == "__main__":\n    print(torch.relu(get_inputs()[0]))\n'
    assert static_scan(sample(tail=main)) is None
    assert "torch.relu in module import" in static_scan(sample(tail='__name__ = "__main__"\n' + main))


def test_a_file_without_modelnew_is_read_whole():
    helper_module = "import torch\n\ndef unused(x):\n    return torch.relu(x)\n"
    assert "torch.relu in unused" in static_scan(helper_module)
    # a class reached through __subclasses__ is never named: the whole module is read then
    hidden = sample(forward="k = [c for c in getattr(nn.Module, '__subclasses__')() if c.__name__ == 'Hidden']") + \
        "class Hidden(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
    assert "torch.relu in forward" in static_scan(hidden, (), "kernelbench")
    assert "torch.randn in get_inputs" in static_scan(hidden, (), "cuda-agent")


def test_live_regions_by_hand():
    tree = ast.parse(textwrap.dedent('''
        import torch
        def a(): return b()
        def b(): return 1
        def c(): return d()
        def d(): return 2
        class Base:
            def m(self): return e()
        def e(): return 3
        class ModelNew(Base):
            def forward(self, x): return a()
            def other(self): return [f for f in ()]
        def get_inputs(): return c()
        '''))
    live = {getattr(fn, "name", None) for fn, _ in live_regions(tree)}
    assert live == {None, "a", "b", "forward", "other", "m", "e"}


def test_unknown_profile_stops_the_caller(tmp_path):
    """A profile name the scan does not know is the caller's error (one line), never a candidate's verdict."""
    with pytest.raises(AssertionError):
        static_scan("x = 1", (), "strict")
    cfg = dataclasses.replace(sandbox.SandboxConfig(), rules="strict")
    with pytest.raises(sandbox.SandboxError, match="--sandbox.rules 'strict'"):
        sandbox.core._prepare("a", sample(), cfg, sandbox.Verdict(), contextlib.nullcontext, str(tmp_path))
    v, cfg = sandbox.Verdict(), sandbox.SandboxConfig(rules="kernelbench")  # refused by the scan, before any build
    assert sandbox.core._prepare("a", sample(forward="x = torch.relu(x)"), cfg, v, contextlib.nullcontext,
                                 str(tmp_path)) is None
    assert "torch.relu" in v.violation and v.timings["rules"] == "kernelbench"  # the verdict names its profile


# ----------------------------------------------------------------------------- answered on the host, before any child
@pytest.mark.parametrize("bad, what", [("class ModelNew(:\n    pass\n", "error"),
                                      (SAMPLE.replace("ALLOC", "torch::empty_like(x)").replace(
                                          "HELPER", "torch.matmul(y, y)").replace("FORWARD", "x = finish(x)"),
                                       "violation")])
def test_refusals_are_answered_on_the_host_before_any_child_starts(tmp_path, monkeypatch, bad, what):
    """A syntax error or a static-scan violation costs milliseconds: no compile, build, guard build or child."""
    import time

    import sandbox.child
    import sandbox.core

    def no_child(*a, **k):
        raise AssertionError("a child was started for a refusal the host can answer")
    monkeypatch.setattr(sandbox.child.Child, "__init__", no_child)
    monkeypatch.setattr(sandbox.core, "guard_library", no_child)
    monkeypatch.setattr(sandbox.core, "bytecode_cache", no_child)
    task = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n" \
           "def get_inputs():\n    return [torch.randn(4)]\ndef get_init_inputs():\n    return []\n"
    cfg = sandbox.SandboxConfig(cache_dir=str(tmp_path / "cache"))
    t = time.perf_counter()
    v = sandbox.check(task, bad, cfg)
    assert time.perf_counter() - t < 1.0
    assert not v.correct and getattr(v, what), v.to_dict()
    ws = tmp_path / "ws"  # the same through a workspace
    ws.mkdir()
    (ws / "model_new.py").write_text(bad)
    v = sandbox.check(task, ws, cfg)
    assert not v.correct and getattr(v, what) and not v.compiled, v.to_dict()
