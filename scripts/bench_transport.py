"""Where a trial's output goes on its way to the host: each step a candidate child and the host take for one
4096x4096 fp32 output (64 MB), timed alone (median of 10, host clock around a device-wide sync).

  d2h pageable (encode)      `.to("cpu")` into fresh pageable memory (what the pipe path did per trial);
  d2h pinned                 into a pinned buffer (the pipe path now);
  pipe 64 MB                 one write through a 1 MiB pipe to a reader process reading 1 MiB at a time;
  d2h into shm               into a memfd mapping, as is and registered with CUDA (the shared buffer now);
  h2d pageable / pinned      the host's copy of an output to its GPU for the comparison;
  compare on cuda            sandbox.harness.rules.compare with the reference on the host or already on the GPU.

GPU: python3 scripts/bench_transport.py
"""
import fcntl
import mmap
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import sandbox.harness.measure as m  # noqa: E402
from sandbox.harness.rules import compare  # noqa: E402

N, DEV = 4096 * 4096, "cuda"
READER = ("import os, sys\nb = bytearray(64 << 20); v = memoryview(b)\nwhile True:\n    o = 0\n"
          "    while o < len(b):\n        n = os.readv(int(sys.argv[1]), [v[o:o + (1 << 20)]])\n"
          "        if n == 0:\n            sys.exit()\n        o += n\n")


def med(fn, n: int = 10) -> float:
    ts = []
    for _ in range(n + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts[2:])


def main():
    m.bind_torch(DEV)
    task = type("T", (), {"get_inputs": staticmethod(lambda: [torch.randn(4096, 4096)])})
    xs = m.make_inputs(task, 0, DEV)
    y = torch.relu(xs[0])
    res = {"make inputs": med(lambda: m.make_inputs(task, 1, DEV)),
           "NaN scrub": med(lambda: m.scrub(DEV, torch.cuda.synchronize)),
           "forward (torch.relu)": med(lambda: torch.relu(xs[0])),
           "inputs unmodified check": med(lambda: m.nan_equal(xs[0], xs[0].clone())),
           "d2h pageable (encode)": med(lambda: y.detach().to("cpu"))}
    pin = torch.empty(N, pin_memory=True)
    res["d2h pinned"] = med(lambda: pin.copy_(y.view(-1)))
    r, wfd = os.pipe()
    fcntl.fcntl(wfd, fcntl.F_SETPIPE_SZ, 1 << 20)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(r)], pass_fds=(r,))
    os.close(r)
    raw = pin.view(torch.uint8).numpy()

    def pipe_write():
        view = memoryview(raw).cast("B")
        while view:
            view = view[os.write(wfd, view):]
    res["pipe 64 MB"] = med(pipe_write)
    os.close(wfd)
    reader.wait()
    fd = os.memfd_create("bench")
    os.ftruncate(fd, N * 4)
    shm = torch.frombuffer(mmap.mmap(fd, N * 4), dtype=torch.float32)
    res["d2h into shm"] = med(lambda: shm.copy_(y.view(-1)))
    torch.cuda.cudart().cudaHostRegister(shm.data_ptr(), N * 4, 0)
    res["d2h into shm, registered"] = med(lambda: shm.copy_(y.view(-1)))
    host = torch.empty(N)
    res["h2d pageable"] = med(lambda: host.to(DEV))
    res["h2d pinned"] = med(lambda: pin.to(DEV, non_blocking=True))
    out = [host.view(4096, 4096)]
    res["compare on cuda, reference on the host"] = med(lambda: compare([y.cpu()], out, ["cuda"], "cuda", 1e-2, 1e-2,
                                                                           "cuda:0"), 5)
    res["compare on cuda, reference on the GPU"] = med(lambda: compare([y], out, ["cuda"], "cuda", 1e-2, 1e-2,
                                                                         "cuda:0"), 5)
    print(f"\n| step ({torch.cuda.get_device_name()}, 64 MB output) | ms |\n|---|---:|")
    for k, v in res.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()
