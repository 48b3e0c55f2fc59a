"""Sandbox benchmark: rebuild time after a one-kernel edit vs load_inline, checks per minute with
cached baselines, and the spread (coefficient of variation) of repeated timings of one kernel.

GPU (H200): python scripts/bench_sandbox.py --device cuda --out $OUT/bench_sandbox.json
CPU smoke:  python scripts/bench_sandbox.py --device cpu --edits 3 --checks 3 --repeats 3 --skip-load-inline

`--form a` checks a single-file solution instead of the workspace: the same ReLU (float4 on cuda) built by
`load_inline` and called through its pybind11 module, which allocates and launches in C++ as eager's
torch.relu does (the workspace form allocates in Python and launches through ctypes). The first check builds
it; later checks find the build cached (the source does not change).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402

TASK = textwrap.dedent("""
    import torch
    import torch.nn as nn
    class Model(nn.Module):  # KernelBench level 1 sized elementwise op
        def __init__(self):
            super().__init__()
        def forward(self, x):
            return torch.relu(x)
    def get_inputs():
        return [torch.randn({rows}, {cols})]
    def get_init_inputs():
        return []
""")
HEAVY_TASK = textwrap.dedent("""
    import torch
    import torch.nn as nn
    class Model(nn.Module):  # compute-bound: 128 sines per element (a >= 1 ms kernel, for timing spread)
        def __init__(self):
            super().__init__()
        def forward(self, x):
            for _ in range(128):
                x = torch.sin(x)
            return x
    def get_inputs():
        return [torch.randn({rows}, {cols})]
    def get_init_inputs():
        return []
""")
HEAVY_CU = r"""
__global__ void relu_k(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; for (int k = 0; k < 128; ++k) v = sinf(v); y[i] = v; }
}
extern "C" void relu_forward(const float* x, float* y, long n, void* s) {
    relu_k<<<(n + 255) / 256, 256, 0, (cudaStream_t)s>>>(x, y, n);
}
"""
CU = r"""
__global__ void relu_k(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
extern "C" void relu_forward(const float* x, float* y, long n, void* s) {
    relu_k<<<(n + 255) / 256, 256, 0, (cudaStream_t)s>>>(x, y, n);
}
"""
VEC_CU = r"""
__global__ void relu_k(const float4* x, float4* y, long n4) {  // four floats per thread, 16-byte loads
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = x[i];
        v.x = v.x > 0.f ? v.x : 0.f; v.y = v.y > 0.f ? v.y : 0.f;
        v.z = v.z > 0.f ? v.z : 0.f; v.w = v.w > 0.f ? v.w : 0.f;
        y[i] = v;
    }
}
__global__ void tail_k(const float* x, float* y, long a, long n) {
    long i = a + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
extern "C" void relu_forward(const float* x, float* y, long n, void* s) {
    long n4 = n / 4;
    if (n4) relu_k<<<(n4 + 255) / 256, 256, 0, (cudaStream_t)s>>>((const float4*)x, (float4*)y, n4);
    if (n % 4) tail_k<<<1, 4, 0, (cudaStream_t)s>>>(x, y, 4 * n4, n);
}
"""
CPP = r"""
extern "C" void relu_forward(const float* x, float* y, long n, void* s) {
#pragma omp parallel for
    for (long i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
"""
MODEL_NEW = textwrap.dedent("""
    import ctypes
    import torch
    import torch.nn as nn
    from sandbox_worker import load_kernel, ptr, stream
    lib = load_kernel("relu")
    lib.relu_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
        def forward(self, x):
            y = torch.empty_like(x)
            lib.relu_forward(ptr(x), ptr(y), x.numel(), stream())
            return y
""")
LOAD_INLINE = """import time
from torch.utils.cpp_extension import load_inline
t = time.perf_counter()
{call}
print(time.perf_counter() - t)
"""
CU_BIND = CU.replace('extern "C" void relu_forward(const float* x, float* y, long n, void* s) {\n    relu_k<<<(n + 255) / 256, 256, 0, (cudaStream_t)s>>>(x, y, n);',
                     '#include <torch/extension.h>\nvoid relu_forward(torch::Tensor x, torch::Tensor y) {\n    long n = x.numel();\n    relu_k<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);')
CPP_BIND = ('#include <torch/extension.h>\nvoid relu_forward(torch::Tensor x, torch::Tensor y) {\n'
            '    float* a = x.data_ptr<float>(); float* b = y.data_ptr<float>(); long n = x.numel();\n'
            '#pragma omp parallel for\n    for (long i = 0; i < n; ++i) b[i] = a[i] > 0.f ? a[i] : 0.f;\n}\n')


INLINE_CU = VEC_CU.split('extern "C"')[0] + r"""
torch::Tensor relu_forward(torch::Tensor x) {
    auto y = torch::empty_like(x);
    const long n = x.numel(), n4 = n / 4;
    const float* a = x.data_ptr<float>();
    float* b = y.data_ptr<float>();
    if (n4) relu_k<<<(n4 + 255) / 256, 256>>>((const float4*)a, (float4*)b, n4);
    if (n % 4) tail_k<<<1, 4>>>(a, b, 4 * n4, n);
    return y;
}
"""
INLINE_CPP = r"""
torch::Tensor relu_forward(torch::Tensor x) {
    auto y = torch::empty_like(x);
    const float* a = x.data_ptr<float>();
    float* b = y.data_ptr<float>();
    const long n = x.numel();
#pragma omp parallel for
    for (long i = 0; i < n; ++i) b[i] = a[i] > 0.f ? a[i] : 0.f;
    return y;
}
"""
INLINE_SOLUTION = """import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = {src!r}
ext = load_inline(name="bench_relu_form_a", {sources}, functions=["relu_forward"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu_forward(x.contiguous())
"""


def inline_solution(device: str) -> str:
    """Form (a): the ReLU as one file that builds itself with load_inline (float4 kernel on cuda)."""
    decl = "torch::Tensor relu_forward(torch::Tensor x);"
    if device == "cuda":
        return INLINE_SOLUTION.format(src="#include <torch/extension.h>\n" + INLINE_CU,
                                      sources=f"cpp_sources={decl!r}, cuda_sources=SRC")
    return INLINE_SOLUTION.format(src="#include <torch/extension.h>\n" + INLINE_CPP,
                                  sources="cpp_sources=SRC, extra_cflags=['-O3', '-fopenmp']")


def make_ws(root: str, device: str, kernel: str = "relu") -> str:
    ws = os.path.join(root, "ws")
    os.makedirs(os.path.join(ws, "kernels"))
    ext = ".cu" if device == "cuda" else ".cpp"
    for name in ("relu", "other"):  # two kernels: an edit to one must rebuild only that one
        with open(os.path.join(ws, "kernels", name + ext), "w") as f:
            src = CPP if device == "cpu" else {"heavy": HEAVY_CU, "relu_vec": VEC_CU}.get(kernel, CU)
            f.write(src.replace("relu_forward", f"{name}_forward"))
    with open(os.path.join(ws, "model_new.py"), "w") as f:
        f.write(MODEL_NEW)
    return ws


def bench_rebuild(ws: str, cfg, edits: int) -> list[float]:
    ext = ".cu" if cfg.device == "cuda" else ".cpp"
    path = os.path.join(ws, "kernels", "relu" + ext)
    sandbox.compile_workspace(ws, cfg)  # warm: both kernels cached
    times = []
    for i in range(edits):
        with open(path, "a") as f:
            f.write(f"\n// edit {i} {time.time_ns()}\n")
        t = time.perf_counter()
        ok, log, _ = sandbox.compile_workspace(ws, cfg)
        times.append(time.perf_counter() - t)
        assert ok, log
    return times


def bench_load_inline(device: str) -> float | None:
    """Seconds for torch's load_inline to build the same kernel (torch headers), in a fresh ext dir."""
    if device == "cuda":
        call = ("load_inline(name='bench_relu', cpp_sources='void relu_forward(torch::Tensor x, torch::Tensor y);',"
                " cuda_sources=SRC, functions=['relu_forward'])")
        src = CU_BIND
    else:
        call = "load_inline(name='bench_relu', cpp_sources=SRC, functions=['relu_forward'], extra_cflags=['-O3', '-fopenmp'])"
        src = CPP_BIND
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": d}
        r = subprocess.run([sys.executable, "-c", f"SRC = {src!r}\n" + LOAD_INLINE.format(call=call)],
                           capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        print("load_inline failed:", r.stderr[-2000:], file=sys.stderr)
        return None
    return float(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--edits", type=int, default=7, help="one-kernel edits to time (median)")
    p.add_argument("--checks", type=int, default=10, help="checks for the checks/minute number")
    p.add_argument("--repeats", type=int, default=10, help="repeated checks for the timing spread")
    p.add_argument("--iters", type=int, default=100, help="timed iterations per check")
    p.add_argument("--skip-load-inline", action="store_true", help="skip the (slow) load_inline build")
    p.add_argument("--warm-spares", type=int, default=-1, help="SandboxConfig.warm_spares (0: a cold child per check, -1: auto)")
    p.add_argument("--kernel", default="relu", choices=["relu", "relu_vec", "heavy"],
                   help="relu: memory-bound, launch-dominated, one float per thread; relu_vec: float4 loads "
                        "(cuda only); heavy: 128 sines per element (cuda only), >= 1 ms")
    p.add_argument("--form", default="b", choices=["a", "b"],
                   help="b: the workspace (kernels/*.cu through ctypes); a: one file with load_inline (see above)")
    p.add_argument("--eager-beside", action=argparse.BooleanOptionalAction, default=True,
                   help="SandboxConfig.eager_beside: eager timed in each candidate's child (off: the cached baseline)")
    p.add_argument("--new-task", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the first check of another task while this one's spares run")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_sandbox.json"))
    args = p.parse_args()
    rows, cols = (4096, 4096) if args.device == "cuda" else (512, 1024)
    res = {"device": args.device, "isolation": sandbox.isolation(), "shape": [rows, cols], "kernel": args.kernel,
           "warm_spares": args.warm_spares, "form": args.form}
    assert args.kernel == "relu" or args.device == "cuda", f"--kernel {args.kernel} needs --device cuda"
    with tempfile.TemporaryDirectory() as root:
        cfg = sandbox.SandboxConfig(device=args.device, cache_dir=os.path.join(root, "cache"), iters=args.iters,
                                    warmup=10, warm_spares=args.warm_spares, eager_beside=args.eager_beside)
        ws = make_ws(root, args.device, args.kernel)
        sol = pathlib.Path(ws) if args.form == "b" else inline_solution(args.device)  # what every check below checks
        # (1) rebuild after a one-kernel edit vs load_inline
        rb = bench_rebuild(ws, cfg, args.edits)
        res["rebuild_s"] = {"median": statistics.median(rb), "all": rb}
        print(f"rebuild after one-kernel edit: {rb}", flush=True)
        res["load_inline_s"] = None if args.skip_load_inline else bench_load_inline(args.device)
        # (2) checks per minute (baselines cached by the first check)
        task = (HEAVY_TASK if args.kernel == "heavy" else TASK).format(rows=rows, cols=cols)
        t = time.perf_counter()  # the dispatch guard is built once per machine and torch, not per task
        sandbox.guard_library(cfg)
        res["guard_build_s"] = time.perf_counter() - t
        t = time.perf_counter()  # likewise the children's bytecode cache (where torch ships none)
        res["bytecode_cache"] = sandbox.bytecode_cache(cfg)
        res["bytecode_cache_s"] = time.perf_counter() - t
        t = time.perf_counter()
        first = sandbox.check(task, sol, cfg)
        res["first_check_s"] = time.perf_counter() - t
        res["first_check_split_s"] = {k: first.timings.get(k) for k in ("reference_s", "candidate_s", "warm_child",
                                                                         "reference_phases", "candidate_phases",
                                                                         "reference_startup")}
        print(f"load_inline: {res['load_inline_s']} s; first check: {res['first_check_s']:.1f} s "
              f"{res['first_check_split_s']}", flush=True)
        assert first.correct, first.to_dict()
        verdicts, walls, t = [], [], time.perf_counter()
        for _ in range(args.checks):
            t_one = time.perf_counter()
            verdicts.append(sandbox.check(task, sol, cfg))
            walls.append(time.perf_counter() - t_one)
        dt = time.perf_counter() - t
        # a check's wall time: preparing (reads, compile cache, scan), the reference child or pool, the candidate
        # child, and the rest (verdict, timing statistics, job dir removal)
        res["check_s"] = {"median": statistics.median(walls), "all": [round(w, 3) for w in walls]}
        res["prepare_s_median"] = statistics.median(v.timings.get("prepare_s", 0) for v in verdicts)
        res["rest_s_median"] = statistics.median(w - sum(v.timings.get(k, 0) for k in ("prepare_s", "reference_s",
                                                                                     "candidate_s"))
                                                 for w, v in zip(walls, verdicts))
        res["checks_per_min"] = 60 * args.checks / dt
        # where a check's time goes: the reference child (0 when its output pool is reused) and the candidate child
        res["reference_s_median"] = statistics.median(v.timings.get("reference_s", 0) for v in verdicts)
        res["candidate_s_median"] = statistics.median(v.timings.get("candidate_s", 0) for v in verdicts)
        res["candidate_phases"] = [v.timings.get("candidate_phases") for v in verdicts]
        # the driver's preparation of each timed call (inputs in place, output poisoned, L2 reset and flushed), and
        # how many calls had GPU work of the child's charged to them (prep over its calibrated time)
        res["prep_ms_median"] = statistics.median(v.timings.get("prep_ms_median") or 0.0 for v in verdicts)
        res["prep_excess_calls"] = [v.timings.get("prep_excess_calls") for v in verdicts]
        print(f"checks/min {res['checks_per_min']:.1f}; per check: reference {res['reference_s_median']:.2f} s, "
              f"candidate child {res['candidate_s_median']:.2f} s; its phases (s from start): "
              f"{res['candidate_phases'][-1]}", flush=True)
        res["all_correct"] = all(v.correct for v in verdicts)
        # the first check of another task (its baselines not cached) in a process whose spares are running: the
        # same values as relu(x) from another graph, so torch.compile builds a kernel it has not built before
        other = (HEAVY_TASK if args.kernel == "heavy" else TASK.replace(
            "return torch.relu(x)", "return torch.relu(x) + 0.0 * torch.relu(-x)")).format(rows=rows, cols=cols)
        if args.new_task:
            t = time.perf_counter()
            nv = sandbox.check(other, sol, cfg)
            res["first_check_new_task_s"] = time.perf_counter() - t
            res["first_check_new_task_split_s"] = {k: nv.timings.get(k) for k in ("reference_s", "candidate_s",
                                                                                  "warm_child", "reference_phases")}
            print(f"first check of a new task: {res['first_check_new_task_s']:.1f} s "
                  f"{res['first_check_new_task_split_s']}", flush=True)
        # (3) spread of repeated timings of one kernel
        cands = [v.candidate_ms for v in verdicts[: args.repeats]]
        for _ in range(max(0, args.repeats - len(cands))):
            cands.append(sandbox.check(task, sol, cfg).candidate_ms)
        res["candidate_ms"] = cands
        res["cv_across_checks"] = statistics.pstdev(cands) / statistics.fmean(cands)
        res["cv_within_check_median"] = statistics.median(v.timings["cand_cv"] for v in verdicts)
        res["eager_ms"], res["compile_ms"], res["gpu"] = first.eager_ms, first.compile_ms, first.device
        # each check's candidate over the eager time it was compared with (its own child's, or the cached one)
        res["ratio_per_check"] = [v.candidate_ms / v.eager_ms for v in verdicts[: args.repeats]]
        res["ratio_median"] = statistics.median(res["ratio_per_check"])
        res["eager_cached_ms"] = first.timings.get("eager_cached_ms")
        # every check of the timed series: its time and the driver's view of its calls
        keys = ("warm_child", "prep_ms_median", "prep_excess_calls", "prep_excess_ms_max", "driver_uses", "clocks",
                "baseline_clocks", "call_host_ms_median", "call_reply_ms_median", "call_stop_ms_median",
                "call_judge_ms_median")
        res["per_check"] = [{k: v.timings.get(k) for k in keys} | {"ms": v.candidate_ms, "eager_ms": v.eager_ms}
                            for v in verdicts]
    with open(args.out, "w") as f:  # before the table: a run cut short keeps what it measured
        json.dump(res, f, indent=1)
    print(json.dumps(res["per_check"][:3]), flush=True)
    li = res["load_inline_s"]
    print("\n| metric | value |\n|---|---|")
    print(f"| machine | {res['gpu']} ({args.device}, isolation {res['isolation']}) |")
    print(f"| rebuild after one-kernel edit (median of {args.edits}) | {res['rebuild_s']['median']:.2f} s |")
    print(f"| load_inline build of the same kernel | {'skipped' if li is None else f'{li:.1f} s'} |")
    print(f"| checks per minute (one device, cached baselines, {rows}x{cols} relu) | {res['checks_per_min']:.1f} |")
    print(f"| dispatch guard build (once per machine and torch; before the first check) | {res['guard_build_s']:.1f} s |")
    print(f"| children's bytecode cache (once per machine and torch; none where torch ships bytecode) | "
          f"{res['bytecode_cache_s']:.1f} s{'' if res['bytecode_cache'] else ' (not used)'} |")
    split = res["first_check_split_s"]
    print(f"| first check (computes baselines) | {res['first_check_s']:.1f} s (reference child {split['reference_s']} s, "
          f"candidate child {split['candidate_s']} s) |")
    if "first_check_new_task_s" in res:
        split = res["first_check_new_task_split_s"]
        print(f"| first check of a new task, spares running | {res['first_check_new_task_s']:.1f} s (reference child "
              f"{split['reference_s']} s, candidate child {split['candidate_s']} s) |")
    print(f"| per check, median: wall / prepare / reference child / candidate child / rest | "
          f"{res['check_s']['median']:.3f} / {res['prepare_s_median']:.3f} / {res['reference_s_median']:.3f} / "
          f"{res['candidate_s_median']:.3f} / {res['rest_s_median']:.3f} s |")
    cands_r = [v.timings.get("cand_median_all") for v in verdicts if v.timings.get("cand_median_all")]
    if cands_r:
        print(f"| candidate ms, median over checks of the median of all timed calls (the former statistic) | "
              f"{statistics.median(cands_r):.4f} |")
    print(f"| driver's preparation of a timed call, median ms / calls charged an excess, per check | "
          f"{res['prep_ms_median']:.4f} / {res['prep_excess_calls']} |")
    print(f"| candidate ms median over checks | {statistics.median(cands):.4f} |")
    print(f"| CV of candidate_ms across {len(cands)} checks | {res['cv_across_checks']:.3f} |")
    print(f"| CV within a check ({args.iters} iters, median) | {res['cv_within_check_median']:.3f} |")
    print(f"| eager / compile ms (first check) | {res['eager_ms']:.4f} / {res['compile_ms'] or float('nan'):.4f} |")
    print(f"| candidate / eager, median over {len(res['ratio_per_check'])} checks (eager "
          f"{'in each candidate child' if args.eager_beside else 'cached'}) | {res['ratio_median']:.3f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
