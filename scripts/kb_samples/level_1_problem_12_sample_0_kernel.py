# Honest demo solution (cuda-agent, our own code) for KernelBench level 1 problem 12
# (Matmul_with_diagonal_matrices_): C = diag(A) @ B = A[:, None] * B, one vectorised CUDA kernel.
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
#include <cstdint>
#include <cuda_runtime.h>

__global__ void diag_mul_vec4(const float* __restrict__ a, const float4* __restrict__ b, float4* __restrict__ c,
                              long rows, long m4) {
    long total = rows * m4, stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float s = a[i / m4];
        float4 v = b[i];
        v.x *= s; v.y *= s; v.z *= s; v.w *= s;
        c[i] = v;
    }
}

__global__ void diag_mul_scalar(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                                long rows, long m) {
    long total = rows * m, stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) c[i] = a[i / m] * b[i];
}

static unsigned grid_for(long n, int threads) {
    long b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 132L * 64 ? 132L * 64 : b));
}

extern "C" int diag_matmul(const float* a, const float* b, float* c, long rows, long m, cudaStream_t s) {
    bool vec = m % 4 == 0 && (uintptr_t)b % 16 == 0 && (uintptr_t)c % 16 == 0;
    if (vec) diag_mul_vec4<<<grid_for(rows * m / 4, 256), 256, 0, s>>>(a, (const float4*)b, (float4*)c, rows, m / 4);
    else diag_mul_scalar<<<grid_for(rows * m, 256), 256, 0, s>>>(a, b, c, rows, m);
    return (int)cudaGetLastError();
}
"""

lib = build(SRC)
lib.diag_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_void_p]
lib.diag_matmul.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        A, B = A.contiguous(), B.contiguous()
        assert A.dim() == 1 and B.dim() == 2 and B.shape[0] == A.shape[0], "expects A (N,), B (N, M)"
        C = torch.empty_like(B)
        rc = lib.diag_matmul(A.data_ptr(), B.data_ptr(), C.data_ptr(), B.shape[0], B.shape[1], stream_ptr())
        assert rc == 0, f"CUDA error {rc}"
        return C
