"""`check` on a GPU at its default flags, as a user runs it: a KernelBench-size output (1 GiB) passes the
default memory limits, and a one-off `python cuda_agent.py check` on a warm cache answers within 20 s.
Skipped without CUDA.

Run: python -m pytest tests/test_check_gpu.py -q -s -m gpu
"""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from sandbox import SandboxConfig, check

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELU_TASK = os.path.join(REPO, "tests", "fixtures", "sandbox", "relu_task.py")
SOFTMAX_TASK = textwrap.dedent("""
    import torch
    import torch.nn as nn
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
        def forward(self, x):
            return torch.softmax(x, dim=1)
    def get_inputs():
        return [torch.randn(ROWS, COLS)]
    def get_init_inputs():
        return []
""")
KERNELS = r"""
#include <cuda_runtime.h>
#include <math.h>
__device__ float block_reduce(float v, bool is_max) {  // blockDim.x = 256: 8 warps
    __shared__ float s[8];
    for (int o = 16; o; o >>= 1) { float w = __shfl_xor_sync(0xffffffff, v, o); v = is_max ? fmaxf(v, w) : v + w; }
    if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
    __syncthreads();
    v = s[0];
    for (int i = 1; i < 8; ++i) v = is_max ? fmaxf(v, s[i]) : v + s[i];
    __syncthreads();
    return v;
}
__global__ void softmax_k(const float* x, float* y, int cols) {  // one block per row
    const float* r = x + (long)blockIdx.x * cols;
    float* o = y + (long)blockIdx.x * cols;
    float m = -INFINITY, s = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, r[j]);
    m = block_reduce(m, true);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += expf(r[j] - m);
    s = block_reduce(s, false);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = expf(r[j] - m) / s;
}
__global__ void relu_k(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
extern "C" void softmax(const float* x, float* y, int rows, int cols, void* s) {
    softmax_k<<<rows, 256, 0, (cudaStream_t)s>>>(x, y, cols);
}
extern "C" void relu(const float* x, float* y, long n, void* s) {
    relu_k<<<(n + 255) / 256, 256, 0, (cudaStream_t)s>>>(x, y, n);
}
"""
MODEL_NEW = """
import ctypes
import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream
lib = load_kernel("k")
lib.softmax.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
lib.relu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
    def forward(self, x):
        y = torch.empty_like(x)
        {call}
        return y
"""


def workspace(root, call: str) -> str:
    d = root / "ws"
    (d / "kernels").mkdir(parents=True)
    (d / "kernels" / "k.cu").write_text(KERNELS)
    (d / "model_new.py").write_text(MODEL_NEW.format(call=call))
    return d


def test_a_one_gib_output_passes_at_the_default_limits(tmp_path):
    """A softmax over 16384 x 16384 fp32 (input and output 1 GiB each) at every default but the cache dir: the
    driver, the baselines and the candidate keep their tensors on the GPU, so host memory stays far below
    the 8 GiB limit."""
    task = tmp_path / "softmax_task.py"
    task.write_text(SOFTMAX_TASK.replace("ROWS", "16384").replace("COLS", "16384"))
    sol = workspace(tmp_path, "lib.softmax(ptr(x), ptr(y), x.shape[0], x.shape[1], stream())")
    t = time.perf_counter()
    v = check(task, sol, SandboxConfig(device="cuda", cache_dir=str(tmp_path / "cache")))
    print(f"1 GiB softmax: {time.perf_counter() - t:.1f} s",
          {k: v.to_dict()[k] for k in ("correct", "error", "eager_ms", "compile_ms", "candidate_ms")},
          {k: v.timings.get(k) for k in ("prepare_s", "driver_s", "candidate_s")})
    assert v.compiled and v.correct and v.candidate_ms > 0, v.to_dict()


def _cli_check(task: str, sol: os.PathLike, cache: str) -> tuple[float, dict]:
    env = {**os.environ, "CUDA_AGENT_CACHE": cache, "PYTHONUNBUFFERED": "1"}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "cuda_agent.py", "check", task, sol, "--sandbox.device", "cuda", "--json"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return wall, json.loads(p.stdout.strip().splitlines()[-1])


def test_a_one_off_check_on_a_warm_cache_answers_within_20_s(tmp_path):
    """`python cuda_agent.py check` as a user types it, twice on one cache: the first builds what is built once
    per machine (the dispatch guard, the bytecode cache) and times the baselines; the second must answer in
    20 s or less, interpreter start included."""
    sol = workspace(tmp_path, "lib.relu(ptr(x), ptr(y), x.numel(), stream())")
    cache = str(tmp_path / "cache")
    cold, v0 = _cli_check(RELU_TASK, sol, cache)
    warm, v = _cli_check(RELU_TASK, sol, cache)
    keys = ("prepare_s", "build_s", "driver_s", "candidate_s", "warm_child")
    print(f"one-off check: cold {cold:.1f} s {[v0.get('timings', {}).get(k) for k in keys]}; "
          f"warm {warm:.1f} s {dict((k, v.get('timings', {}).get(k)) for k in keys)}")
    assert v["correct"] and v["reward"] >= 1, v
    assert warm <= 20, (warm, v.get("timings"))
