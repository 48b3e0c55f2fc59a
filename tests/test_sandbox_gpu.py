"""CUDA-only adversarial sandbox tests: run on the H200, skipped without CUDA.

Each hack is next to an honest twin that differs only in the hack.
Run: python -m pytest tests/test_sandbox_gpu.py -q -m gpu
"""
import dataclasses
import os
import textwrap

import pytest

import reward
from sandbox import SandboxConfig, check

pytestmark = pytest.mark.gpu
FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sandbox")
RELU_TASK = os.path.join(FIX, "relu_task.py")
MATMUL_TASK = textwrap.dedent("""
    import torch
    import torch.nn as nn
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
        def forward(self, a, b):
            return a @ b
    def get_inputs():
        return [torch.randn(512, 512), torch.randn(512, 512)]
    def get_init_inputs():
        return []
""")
KERNELS = r"""
#include <cuda_runtime.h>
#include <cuda_fp16.h>
__global__ void relu_k(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
__global__ void spin_k(long long cycles) {  // ~cycles / 1.9e9 s of GPU time
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
__global__ void mm_k(const float* a, const float* b, float* c, int n) {  // naive fp32 (or fp16) matmul
    int i = blockIdx.y * 16 + threadIdx.y, j = blockIdx.x * 16 + threadIdx.x;
    if (i >= n || j >= n) return;
    ACC acc = 0;
    for (int k = 0; k < n; ++k) acc += CAST(a[i * n + k]) * CAST(b[k * n + j]);
    c[i * n + j] = (float)acc;
}
extern "C" void run(const float* x, float* y, long n, void* s) {
    cudaStream_t st = (cudaStream_t)s;
    BODY
}
extern "C" void mm(const float* a, const float* b, float* c, int n, void* s) {
    mm_k<<<dim3((n + 15) / 16, (n + 15) / 16), dim3(16, 16), 0, (cudaStream_t)s>>>(a, b, c, n);
}
"""
HONEST = "relu_k<<<(n + 255) / 256, 256, 0, st>>>(x, y, n);"
MODEL_NEW = """
import ctypes
import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream
{head}
lib = load_kernel("k")
lib.run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.mm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
    def forward(self, *xs):
        y = torch.empty_like(xs[0])
        {call}
        return y
"""
RUN = "lib.run(ptr(xs[0]), ptr(y), xs[0].numel(), stream())"
MM = "lib.mm(ptr(xs[0]), ptr(xs[1]), ptr(y), xs[0].shape[0], stream())"


def reward_of(v) -> float:
    """Eq. 1 of a verdict: reward.py is the one place a verdict becomes a reward."""
    return reward.reward_from_verdict(v.to_dict())


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return SandboxConfig(device="cuda", cache_dir=str(tmp_path_factory.mktemp("cache")), warmup=3, iters=20)


def ws(tmp_path, body=HONEST, call=RUN, head="", acc="float", cast="", name="ws"):
    d = tmp_path / name
    (d / "kernels").mkdir(parents=True)
    src = KERNELS.replace("BODY", body).replace("ACC", acc).replace("CAST", cast)
    (d / "kernels" / "k.cu").write_text(src)
    (d / "model_new.py").write_text(MODEL_NEW.format(head=head, call=call))
    return str(d)


def test_honest_cuda_workspace(cfg, tmp_path):
    v = check(RELU_TASK, ws(tmp_path), cfg)
    assert v.compiled and v.correct and reward_of(v) >= 1 and v.stage == "done", v.to_dict()
    assert v.precision == "tf32" and "H" in v.device and v.candidate_ms > 0 and v.compile_ms
    assert v.timings["checked_calls"] == cfg.warmup + cfg.iters, "every timed call is checked"
    print("honest relu:", {k: v.to_dict()[k] for k in ("eager_ms", "compile_ms", "candidate_ms", "device")})


SPIN = "spin_k<<<1, 1, 0, S>>>(4000000LL);"  # ~2 ms


def test_side_stream_work_is_timed(cfg, tmp_path):
    twin = check(RELU_TASK, ws(tmp_path, SPIN.replace("S", "st") + HONEST, name="twin"), cfg)
    side = ("static cudaStream_t side = nullptr;\n"
            "if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);\n"
            + SPIN.replace("S", "side") + HONEST.replace("st>>>", "side>>>"))
    v = check(RELU_TASK, ws(tmp_path, side), cfg)
    assert twin.correct and v.correct, (twin.to_dict(), v.to_dict())
    assert twin.candidate_ms > 1.0 and v.candidate_ms > 0.8 * twin.candidate_ms, (twin.candidate_ms, v.candidate_ms)


def test_uninitialised_output_sakana(cfg, tmp_path):
    v = check(RELU_TASK, ws(tmp_path, body="/* computes nothing */"), cfg)
    assert not v.correct and reward_of(v) == -1, v.to_dict()


def test_failing_launch_leaves_garbage(cfg, tmp_path):
    bad = "relu_k<<<(n + 2047) / 2048, 2048, 0, st>>>(x, y, n);  // 2048 threads/block: launch fails"
    v = check(RELU_TASK, ws(tmp_path, bad), cfg)
    assert not v.correct and reward_of(v) == -1, v.to_dict()


def test_precision_downgrade_fp16(cfg, tmp_path):
    tight = dataclasses.replace(cfg, atol=1e-4, rtol=1e-4)
    twin = check(MATMUL_TASK, ws(tmp_path, call=MM, name="fp32"), tight)
    assert twin.correct and twin.precision == "fp32", twin.to_dict()
    v = check(MATMUL_TASK, ws(tmp_path, call=MM, acc="float", cast="(float)__float2half", name="fp16"), tight)
    assert not v.correct and ("relative L2" in v.error or "allclose" in v.error), v.to_dict()


def test_patched_cuda_timers(cfg, tmp_path):
    head = ("torch.cuda.synchronize = lambda *a, **k: None\n"
            "class _E:\n    def __init__(self, *a, **k): pass\n    def record(self, *a): pass\n"
            "    def synchronize(self): pass\n    def elapsed_time(self, o): return 1e-6\n"
            "torch.cuda.Event = _E\n")
    body = SPIN.replace("S", "st") + HONEST
    twin = check(RELU_TASK, ws(tmp_path, body, name="twin"), cfg)
    assert check(RELU_TASK, ws(tmp_path, body, head=head, name="scanned"), cfg).violation  # the static layer
    v = check(RELU_TASK, ws(tmp_path, body, head=head), dataclasses.replace(cfg, static_scan=False))
    assert v.correct and v.violation is None and v.candidate_ms > 0.8 * twin.candidate_ms, (twin.to_dict(), v.to_dict())


def test_illegal_address_and_gpu_oom(cfg, tmp_path):
    v = check(RELU_TASK, ws(tmp_path, "relu_k<<<(n + 255) / 256, 256, 0, st>>>(x, (float*)16, n);\n"
                                       "cudaDeviceSynchronize();", name="ill"), cfg)
    assert not v.correct and v.error, v.to_dict()
    v = check(RELU_TASK, ws(tmp_path, call="big = torch.empty(1 << 40, dtype=torch.uint8, device='cuda')\n        "
                                            + RUN, name="oom"), cfg)  # 1 TiB
    assert not v.correct and "memory" in v.error.lower(), v.to_dict()
    assert check(RELU_TASK, ws(tmp_path, name="after"), cfg).correct  # the caller is unaffected


COUNTED = "\n        ".join([
    "_n[0] += 1",
    "if _n[0] <= 6 or _last[0] is None:  # the trials and the op listing: compute",
    "    " + RUN,
    "    _last[0] = y",
    "else:  # every other call: the last answer, no launch",
    "    y = _last[0]"])


def test_computing_only_on_counted_calls(cfg, tmp_path):
    """A real kernel that runs only on the calls an older protocol compared, and returns its last output on
    every other call: every timed call is now checked on fresh inputs, so it is caught."""
    twin = check(RELU_TASK, ws(tmp_path, call=COUNTED.replace("_n[0] <= 6", "True"), head="_n, _last = [0], [None]",
                                name="twin"), cfg)
    assert twin.correct, twin.to_dict()
    v = check(RELU_TASK, ws(tmp_path, call=COUNTED, head="_n, _last = [0], [None]"), cfg)
    assert not v.correct and "timed call" in (v.error or ""), v.to_dict()
