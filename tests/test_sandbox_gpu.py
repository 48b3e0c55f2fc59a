"""CUDA-only adversarial sandbox tests: run on the H200, skipped without CUDA.

Each hack is next to an honest twin that differs only in the hack.
Run: python -m pytest tests/test_sandbox_gpu.py -q -m gpu
"""
import dataclasses
import os
import pathlib
import textwrap

import pytest

import reward
from sandbox import SandboxConfig, check

pytestmark = pytest.mark.gpu
FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sandbox")
RELU_TASK = pathlib.Path(FIX, "relu_task.py")
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
    return SandboxConfig(device="cuda", cache_dir=str(tmp_path_factory.mktemp("cache")), warmup=3, iters=20,
                         warm_spares=2)  # a check at a time: two spares keep every check warm


def ws(tmp_path, body=HONEST, call=RUN, head="", acc="float", cast="", name="ws"):
    d = tmp_path / name
    (d / "kernels").mkdir(parents=True)
    src = KERNELS.replace("BODY", body).replace("ACC", acc).replace("CAST", cast)
    (d / "kernels" / "k.cu").write_text(src)
    (d / "model_new.py").write_text(MODEL_NEW.format(head=head, call=call))
    return d


def test_honest_cuda_workspace(cfg, tmp_path):
    v = check(RELU_TASK, ws(tmp_path), cfg)
    assert v.compiled and v.correct and reward_of(v) >= 1 and v.stage == "done", v.to_dict()
    assert v.precision == "tf32" and "H" in v.device and v.candidate_ms > 0 and v.compile_ms
    assert v.timings["checked_calls"] == cfg.warmup + cfg.iters, "every timed call is checked"
    assert v.timings["clocks"] == {"queued": cfg.iters}, v.timings  # every timed call's clock held GPU work only
    print("honest relu:", {k: v.to_dict()[k] for k in ("eager_ms", "compile_ms", "candidate_ms", "device")})


SPIN = "spin_k<<<1, 1, 0, S>>>(4000000LL);"  # ~2 ms


SIDE = ("static cudaStream_t side = nullptr; static cudaEvent_t a, b;\n"
        "if (!side) { cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);\n"
        "  cudaEventCreateWithFlags(&a, cudaEventDisableTiming); cudaEventCreateWithFlags(&b, cudaEventDisableTiming); }\n")
JOINED = ("cudaEventRecord(a, st); cudaStreamWaitEvent(side, a, 0);\n"  # the side stream behind the caller's ...
          + SPIN.replace("S", "side") + HONEST.replace("st>>>", "side>>>")
          + "cudaEventRecord(b, side); cudaStreamWaitEvent(st, b, 0);")  # ... and the caller behind it
UNJOINED = SPIN.replace("S", "side") + HONEST.replace("st>>>", "side>>>")  # launched at once, joined by no one


def test_side_stream_work_is_timed(cfg, tmp_path):
    """A side stream joined both ways is timed like the caller's stream; one joined by no one starts as soon as
    it is launched, before the driver wrote this call's inputs (a timed call is queued), so it computes on the
    previous call's inputs, or its output is copied before it exists: wrong, never fast."""
    twin = check(RELU_TASK, ws(tmp_path, SPIN.replace("S", "st") + HONEST, name="twin"), cfg)
    joined = check(RELU_TASK, ws(tmp_path, SIDE + JOINED, name="joined"), cfg)
    assert twin.correct and joined.correct, (twin.to_dict(), joined.to_dict())
    assert twin.candidate_ms > 1.0 and joined.candidate_ms > 0.8 * twin.candidate_ms, (twin.candidate_ms, joined.candidate_ms)
    v = check(RELU_TASK, ws(tmp_path, SIDE + UNJOINED), cfg)
    assert not v.correct or v.candidate_ms > 0.8 * twin.candidate_ms, (twin.candidate_ms, v.to_dict())


def test_a_forward_that_waits_on_the_gpu_is_timed_with_its_host_time(cfg, tmp_path):
    """A sync inside forward cannot return before the driver's go: each warm-up call and the first timed call
    fall back (after QUEUE_WAIT_S) to continuing the child after go, and the pairing's later calls go first."""
    v = check(RELU_TASK, ws(tmp_path, HONEST + "\ncudaStreamSynchronize(st);", name="sync"), cfg)
    assert v.correct, v.to_dict()
    assert v.timings["clocks"] == {"fallback": 1, "go-first": cfg.iters - 1}, v.timings


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


# ----------------------------------------------------------------------------- attacks from inside the process
# The candidate's process only computes (sandbox/harness/driver.py): inputs, clock and comparison are the driver's, in
# another process. Each attack below rewrites what its own process does; the verdict must not move.
FORGE_ALL = """
import gc, json, time
_dumps = json.dumps
def _forged(obj, *a, **k):  # every message the process sends, times divided by 1000 and errors erased
    if isinstance(obj, dict):
        obj = {kk: (vv / 1000 if isinstance(vv, float) else vv) for kk, vv in obj.items()}
        obj.update(error=None, violation=None)
    return _dumps(obj, *a, **k)
json.dumps = _forged
_t0 = time.perf_counter()
time.perf_counter = lambda: _t0  # a stopped clock
time.monotonic = lambda: _t0
torch.cuda.synchronize = lambda *a, **k: None
class _E:
    def __init__(self, *a, **k): pass
    def record(self, *a): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, o): return 1e-6
torch.cuda.Event = _E
for o in gc.get_objects():  # every harness object in reach: its methods replaced by no-ops
    if type(o).__module__ in ("wire", "share") and hasattr(o, "__dict__"):
        for name in ("wait_flag", "write_flag", "reset_l2"):
            if hasattr(o, name):
                setattr(o, name, lambda *a, **k: None)
"""


def test_a_process_that_rewrites_its_timers_messages_and_harness_gains_nothing(cfg, tmp_path):
    body = SPIN.replace("S", "st") + HONEST
    twin = check(RELU_TASK, ws(tmp_path, body, name="twin"), cfg)
    forged = dataclasses.replace(cfg, static_scan=False)
    v = check(RELU_TASK, ws(tmp_path, body, head=FORGE_ALL, name="forged"), forged)
    assert twin.correct and twin.candidate_ms > 1.0, twin.to_dict()
    if v.correct:
        assert v.candidate_ms > 0.8 * twin.candidate_ms and reward_of(v) <= reward_of(twin), (twin.to_dict(), v.to_dict())
    nothing = check(RELU_TASK, ws(tmp_path, "/* nothing */", head=FORGE_ALL, name="nothing"), forged)
    assert not nothing.correct and reward_of(nothing) == -1, nothing.to_dict()


NATIVE_FORGE = r"""
#include <dlfcn.h>
static const char* PY = "import json\n_d = json.dumps\njson.dumps = lambda o, *a, **k: _d({kk: (vv / 1000 if isinstance(vv, float) else vv) for kk, vv in o.items()} if isinstance(o, dict) else o, *a, **k)\n";
__attribute__((constructor)) static void forge() {  // Python run through the C API when the library loads
    typedef int (*ensure_t)(); typedef void (*release_t)(int); typedef int (*run_t)(const char*);
    ensure_t ensure = (ensure_t)dlsym(RTLD_DEFAULT, "PyGILState_Ensure");
    release_t release = (release_t)dlsym(RTLD_DEFAULT, "PyGILState_Release");
    run_t run = (run_t)dlsym(RTLD_DEFAULT, "PyRun_SimpleString");
    if (!ensure || !release || !run) return;
    int g = ensure(); run(PY); release(g);
}
"""


def test_times_forged_from_native_code_on_the_gpu_do_not_enter_the_verdict(cfg, tmp_path):
    body = SPIN.replace("S", "st") + HONEST
    twin = check(RELU_TASK, ws(tmp_path, body, name="twin"), cfg)
    d = ws(tmp_path, body, name="native")
    k = os.path.join(d, "kernels", "k.cu")
    with open(k) as f:
        src = f.read()
    with open(k, "w") as f:
        f.write(NATIVE_FORGE + src)
    v = check(RELU_TASK, d, cfg)
    assert twin.correct and v.compiled, (twin.to_dict(), v.to_dict())
    if v.correct:
        assert v.candidate_ms > 0.8 * twin.candidate_ms, (twin.candidate_ms, v.candidate_ms)


HOOK_CUDA = """
STASH = []
class Hook(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("randn", "rand", "normal_") and isinstance(out, torch.Tensor) \\
                and out.is_cuda and out.dim() == 2:  # the harness building an input: answer it now
            y = torch.empty_like(out)
            lib.run(ptr(out), ptr(y), out.numel(), stream())
            STASH.append(y)
        return out
Hook().__enter__()
"""
STASHED = "y = STASH.pop() if STASH else y\n        if not STASH:\n            " + RUN


def test_work_hidden_in_the_harness_building_inputs_gains_nothing_on_the_gpu(cfg, tmp_path):
    body = SPIN.replace("S", "st") + HONEST
    twin = check(RELU_TASK, ws(tmp_path, body, name="twin"), cfg)
    v = check(RELU_TASK, ws(tmp_path, body, head=HOOK_CUDA, call=STASHED, name="hook"),
              dataclasses.replace(cfg, static_scan=False))
    assert twin.correct, twin.to_dict()
    if v.correct:
        assert v.candidate_ms > 0.8 * twin.candidate_ms, (twin.candidate_ms, v.candidate_ms)


FIND_SHARED = """
import gc
def shared():  # the harness's view of the driver's regions, found in the process's own heap
    return next(o for o in gc.get_objects() if type(o).__name__ == "_Shared")
"""
LATE_WRITE = ("static cudaStream_t side = nullptr;\n"
              "if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);\n"
              "spin_k<<<1, 1, 0, side>>>(4000000LL);\n"
              "relu_k<<<(n + 255) / 256, 256, 0, side>>>(x, y, n);")
LATE_CALL = "sh = shared()\n        lib.run(ptr(xs[0]), ptr(sh.outs[0]), xs[0].numel(), stream())"


def test_output_written_after_the_call_said_done_fails(cfg, tmp_path):
    """A side stream that writes the driver's output region ~2 ms after forward returned (the harness's copy
    of forward's own, unwritten result went first): the clock stopped at "done", but the driver compares
    only after re-reading a random sample of the output, so late work is either missing or seen to change."""
    v = check(RELU_TASK, ws(tmp_path, LATE_WRITE, head=FIND_SHARED, call=LATE_CALL, name="late"),
              dataclasses.replace(cfg, static_scan=False))
    assert not v.correct and reward_of(v) == -1, v.to_dict()


EARLY_DONE = """
import gc
def raise_done():  # the driver's done flag raised, for this call and every later one, before any work is queued
    sh = next(o for o in gc.get_objects() if type(o).__name__ == "_Shared")
    sh.ops.write_flag(stream().value, sh.flags + 4, 0x7FFFFFFF)
    sh.ops.write_flag(stream().value, sh.flags, 0x7FFFFFFF)  # and the go flag: the next pairing's child would not wait
"""


def test_a_done_flag_raised_early_does_not_shorten_the_time(cfg, tmp_path):
    body = SPIN.replace("S", "st") + HONEST
    twin = check(RELU_TASK, ws(tmp_path, body, name="twin"), cfg)
    v = check(RELU_TASK, ws(tmp_path, body, head=EARLY_DONE, call="raise_done()\n        " + RUN, name="early"),
              dataclasses.replace(cfg, static_scan=False))
    assert twin.correct, twin.to_dict()
    if v.correct:
        assert v.candidate_ms > 0.8 * twin.candidate_ms, (twin.candidate_ms, v.candidate_ms)
    after = check(RELU_TASK, ws(tmp_path, body, name="after"), cfg)  # the same driver, flags poisoned before
    assert after.correct and after.candidate_ms > 0.8 * twin.candidate_ms, after.to_dict()


# L2 persistence (an access-policy window with hitProp = persisting keeps the weights in L2 across the driver's
# flush): a probe kernel times one pass over the weights with the candidate's own events and prints it; the
# same probe in a plain process, flushed and with the window, is the positive control that shows the attack.
L2_TASK = textwrap.dedent("""
    import torch
    import torch.nn as nn
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4 << 20))
        def forward(self, x):
            return x * self.w
    def get_inputs():
        return [torch.randn(4 << 20)]
    def get_init_inputs():
        return []
""")
L2_CU = r"""
#include <cuda_runtime.h>
__global__ void mul_k(const float* x, const float* w, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * w[i];
}
__global__ void probe_k(const float4* w, long n4, float* sink) {  // one pass over w
    float acc = 0.f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x) {
        float4 v = w[i]; acc += v.x + v.y + v.z + v.w;
    }
    if (acc == 1234.5f) *sink = acc;
}
__global__ void flush_k(float* buf, long n, float v) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) buf[i] = v;
}
extern "C" int persist(const float* w, long bytes, void* s) {  // the attack: w's lines persist in L2
    int dev = 0, maxp = 0; cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&maxp, cudaDevAttrMaxPersistingL2CacheSize, dev);
    cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, maxp);
    cudaStreamAttrValue a = {};
    a.accessPolicyWindow.base_ptr = (void*)w;
    a.accessPolicyWindow.num_bytes = bytes;
    a.accessPolicyWindow.hitRatio = bytes > maxp ? (float)maxp / bytes : 1.f;
    a.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    a.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
    return (int)cudaStreamSetAttribute((cudaStream_t)s, cudaStreamAttributeAccessPolicyWindow, &a);
}
extern "C" float probe(const float* w, long n, float* sink, void* s) {  // ms of one pass over w, own events
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    cudaEventRecord(e0, (cudaStream_t)s);
    probe_k<<<528, 256, 0, (cudaStream_t)s>>>((const float4*)w, n / 4, sink);
    cudaEventRecord(e1, (cudaStream_t)s);
    cudaEventSynchronize(e1);
    float ms = 0.f; cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    return ms;
}
extern "C" void mul(const float* x, const float* w, float* y, long n, void* s) {
    mul_k<<<(n + 255) / 256, 256, 0, (cudaStream_t)s>>>(x, w, y, n);
}
extern "C" void flush(float* buf, long n, float v, void* s) { flush_k<<<528, 256, 0, (cudaStream_t)s>>>(buf, n, v); }
"""
L2_MODEL_NEW = """
import ctypes, sys
import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream
lib = load_kernel("k")
lib.persist.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.probe.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
lib.probe.restype = ctypes.c_float
lib.mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4 << 20))
        self.sink, self.calls = None, 0
    def forward(self, x):
        if self.sink is None:
            self.sink = torch.empty(1, device=x.device)
            if PERSIST:
                assert lib.persist(ptr(self.w), self.w.numel() * 4, stream()) == 0
        ms = lib.probe(ptr(self.w), self.w.numel(), ptr(self.sink), stream())
        self.calls += 1
        if self.calls > 8:
            print(f"probe {ms:.5f}", file=sys.stderr, flush=True)
        y = torch.empty_like(x)
        lib.mul(ptr(x), ptr(self.w), ptr(y), x.numel(), stream())
        return y
"""
L2_CONTROL = """
import ctypes, statistics, sys
import torch
lib = ctypes.CDLL(sys.argv[1])
lib.persist.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.probe.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
lib.probe.restype = ctypes.c_float
lib.flush.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_void_p]
w, sink = torch.randn(4 << 20, device="cuda"), torch.empty(1, device="cuda")
buf = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, device="cuda")
s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
def run(n=40):
    out = []
    for i in range(n):
        lib.flush(buf.data_ptr(), buf.numel(), float(i), s)  # 2 x L2 of normal writes between passes
        out.append(lib.probe(w.data_ptr(), w.numel(), sink.data_ptr(), s))
    return statistics.median(out[5:])
plain = run()
assert lib.persist(w.data_ptr(), w.numel() * 4, s) == 0
print(plain, run())
"""


def _medians(log: str) -> float:
    import statistics
    vals = [float(ln.split()[1]) for ln in log.splitlines() if ln.startswith("probe ")]
    assert len(vals) >= 5, log[-500:]
    return statistics.median(vals)


def test_l2_persistence_does_not_survive_into_a_timed_call(cfg, tmp_path):
    import subprocess
    import sys
    d = tmp_path / "l2"
    (d / "kernels").mkdir(parents=True)
    (d / "kernels" / "k.cu").write_text(L2_CU)
    so = tmp_path / "k_control.so"
    subprocess.run(["nvcc", "-O2", "-shared", "-Xcompiler", "-fPIC", "-o", str(so), str(d / "kernels" / "k.cu")],
                   check=True)
    out = subprocess.run([sys.executable, "-c", L2_CONTROL, str(so)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plain_ms, persist_ms = map(float, out.stdout.split()[-2:])
    print(f"control (a plain process, L2 flushed between passes): {plain_ms:.5f} ms, persisting {persist_ms:.5f} ms")
    runs = {}
    for persist in (False, True):
        (d / "model_new.py").write_text(L2_MODEL_NEW.replace("PERSIST", str(persist)))
        v = check(L2_TASK, str(d), dataclasses.replace(cfg, static_scan=False))
        assert v.correct, v.to_dict()
        runs[persist] = _medians(v.timings["log"])
    print(f"in the sandbox: plain {runs[False]:.5f} ms, persisting {runs[True]:.5f} ms")
    if persist_ms > 0.85 * plain_ms:
        pytest.skip(f"the control shows no persistence gain on this GPU ({plain_ms:.4f} vs {persist_ms:.4f} ms)")
    assert runs[True] > 0.9 * runs[False], runs  # the gain the control shows is gone
