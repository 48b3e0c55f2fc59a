"""Form (c): the CUDA Agent workspace as the paper released it (model_new.py importing `cuda_extension`,
kernels/NAME.{cu,cpp} + kernels/NAME_binding.cpp, root binding.cpp + binding_registry.h), built as one torch
extension (sandbox/extension.py) and checked like the other forms. Fixtures: tests/fixtures/cuda_agent/, an
axpby op in that layout, a .cpp variant for the cpu backend and a .cu variant for the GPU.

The cpu tests share one workspace path and one cache, as an agent's workspace does across its checks: the
first build is cold (0.5-2 min on 2 cores, by load), later ones recompile only what changed.
Run: python -m pytest tests/test_workspace_cuda_agent.py -q     GPU: ... -q -m gpu
"""
import json
import os
import pathlib
import shutil
import time

import pytest

import sandbox
import sandbox.extension
import tools
from cuda_agent import main
from sandbox import SandboxConfig

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "cuda_agent")
TASK = pathlib.Path(FIX, "axpby_task.py")
FORM = "cuda-agent workspace (cuda_extension)"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda_agent")


@pytest.fixture
def cfg(root):
    return SandboxConfig(device="cpu", cache_dir=str(root / "cache"), n_trials=2, profile=False)


@pytest.fixture
def ws(root):
    """A fresh copy of the cpu variant, always at the same path (the build dir is kept per workspace path)."""
    path = root / "ws"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(os.path.join(FIX, "axpby_cpu"), path)
    return path


def edit(path, old: str, new: str):
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def objects(cfg) -> dict:
    """{object file: mtime} of every build dir of the cache (one workspace path in these tests)."""
    out = {}
    for d, _, names in os.walk(os.path.join(cfg.cache_dir, "cuda_ext", "work")):
        out.update({os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns for n in names if n.endswith(".o")})
    return out


def cli_check(ws, cfg, *extra) -> int:
    """`python cuda_agent.py check TASK WS` with `cfg`'s cache, correctness only."""
    return main(["check", str(TASK), str(ws), "--sandbox.device", "cpu", "--sandbox.cache-dir", cfg.cache_dir,
                 "--sandbox.n-trials", "2", "--sandbox.no-profile", *extra])


# ---------------------------------------------------------------------------------------------- the layout
def test_the_layout_is_recognised_and_its_sources_follow_the_backend():
    relu_ws = os.path.join(os.path.dirname(FIX), "sandbox", "relu_ws")
    assert sandbox.extension.is_extension_workspace(os.path.join(FIX, "axpby_cpu"))
    assert sandbox.extension.is_extension_workspace(os.path.join(FIX, "axpby_cuda"))
    assert not sandbox.extension.is_extension_workspace(relu_ws)  # form (b): ctypes kernels
    files = ["binding.cpp", "binding_registry.h", "model_new.py", "kernels/axpby.cu", "kernels/axpby_binding.cpp",
             "kernels/axpby_cpu.cpp", "kernels/impl/helper.cpp"]
    assert sandbox.extension.extension_sources(files, "cuda") == [
        "binding.cpp", "kernels/axpby.cu", "kernels/axpby_binding.cpp", "kernels/axpby_cpu.cpp"]
    assert sandbox.extension.extension_sources(files, "cpu") == [  # CPU-only torch cannot link .cu sources
        "binding.cpp", "kernels/axpby_binding.cpp", "kernels/axpby_cpu.cpp"]


def test_torch_compute_in_the_cpp_is_refused_before_any_build(ws, cfg):
    edit(ws / "kernels" / "axpby.cpp", "auto out = torch::empty_like(x);", "auto out = at::add(x, y);")
    v = sandbox.check(TASK, ws, cfg)
    assert v.violation == "static scan: kernels/axpby.cpp calls at::add (torch compute)", v.to_dict()
    assert not v.compiled and v.form == FORM and "build_s" not in v.timings


# ---------------------------------------------------------------------------------------------- builds and checks
@pytest.mark.slow
def test_cpu_variant_builds_as_one_extension_and_passes_check(ws, cfg, capsys):
    """The released layout, .cpp kernels: one `cuda_extension`, imported by model_new.py in the candidate's
    child; the verdict names the form; an unchanged workspace is a cache hit."""
    rc = cli_check(ws, cfg, "--json")
    v = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and v["compiled"] and v["correct"] and v["reward"] == 1.0, v
    assert v["form"] == FORM and v["timings"]["build_s"] >= 0
    t0 = time.perf_counter()
    ok, log, sos = sandbox.compile_workspace(str(ws), cfg)  # what the agent's compile tool runs
    assert ok and set(sos) == {"cuda_extension"} and time.perf_counter() - t0 < 5, log


@pytest.mark.slow
def test_an_edit_of_one_kernel_recompiles_that_kernel_only(ws, cfg):
    """Ninja in the workspace's kept build dir: the edited kernel's object and the link, nothing else."""
    kernel = ws / "kernels" / "axpby.cpp"
    edit(kernel, "#include <torch/extension.h>", "#include <torch/extension.h>\n// build A")
    ok, log, _ = sandbox.compile_workspace(str(ws), cfg)
    assert ok, log
    before = objects(cfg)
    edit(kernel, "// build A", "// build B")
    t0 = time.perf_counter()
    ok, log, sos = sandbox.compile_workspace(str(ws), cfg)
    took = time.perf_counter() - t0
    assert ok, log
    after = objects(cfg)
    changed = sorted(os.path.basename(p) for p, t in after.items() if before.get(p) != t)
    assert changed == ["axpby.o"], changed
    print(f"rebuild after a one-kernel edit: {took:.1f} s")
    assert sandbox.compile_workspace(str(ws), cfg)[2] == sos and objects(cfg) == after  # now a cache hit


@pytest.mark.slow
def test_a_compile_error_is_reported_with_its_file(ws, cfg, capsys):
    edit(ws / "kernels" / "axpby_binding.cpp", 'pybind11::arg("beta"));', 'pybind11::arg("beta"))')
    rc = cli_check(ws, cfg)
    out = capsys.readouterr().out
    assert rc == 1 and f"form      : {FORM}" in out, out
    v = sandbox.check(TASK, ws, cfg)  # the same sources: the same error, from the cache
    assert not v.compiled and not v.correct and v.stage == "compile", v.to_dict()
    assert v.error.startswith("compile failed: kernels/axpby_binding.cpp:") and "error" in v.error, v.error
    assert f"error     : {v.error}" in out and v.timings["build_s"] < 1


# ---------------------------------------------------------------------------------------------- the agent's workspace
def test_make_workspace_writes_the_layout_and_its_instructions(tmp_path):
    task = open(TASK).read()
    for device, ext in (("cpu", "cpp"), ("cuda", "cu")):
        ws = tools.make_workspace(str(tmp_path / device), task, device, layout="cuda_extension")
        assert set(tools.snapshot(ws)) == {"model_new.py", "binding.cpp", "binding_registry.h",
                                           f"kernels/kernel.{ext}", "kernels/kernel_binding.cpp"}
        assert sandbox.extension.is_extension_workspace(ws)
        text = open(os.path.join(ws, "INSTRUCTIONS.md")).read()
        assert "cuda_extension" in text and "REGISTER_BINDING" in text and f"kernels/NAME.{ext}" in text
        assert "import cuda_extension" in open(os.path.join(ws, "model_new.py")).read()
        assert "kernel_forward" in open(os.path.join(ws, "kernels", "kernel_binding.cpp")).read()
    default = tools.make_workspace(str(tmp_path / "default"), task, "cpu")  # unchanged: form (b)
    assert set(tools.snapshot(default)) == {"model_new.py", "kernels/kernel.cpp"}
    assert not sandbox.extension.is_extension_workspace(default)
    with pytest.raises(AssertionError):
        tools.make_workspace(str(tmp_path / "x"), task, "cpu", layout="nope")


@pytest.mark.slow
def test_the_untouched_template_fails_as_the_default_one_does(root, cfg, tmp_path):
    """Both scaffolds build, load and fail at the first call (forward raises NotImplementedError)."""
    task = open(TASK).read()
    tools.make_workspace(str(root / "ws"), task, "cpu", layout="cuda_extension")
    tools.make_workspace(str(tmp_path / "b"), task, "cpu")
    ours, base = sandbox.check(TASK, root / "ws", cfg), sandbox.check(TASK, tmp_path / "b", cfg)
    for v in (ours, base):
        assert v.compiled and not v.correct and v.stage == "verify", v.to_dict()
        assert v.error.startswith("incorrect on trial 0: forward raised: NotImplementedError: TODO"), v.error
    assert (ours.form, base.form) == (FORM, "workspace, ctypes kernels (form b)")


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_variant_builds_and_passes_check_on_the_gpu(tmp_path):
    """The .cu variant: nvcc with the released flags and TORCH_CUDA_ARCH_LIST from the device; a profiled check
    passes; an edit of the kernel recompiles only its object."""
    cfg = SandboxConfig(device="cuda", cache_dir=str(tmp_path / "cache"), warmup=3, iters=20)
    ws = tmp_path / "ws"
    shutil.copytree(os.path.join(FIX, "axpby_cuda"), ws)
    v = sandbox.check(TASK, ws, cfg)
    assert v.compiled and v.correct and v.form == FORM and v.candidate_ms > 0, v.to_dict()
    print(f"cold build {v.timings['build_s']:.1f} s")
    before = objects(cfg)
    edit(ws / "kernels" / "axpby.cu", "if (i < n) out[i]", "if (i < n) /* edited */ out[i]")
    t0 = time.perf_counter()
    ok, log, _ = sandbox.compile_workspace(str(ws), cfg)
    print(f"rebuild after a one-kernel edit: {time.perf_counter() - t0:.1f} s")
    assert ok, log
    changed = sorted(os.path.basename(p) for p, t in objects(cfg).items() if before.get(p) != t)
    assert changed == ["axpby.cuda.o"], changed
    v = sandbox.check(TASK, ws, cfg)
    assert v.correct, v.to_dict()
