"""KernelBench-form checks: one file that builds its kernel with torch's `load_inline`, on a level-2-style
problem (GEMM, scale, LeakyReLU; 128x1024 @ 1024->512). Reports torch's own cold build of the sample next to
sandbox checks with a cold build cache (every check's source differs by a comment, so none is built before).

Per check: wall seconds, the build's seconds and the headers it compiled against (`slim`: the sandbox's
stand-in for <torch/extension.h>; `full`: torch's, after a slim build failed), and the candidate child's
seconds. The first check also computes the task's baselines; the rest find them cached.

GPU: python scripts/bench_inline.py --device cuda --checks 5
CPU: python scripts/bench_inline.py --device cpu --checks 2     (a C++ sample; ~1 min a build on 2 cores)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402

TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """GEMM, then a scale, then LeakyReLU."""
    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier, self.negative_slope = multiplier, negative_slope

    def forward(self, x):
        return torch.nn.functional.leaky_relu(self.gemm(x) * self.multiplier, self.negative_slope)


def get_inputs():
    return [torch.randn(128, 1024)]


def get_init_inputs():
    return [1024, 512, 2.0, 0.1]
'''
CUDA_SRC = r'''
#include <torch/extension.h>
#include <cuda_runtime.h>
#define TILE 16
__global__ void gemm_mul_lrelu(const float* x, const float* w, const float* b, float* y, int M, int N, int K,
                               float mult, float slope) {
    __shared__ float xs[TILE][TILE], ws[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    int wrow = blockIdx.x * TILE + threadIdx.y;
    float acc = 0.f;
    for (int t = 0; t < (K + TILE - 1) / TILE; ++t) {
        int k = t * TILE + threadIdx.x;
        xs[threadIdx.y][threadIdx.x] = (row < M && k < K) ? x[row * K + k] : 0.f;
        ws[threadIdx.x][threadIdx.y] = (wrow < N && k < K) ? w[wrow * K + k] : 0.f;
        __syncthreads();
        for (int j = 0; j < TILE; ++j) acc += xs[threadIdx.y][j] * ws[j][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) { float v = (acc + b[col]) * mult; y[row * N + col] = v > 0.f ? v : v * slope; }
}
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor w, torch::Tensor b, double mult, double slope) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x must be a float32 CUDA tensor");
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int M = xc.size(0), K = xc.size(1), N = wc.size(0);
    auto y = torch::empty({M, N}, xc.options());
    dim3 block(TILE, TILE), grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    gemm_mul_lrelu<<<grid, block>>>(xc.data_ptr<float>(), wc.data_ptr<float>(), b.data_ptr<float>(),
                                    y.data_ptr<float>(), M, N, K, (float)mult, (float)slope);
    return y;
}
'''
CPP_SRC = r'''
#include <torch/extension.h>
torch::Tensor fused_forward(torch::Tensor x, torch::Tensor w, torch::Tensor b, double mult, double slope) {
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
    auto y = torch::empty({M, N}, xc.options());
    const float *X = xc.data_ptr<float>(), *W = wc.data_ptr<float>(), *B = b.data_ptr<float>();
    float* Y = y.data_ptr<float>();
#pragma omp parallel for
    for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
            float acc = B[j];
            for (int64_t k = 0; k < K; ++k) acc += X[i * K + k] * W[j * K + k];
            acc *= (float)mult;
            Y[i * N + j] = acc > 0.f ? acc : acc * (float)slope;
        }
    return y;
}
'''
DECL = "torch::Tensor fused_forward(torch::Tensor x, torch::Tensor w, torch::Tensor b, double mult, double slope);"
SAMPLE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = {src!r}  # {nonce}
ext = load_inline(name="gemm_mul_lrelu_{nonce}", cpp_sources={cpp!r}, {cuda}functions=["fused_forward"],
                  {flags}verbose=False)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier, self.negative_slope = multiplier, negative_slope

    def forward(self, x):
        return ext.fused_forward(x, self.gemm.weight, self.gemm.bias, self.multiplier, self.negative_slope)
'''


def sample(device: str, nonce: str) -> str:
    if device == "cuda":
        return SAMPLE.format(src=CUDA_SRC, nonce=nonce, cpp=DECL, cuda="cuda_sources=SRC, ", flags="")
    return SAMPLE.format(src=CPP_SRC, nonce=nonce, cpp="SRC", cuda="",
                         flags="extra_cflags=['-O3', '-fopenmp'], ").replace("cpp_sources='SRC'", "cpp_sources=SRC")


def torch_build_s(device: str) -> float:
    """torch's own load_inline of the same sample, cold, in a fresh process and build dir."""
    code = sample(device, f"t{time.time_ns()}").split("\n\nclass ModelNew")[0]
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCH_EXTENSIONS_DIR": d},
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--checks", type=int, default=5, help="checks after the first, each with a cold build cache")
    p.add_argument("--skip-torch-build", action="store_true", help="skip timing torch's own load_inline build")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_inline.json"))
    a = p.parse_args()
    res = {"device": a.device, "isolation": sandbox.isolation()}
    res["torch_load_inline_s"] = None if a.skip_torch_build else torch_build_s(a.device)
    print(f"torch load_inline, cold: {res['torch_load_inline_s']}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        cfg = sandbox.SandboxConfig(device=a.device, cache_dir=os.path.join(root, "cache"))
        rows = []
        for i in range(a.checks + 1):
            t = time.perf_counter()
            v = sandbox.check(TASK, sample(a.device, f"n{i}_{time.time_ns()}"), cfg)
            rows.append({"wall_s": round(time.perf_counter() - t, 2), "correct": v.correct, "error": v.error,
                         "build_s": v.timings.get("build_s"), "candidate_s": v.timings.get("candidate_s"),
                         "reference_s": v.timings.get("reference_s"), "warm_child": v.timings.get("warm_child"),
                         "candidate_ms": v.candidate_ms, "eager_ms": v.eager_ms, "compile_ms": v.compile_ms})
            print(("first check (baselines): " if i == 0 else f"check {i}: ") + json.dumps(rows[-1]), flush=True)
        heads = []
        for dirpath, _, files in os.walk(os.path.join(root, "cache", "torch_ext")):
            if "built.json" in files:
                with open(os.path.join(dirpath, "built.json")) as f:
                    heads.append(json.load(f).get("headers"))
    res["checks"], res["headers"] = rows, heads
    rest = rows[1:] or rows
    print("\n| metric | value |\n|---|---|")
    print(f"| machine | {a.device}, isolation {res['isolation']} |")
    print(f"| torch's load_inline, cold build | {res['torch_load_inline_s'] or float('nan'):.1f} s |")
    print(f"| first check (baselines + build) | {rows[0]['wall_s']:.1f} s |")
    walls, builds = [r["wall_s"] for r in rest], [r["build_s"] or 0 for r in rest]
    print(f"| check with a cold build cache, median of {len(rest)} | {statistics.median(walls):.1f} s "
          f"({min(walls):.1f}-{max(walls):.1f}; build {statistics.median(builds):.1f} s) |")
    print(f"| headers the builds used | {', '.join(map(str, heads))} |")
    print(f"| all correct | {all(r['correct'] for r in rows)} |")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
