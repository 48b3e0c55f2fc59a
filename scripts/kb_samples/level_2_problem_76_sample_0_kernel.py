# Honest demo solution (cuda-agent, our own code) for KernelBench level 2 problem 76 (Gemm_Add_ReLU):
# cuBLAS SGEMM (allowed for GEMM by the paper's rules) plus one fused bias-add + ReLU epilogue kernel.
import ctypes
import os
import shutil
import subprocess
import tempfile

import torch
import torch.nn as nn


def build(src: str, libs: tuple = ()) -> ctypes.CDLL:
    """nvcc -> shared object -> ctypes: a few seconds, no torch headers (our own code, not load_inline)."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    major, minor = torch.cuda.get_device_capability()
    d = tempfile.mkdtemp(prefix="kb_demo_")
    cu, so = os.path.join(d, "k.cu"), os.path.join(d, "k.so")
    with open(cu, "w") as f:
        f.write(src)
    cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",
           "-o", so, cu, *libs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("nvcc failed: " + r.stderr[-2000:])
    return ctypes.CDLL(so)


def stream_ptr() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

SRC = r"""
#include <cublas_v2.h>
#include <cuda_runtime.h>

static cublasHandle_t handle = nullptr;

// y[i, j] = relu(y[i, j] + bias[j]) / divisor, in place on the GEMM output
__global__ void bias_relu_div(float* __restrict__ y, const float* __restrict__ bias, long m, long n, float divisor) {
    long total = m * n, stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float v = y[i] + bias[i % n];
        y[i] = (v > 0.0f ? v : 0.0f) / divisor;
    }
}

// x (m, k) row-major, w (n, k) row-major (nn.Linear weight): y (m, n) = x @ w^T.
// Column-major view: y^T (n, m) = w (n, k) . x^T (k, m)  ->  Sgemm(T, N, n, m, k, w, ld k, x, ld k, y, ld n).
extern "C" int linear_bias_relu(const float* x, const float* w, const float* bias, float* y, int m, int n, int k,
                                float divisor, int tf32, cudaStream_t s) {
    if (handle == nullptr && cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return -1;
    cublasSetStream(handle, s);
    cublasSetMathMode(handle, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH);
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, k, x, k, &zero, y, n);
    if (st != CUBLAS_STATUS_SUCCESS) return 1000 + (int)st;
    long total = (long)m * n, blocks = (total + 255) / 256;
    bias_relu_div<<<(unsigned)(blocks > 132L * 64 ? 132L * 64 : blocks), 256, 0, s>>>(y, bias, m, n, divisor);
    return (int)cudaGetLastError();
}
"""

lib = build(SRC, libs=("-lcublas",))
lib.linear_bias_relu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_float, ctypes.c_int,
                                                                           ctypes.c_void_p]
lib.linear_bias_relu.restype = ctypes.c_int


def linear_bias_relu(x, w, bias, divisor: float):
    """relu(x @ w^T + bias) / divisor. TF32 in cuBLAS only when torch allows it for matmuls, i.e. exactly when
    the sandbox runs the baselines in TF32 too (precision fairness)."""
    x, w, bias = x.contiguous(), w.contiguous(), bias.contiguous()
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    tf32 = 1 if torch.backends.cuda.matmul.allow_tf32 else 0
    rc = lib.linear_bias_relu(x.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0],
                              x.shape[1], divisor, tf32, stream_ptr())
    assert rc == 0, f"CUDA/cuBLAS error {rc}"
    return y


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=False)   # parameters only
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        return linear_bias_relu(x, self.gemm.weight, self.bias, 1.0)
