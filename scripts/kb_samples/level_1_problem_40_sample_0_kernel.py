# Honest demo solution (cuda-agent, our own code) for KernelBench level 1 problem 40 (LayerNorm over the
# last three dims, with affine weight/bias): per-row partial sums (double accumulation) over many blocks, a
# per-row mean/rstd pass, then one vectorised normalise-and-affine pass.
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

// grid (chunks, rows): block (c, r) sums x[r, c*len : (c+1)*len] and its squares
__global__ void partial_sums(const float* __restrict__ x, double* __restrict__ part, long d, long len, int chunks) {
    int c = blockIdx.x, r = blockIdx.y;
    long lo = (long)c * len, hi = lo + len < d ? lo + len : d;
    const float* row = x + (long)r * d;
    double s = 0.0, ss = 0.0;
    for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        double v = row[i];
        s += v;
        ss += v * v;
    }
    __shared__ double sh_s[256], sh_ss[256];
    sh_s[threadIdx.x] = s;
    sh_ss[threadIdx.x] = ss;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) {
            sh_s[threadIdx.x] += sh_s[threadIdx.x + k];
            sh_ss[threadIdx.x] += sh_ss[threadIdx.x + k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        part[2 * ((long)r * chunks + c)] = sh_s[0];
        part[2 * ((long)r * chunks + c) + 1] = sh_ss[0];
    }
}

// grid (rows): reduce the chunks of one row to (mean, rstd)
__global__ void row_stats(const double* __restrict__ part, float* __restrict__ stats, long d, int chunks, float eps) {
    int r = blockIdx.x;
    double s = 0.0, ss = 0.0;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        s += part[2 * ((long)r * chunks + c)];
        ss += part[2 * ((long)r * chunks + c) + 1];
    }
    __shared__ double sh_s[256], sh_ss[256];
    sh_s[threadIdx.x] = s;
    sh_ss[threadIdx.x] = ss;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) {
            sh_s[threadIdx.x] += sh_s[threadIdx.x + k];
            sh_ss[threadIdx.x] += sh_ss[threadIdx.x + k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double mean = sh_s[0] / d, var = sh_ss[0] / d - mean * mean;
        stats[2 * r] = (float)mean;
        stats[2 * r + 1] = (float)(1.0 / sqrt((var > 0.0 ? var : 0.0) + (double)eps));
    }
}

__global__ void normalize_vec4(const float4* __restrict__ x, const float4* __restrict__ w, const float4* __restrict__ b,
                               const float* __restrict__ stats, float4* __restrict__ y, long rows, long d4) {
    long total = rows * d4, stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long r = i / d4, j = i % d4;
        float mean = stats[2 * r], rstd = stats[2 * r + 1];
        float4 v = x[i], wv = w[j], bv = b[j], o;
        o.x = (v.x - mean) * rstd * wv.x + bv.x;
        o.y = (v.y - mean) * rstd * wv.y + bv.y;
        o.z = (v.z - mean) * rstd * wv.z + bv.z;
        o.w = (v.w - mean) * rstd * wv.w + bv.w;
        y[i] = o;
    }
}

__global__ void normalize_scalar(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                                 const float* __restrict__ stats, float* __restrict__ y, long rows, long d) {
    long total = rows * d, stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        long r = i / d, j = i % d;
        y[i] = (x[i] - stats[2 * r]) * stats[2 * r + 1] * w[j] + b[j];
    }
}

static unsigned grid_for(long n, int threads) {
    long b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : (b > 132L * 64 ? 132L * 64 : b));
}

extern "C" int layernorm_forward(const float* x, const float* w, const float* b, float* y, double* part, float* stats,
                                 long rows, long d, int chunks, float eps, cudaStream_t s) {
    long len = (d + chunks - 1) / chunks;
    partial_sums<<<dim3(chunks, (unsigned)rows), 256, 0, s>>>(x, part, d, len, chunks);
    row_stats<<<(unsigned)rows, 256, 0, s>>>(part, stats, d, chunks, eps);
    bool vec = d % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)w % 16 == 0
               && (uintptr_t)b % 16 == 0;
    if (vec)
        normalize_vec4<<<grid_for(rows * d / 4, 256), 256, 0, s>>>((const float4*)x, (const float4*)w,
                                                                  (const float4*)b, stats, (float4*)y, rows, d / 4);
    else
        normalize_scalar<<<grid_for(rows * d, 256), 256, 0, s>>>(x, w, b, stats, y, rows, d);
    return (int)cudaGetLastError();
}
"""

lib = build(SRC)
lib.layernorm_forward.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                                          ctypes.c_float, ctypes.c_void_p]
lib.layernorm_forward.restype = ctypes.c_int
CHUNKS = 256  # blocks per row for the partial sums (KernelBench's shape has only 16 rows of 4M elements)


class ModelNew(nn.Module):
    def __init__(self, normalized_shape: tuple):
        super().__init__()
        self.ln = nn.LayerNorm(normalized_shape=normalized_shape)  # parameters only; forward never calls it

    def forward(self, x):
        x = x.contiguous()
        w, b = self.ln.weight.contiguous(), self.ln.bias.contiguous()
        d = w.numel()
        rows = x.numel() // d
        y = torch.empty_like(x)
        part = torch.empty((rows * CHUNKS * 2,), dtype=torch.float64, device=x.device)
        stats = torch.empty((rows * 2,), dtype=torch.float32, device=x.device)
        rc = lib.layernorm_forward(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), part.data_ptr(),
                                   stats.data_ptr(), rows, d, CHUNKS, self.ln.eps, stream_ptr())
        assert rc == 0, f"CUDA error {rc}"
        return y
