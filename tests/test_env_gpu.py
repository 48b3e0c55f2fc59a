"""GPU: replay episodes with honest CUDA kernels through the real sandbox (compile, verify, profile) on the
device, two tasks at once: a fused elementwise op and a cuBLAS GEMM + bias + ReLU.

Run on the H200: python -m pytest -q tests/test_env_gpu.py -m gpu -s
"""
import shutil

import pytest

import sandbox
from env import EnvConfig, run_episodes
from policy import ReplayPolicy
from tasks import Task

ELEMENTWISE = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x) * 2.0 + 1.0


def get_inputs():
    return [torch.randn(4096, 4096)]


def get_init_inputs():
    return []
'''
LINEAR = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.relu(self.linear(x))


def get_inputs():
    return [torch.randn(2048, 1024)]


def get_init_inputs():
    return [1024, 2048]
'''
FUSED_CU = r'''#include <cuda_runtime.h>

__global__ void relu2p1_kernel(const float4* __restrict__ x, float4* __restrict__ y, long n4) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = x[i];
        v.x = fmaxf(v.x, 0.f) * 2.f + 1.f; v.y = fmaxf(v.y, 0.f) * 2.f + 1.f;
        v.z = fmaxf(v.z, 0.f) * 2.f + 1.f; v.w = fmaxf(v.w, 0.f) * 2.f + 1.f;
        y[i] = v;
    }
}

__global__ void relu2p1_tail(const float* __restrict__ x, float* __restrict__ y, long start, long n) {
    long i = start + (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(x[i], 0.f) * 2.f + 1.f;
}

extern "C" void relu2p1(const float* x, float* y, long n, void* stream) {
    cudaStream_t s = (cudaStream_t)stream;
    long n4 = n / 4;
    if (n4 > 0) relu2p1_kernel<<<(unsigned)((n4 + 255) / 256), 256, 0, s>>>((const float4*)x, (float4*)y, n4);
    if (n % 4) relu2p1_tail<<<1, 256, 0, s>>>(x, y, n4 * 4, n);
}
'''
FUSED_PY = '''import ctypes

import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("fused")
lib.relu2p1.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.relu2p1.restype = None


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        lib.relu2p1(ptr(x), ptr(y), x.numel(), stream())
        return y
'''
LINEAR_CU = r'''#include <cublas_v2.h>
#include <cuda_runtime.h>

static cublasHandle_t handle() {
    static cublasHandle_t h = nullptr;
    if (!h) cublasCreate(&h);
    return h;
}

__global__ void bias_relu_kernel(float* __restrict__ y, const float* __restrict__ b, long rows, long cols) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) y[i] = fmaxf(y[i] + b[i % cols], 0.f);
}

// y (M, N) = relu(x (M, K) @ w (N, K)^T + b (N)), all row-major fp32. cuBLAS is column-major, so it
// computes y^T = w @ x^T: op(A) = w read as a (K, N) column-major matrix, transposed.
extern "C" int linear_relu(const float* x, const float* w, const float* b, float* y, long M, long N, long K,
                           void* stream) {
    cublasHandle_t h = handle();
    cublasSetStream(h, (cudaStream_t)stream);
    const float alpha = 1.f, beta = 0.f;
    cublasStatus_t st = cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, w, (int)K, x,
                                    (int)K, &beta, y, (int)N);
    if (st != CUBLAS_STATUS_SUCCESS) return (int)st;
    long total = M * N;
    bias_relu_kernel<<<(unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream>>>(y, b, M, N);
    return (int)cudaGetLastError();
}
'''
LINEAR_PY = '''import ctypes

import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("linear_relu")
lib.linear_relu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_void_p]
lib.linear_relu.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)   # parameters only: same state_dict as Model

    def forward(self, x):
        x = x.contiguous()
        w, b = self.linear.weight, self.linear.bias
        y = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        rc = lib.linear_relu(ptr(x), ptr(w), ptr(b), ptr(y), x.shape[0], w.shape[0], x.shape[1], stream())
        assert rc == 0, f"linear_relu failed with status {rc}"
        return y
'''


def _script(name, cu, py):
    w = lambda p, c: {"name": "write_file", "arguments": {"path": p, "content": c}}  # noqa: E731
    t = lambda *calls: {"content": "", "tool_calls": [{"function": c} for c in calls]}  # noqa: E731
    return [t(w(f"kernels/{name}.cu", cu), w("model_new.py", py)),
            t({"name": "compile", "arguments": {}}), t({"name": "verify", "arguments": {}}),
            t({"name": "profile", "arguments": {}}), t({"name": "finish", "arguments": {}})]


@pytest.mark.gpu
def test_gpu_replay_honest_cuda_kernels(tmp_path):
    cfg = sandbox.SandboxConfig(device="cuda", cache_dir=str(tmp_path / "cache"))
    pool = sandbox.SandboxPool(cfg, gpus=[0])
    pol = ReplayPolicy({0: _script("fused", FUSED_CU, FUSED_PY), 1: _script("linear_relu", LINEAR_CU, LINEAR_PY)})
    try:
        tasks = [Task(code=ELEMENTWISE, name="relu2p1"), Task(code=LINEAR, name="linear_relu")]
        trajs = run_episodes(pol, tasks, pool, EnvConfig(work_dir=str(tmp_path / "ws"), max_turns=10),
                             log=lambda e, k, s: print(f"[{e}] {k}: {s[:400]}"))
    finally:
        pool.close()
    for t in trajs:
        obs = [m["content"] for m in t.messages if m["role"] == "tool"]
        assert obs[2].startswith("compiled OK"), obs[2]
        assert "correct: True" in obs[3], obs[3]
        assert "reward this version would earn" in obs[4] and "torch.compile" in obs[4], obs[4]
        if shutil.which("ncu"):
            assert "ncu kernel summary" in obs[4], obs[4]
            print(obs[4][obs[4].index("ncu kernel summary"):][:1500])
        v = t.best_verdict
        assert t.stop_reason == "finish" and t.best_reward >= 1 and t.final_reward >= 1, v
        assert v["device"] != "cpu" and v["candidate_ms"] > 0 and v["eager_ms"] > 0 and v["compile_ms"] > 0
        print(f"{t.task}: eager {v['eager_ms']:.4f} ms, compile {v['compile_ms']:.4f} ms, "
              f"ours {v['candidate_ms']:.4f} ms, reward {t.best_reward} ({v['precision']}, {v['device']})")
