"""The sandbox's `torch.utils.cpp_extension.load_inline`, for KernelBench-form (form a) solutions. Runs INSIDE
a sandbox child (bound beside sandbox_worker.py; like it, it imports nothing of the project).

A build child (sandbox.build.build_inline: the solution imported, ModelNew constructed, no input in sight)
compiles each load_inline call against a slim stand-in for torch's headers first and records the module; a
candidate child imports the recorded module from its private copy of the build dir, without a compiler.
Form (c) (sandbox/extension.py, built on the host's side): `install_extension` makes `import cuda_extension`
load the candidate child's private copy of the built module.

Smoke: python -m pytest tests/test_kernelbench_eval_e2e.py -q -k load_inline
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys

# A stand-in for <torch/extension.h> and <torch/types.h> that a load_inline build sees first (-I comes before
# torch's -isystem dirs): the tensor class, factory functions, dispatch macros, the CUDA stream and, for C++,
# the pybind11 bindings, without the rest of the C++ frontend (nn, optim, data, autograd, all of ATen's ops).
# On an H200 host nvcc takes 14 s for a typical one-kernel source against it and 52 s against torch's header
# (docs/RESULTS.md). A source that does not compile against it is built again with torch's own headers.
SLIM_TORCH_H = r"""#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <optional>
#ifdef __CUDACC__
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#else
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/Exceptions.h>
#endif
namespace torch {
using namespace at;  // NOLINT
using std::nullopt;
using std::optional;
using Dtype = at::ScalarType;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace torch
"""
_INLINE_ARGS = ("functions", "extra_cflags", "extra_cuda_cflags", "extra_sycl_cflags", "extra_ldflags",
                "extra_include_paths", "build_directory", "verbose", "with_cuda", "with_sycl", "is_python_module",
                "with_pytorch_error_handling", "keep_intermediates", "use_pch", "no_implicit_headers")


def install(ext_dir: str):
    """Replace torch.utils.cpp_extension.load_inline in this process by the sandbox's: each call is keyed by
    its arguments under `ext_dir`. A build child (empty `ext_dir`) compiles against SLIM_TORCH_H first, then
    against torch's headers if that fails, and records the module; a candidate child finds the record in its
    private copy of `ext_dir` and imports the built module without a compiler."""
    import torch.utils.cpp_extension as ce
    real = ce.load_inline

    def load_inline(name, cpp_sources, cuda_sources=None, *args, **kwargs):
        kw = {**dict(zip(_INLINE_ARGS, args)), **kwargs}
        if kw.get("build_directory") or not kw.get("is_python_module", True) or kw.get("sycl_sources"):
            return real(name, cpp_sources, cuda_sources, **kw)  # forms this loader does not reproduce
        blob = json.dumps([name, cpp_sources, cuda_sources, sorted(kw.items())], default=str)
        home = os.path.join(ext_dir, hashlib.sha256(blob.encode()).hexdigest()[:16])
        record = os.path.join(home, "built.json")
        if os.path.isfile(record):  # built before, in the build child
            with open(record) as f:
                rec = json.load(f)
            if rec.get("error"):
                raise RuntimeError(rec["error"])
            spec = importlib.util.spec_from_file_location(rec["module"], os.path.join(home, rec["so"]))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
        slim = os.path.join(home, "slim_include")
        for header in ("extension.h", "types.h"):
            os.makedirs(os.path.join(slim, "torch"), exist_ok=True)
            with open(os.path.join(slim, "torch", header), "w") as f:
                f.write(SLIM_TORCH_H)
        inc = [f"-I{slim}"]
        tries = [("slim", {**kw, "extra_cflags": list(kw.get("extra_cflags") or []) + inc,
                           "extra_cuda_cflags": list(kw.get("extra_cuda_cflags") or []) + inc}), ("full", kw)]
        for i, (tag, args_) in enumerate(tries):
            out = os.path.join(home, tag)
            os.makedirs(out, exist_ok=True)
            try:
                mod = real(name, cpp_sources, cuda_sources, **{**args_, "build_directory": out})
                break
            except (RuntimeError, ImportError, OSError) as e:
                if i == len(tries) - 1:
                    with open(record, "w") as f:
                        json.dump({"error": str(e)[-3000:]}, f)
                    raise
        with open(record, "w") as f:
            json.dump({"module": mod.__name__, "so": os.path.relpath(mod.__file__, home), "headers": tag}, f)
        return mod

    ce.load_inline = load_inline


def install_extension(so: str, name: str = "cuda_extension"):
    """Form (c): `import cuda_extension` in this process loads `so`, the host's build of the workspace (a private
    copy), ahead of anything on sys.path; the module's own code first runs at that import, the candidate's."""
    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            return importlib.util.spec_from_file_location(name, so) if fullname == name else None

    sys.meta_path.insert(0, Finder())
