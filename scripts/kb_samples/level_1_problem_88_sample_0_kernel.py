# Honest demo solution (cuda-agent, our own code) for KernelBench level 1 problem 88 (MinGPTNewGelu):
# y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) fused into one vectorised elementwise CUDA kernel.
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

__device__ __forceinline__ float gelu(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

__global__ void gelu_vec4(const float4* __restrict__ x, float4* __restrict__ y, long n4) {
    long stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        float4 v = x[i];
        v.x = gelu(v.x); v.y = gelu(v.y); v.z = gelu(v.z); v.w = gelu(v.w);
        y[i] = v;
    }
}

__global__ void gelu_scalar(const float* __restrict__ x, float* __restrict__ y, long start, long n) {
    long stride = (long)gridDim.x * blockDim.x;
    for (long i = start + (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = gelu(x[i]);
}

static unsigned grid_for(long n, int threads) {
    long b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 132L * 64 ? 132L * 64 : b));
}

extern "C" int gelu_forward(const float* x, float* y, long n, cudaStream_t s) {
    bool aligned = ((uintptr_t)x % 16 == 0) && ((uintptr_t)y % 16 == 0);
    long n4 = aligned ? n / 4 : 0;
    if (n4 > 0) gelu_vec4<<<grid_for(n4, 256), 256, 0, s>>>((const float4*)x, (float4*)y, n4);
    if (n4 * 4 < n) gelu_scalar<<<grid_for(n - n4 * 4, 256), 256, 0, s>>>(x, y, n4 * 4, n);
    return (int)cudaGetLastError();
}
"""

lib = build(SRC)
lib.gelu_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.gelu_forward.restype = ctypes.c_int


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        rc = lib.gelu_forward(x.data_ptr(), y.data_ptr(), x.numel(), stream_ptr())
        assert rc == 0, f"CUDA error {rc}"
        return y
