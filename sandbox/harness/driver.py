"""The trusted side of a check, INSIDE a child that runs the pristine task and never candidate code
(`python sandbox_worker.py JOB`, job kind "driver"; bound beside the worker, imports nothing of the project).

A driver holds one task: its reference model (strict fp32), and two shared regions, one for the inputs of a
call and one for its outputs (share.Region). It serves pairings one after another; each pairing is
one computing child (a candidate's, or a baseline's running eager and `torch.compile`), reached through a
`Link` the host gave both, and held still by a `Freezer` whenever it is not asked for a call. Per call:
  1. draw the inputs from a fresh host-private seed, possibly beyond `get_inputs`' one distribution
     (`VARIANTS`: per-tensor scale and shift, or a sparse set of outliers), in private memory, and compute
     the reference output on them; a variant on which the reference turns non-finite is drawn plain;
  2. on a GPU, for a timed call: continue the child, which enqueues on its stream a wait for the "go" flag, its
     forward, the copy into the output region and the "done" flag, replies at once, and is stopped again
     (`Driver._call_queued`; a forward that waits on the GPU falls back to step 4's order after QUEUE_WAIT_S);
  3. prepare, while the child is stopped: the inputs copied into the shared input region, the output region
     poisoned (0xFF: NaN for floats); on a GPU also the L2's persisting lines reset and the L2 flushed, and the
     preparation timed on the driver's stream (`prep_ms`);
  4. start the clock: cpu `perf_counter`, then "go" sent and the child continued (it computes from the shared
     inputs, copies its output into the shared output region and says "done"); GPU an event E0 on the
     driver's stream, then the go flag (untimed calls: then the child is continued, as on cpu);
  5. stop the clock: cpu once every thread of the child is seen stopped; GPU an event E1 on the driver's
     stream, which waits for the done flag and then reads SAMPLES random bytes of the output;
  6. compare the output region with the reference in full, check that the sampled bytes did not change after
     E1 and that the inputs are unmodified, and report the call to the host.
The time of a call is the driver's own clock: on a GPU a queued call's holds the GPU work between go and done
and no host time of either process (as events around a forward would, for a forward that does not wait on the
GPU); eager and compile are timed the same way. A GPU shared between two contexts runs one at a time, so GPU
work the child does while the driver prepares lengthens `prep_ms`; what exceeds the preparation's calibrated
time (measured before any child existed) is added to the call's time.

Smoke: python -m pytest tests/test_sandbox_attacks.py -q
"""
from __future__ import annotations

import random
import secrets
import statistics
import time

if __package__:  # on the host: a module of the package sandbox.harness
    from .measure import BASELINE_ROUNDS, flatten, load_task, make_inputs, nan_equal, one_line, set_precision
    from .rules import compare
    from .share import Freezer, GpuOps, Region, layout
    from .wire import Link, recv_fds, send_fds
else:  # in a child: beside the other harness files (sandbox.child.HARNESS_FILES), imported by flat name
    from measure import BASELINE_ROUNDS, flatten, load_task, make_inputs, nan_equal, one_line, set_precision
    from rules import compare
    from share import Freezer, GpuOps, Region, layout
    from wire import Link, recv_fds, send_fds

_perf = time.perf_counter
VARIANTS = ("plain", "affine", "heavy")
TIMED_MIX = (0.5, 0.25, 0.25)  # how often a timed call draws each variant
SAMPLES = 4096                 # output bytes the GPU clock's end reads at random (in the timed region)
PREP_SLACK = (1.25, 0.02)      # a preparation may take 1.25 x its calibrated time + 20 us before it is charged
DONE_GRACE_S = 2.0             # after the child's reply, how long its done flag may take to reach the driver's stream
QUEUE_WAIT_S = 0.5             # how long a queued call's child may take to enqueue its work before it falls back
FLOOR_CALLS = (2, 8)           # a pairing's null calls (warm-up, measured): the floor of the queued clock


def _name(t) -> str:
    return str(t.dtype)[6:]


class Driver:
    def __init__(self, job: dict, ch):
        import torch
        self.job, self.ch, self.device = job, ch, job["device"]
        self.task = load_task(job["task_path"])
        torch.manual_seed(job["init_seed"])
        self.model = self.task.Model(*self.task.get_init_inputs()).to(self.device)
        set_precision(False)  # the reference is strict fp32; the driver times nothing it computes itself
        self.rng = random.Random(secrets.randbits(64))
        xs = make_inputs(self.task, self.rng.randrange(2**31), self.device)
        with torch.no_grad():
            self.out_kind, ys = flatten(self.model(*xs))
        self.in_specs = [(_name(x), list(x.shape)) for x in xs]
        self.out_specs = [(_name(y), list(y.shape)) for y in ys]
        self.ops = GpuOps() if self.device == "cuda" else None
        self.inp = Region(self.device, layout(self.in_specs)[1], ops=self.ops)
        self.out = Region(self.device, layout(self.out_specs)[1], ops=self.ops)
        self.in_views, self.out_views = self.inp.views(self.in_specs), self.out.views(self.out_specs)
        self.regions, self.k, self.prep_ms, self.queue_ok, self.queue = [self.inp, self.out], 0, 0.0, {}, True
        self.floor_ms = 0.0  # the queued clock's floor in the current pairing (`floor`)
        if self.ops:
            self.flags = Region(self.device, 256, ops=self.ops)  # int32 words: [go, done]
            self.flags.bytes.zero_()
            self.regions.append(self.flags)
            l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            self.flush = torch.empty(2 * max(l2, 1 << 20), dtype=torch.uint8, device=self.device)
            self.side = torch.cuda.Stream()
            self.prep_ms = min(self._calibrate(xs) for _ in range(8))
        del xs, ys

    def ready(self) -> dict:
        import torch
        send_fds(self.job["fd_sock"], {"sizes": [r.size for r in self.regions]}, [r.fd for r in self.regions])
        sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        return {"type": "ready", "in": self.in_specs, "out": self.out_specs, "out_kind": self.out_kind,
                "state_dict": sd, "device_name": name, "prep_ms": self.prep_ms, "sizes": [r.size for r in self.regions]}

    # ------------------------------------------------------------------------- inputs and references
    def draw(self, seed: int, variant: str) -> list:
        """The inputs of `seed`, transformed per `variant` (float tensors only): "affine" x * a + b with
        a = 2^U(-1, 1) and b ~ U(-1, 1) per tensor, "heavy" one element in a thousand scaled by 8. A shortcut
        that is right for get_inputs' distribution (a constant, an identity, moments estimated from a few
        elements) is wrong on these; an honest kernel computes the same function on any input."""
        import torch
        xs = make_inputs(self.task, seed, self.device)
        if variant == "plain":
            return xs
        g = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)
        out = []
        for x in xs:
            if x.is_floating_point() and x.numel():
                if variant == "affine":
                    a, b = 2.0 ** (2 * torch.rand((), generator=g).item() - 1), 2 * torch.rand((), generator=g).item() - 1
                    x = x * a + b
                else:
                    flat = x.reshape(-1).clone()
                    idx = torch.randint(flat.numel(), (max(1, flat.numel() // 1000),), generator=g).to(flat.device)
                    flat[idx] *= 8
                    x = flat.view(x.shape)
            out.append(x)
        return out

    def reference(self, xs) -> list:
        import torch
        with torch.no_grad():
            return flatten(self.model(*xs))[1]

    def case(self, variant: str, check: bool) -> tuple[list, list | None, str]:
        """(inputs, reference outputs or None, the variant drawn) of a fresh seed."""
        import torch
        seed = self.rng.randrange(2**31)
        xs = self.draw(seed, variant)
        if not check:
            return xs, None, variant
        ys = self.reference(xs)
        if variant != "plain" and not all(bool(torch.isfinite(y).all()) for y in ys if y.is_floating_point()):
            xp = self.draw(seed, "plain")
            yp = self.reference(xp)
            if all(bool(torch.isfinite(y).all()) for y in yp if y.is_floating_point()):
                return xp, yp, "plain"
        return xs, ys, variant

    # ------------------------------------------------------------------------- one call
    def _prepare(self, xs):
        for v, x in zip(self.in_views, xs):
            v.copy_(x)
        self.out.bytes.fill_(255)  # NaN in every float dtype: an element the child never wrote fails
        if self.ops:
            self.flush.fill_(self.k & 255)  # writes 2 x L2: no line of the inputs or of earlier calls stays

    def _calibrate(self, xs) -> float:
        """One preparation on the driver's stream with no child on the GPU: the time a call's is compared with."""
        import torch
        p0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.ops.reset_l2()
        p0.record()
        self._prepare(xs)
        e0.record()
        e0.synchronize()
        return p0.elapsed_time(e0)

    def call(self, link: Link, freezer: Freezer, req: dict, make, timeout_s: float,
             queued: bool = False) -> tuple[dict | None, dict, tuple]:
        """Run one call of the child on the case `make()` draws, (inputs, ...) (the child is stopped on entry and
        on return); returns its reply (None: no reply in time or the link closed), the timing {ms, raw_ms,
        prep_ms, excess_ms, clock, ...} and the case. `queued` (GPU, timed calls): the child enqueues its work
        behind the go flag first (`_call_queued`), and the case is drawn while the child stops."""
        self.k += 1
        req = {**req, "k": self.k}
        t_host = _perf()  # the driver's own wall time of the call: where a check's seconds go (not a verdict's)
        if queued and self.ops:
            return self._call_queued(link, freezer, req, make, timeout_s, t_host)
        case = make()
        xs = case[0]
        if not self.ops:
            self._prepare(xs)
            t0 = _perf()
            link.send(req)
            freezer.cont()
            reply = link.recv(timeout_s)
            t1 = _perf()
            stopped = freezer.stop()
            ms = (_perf() - t0) * 1e3
            host = {"host_ms": (_perf() - t_host) * 1e3, "stop_ms": (_perf() - t1) * 1e3}
            return reply if stopped else {"error": "the child could not be stopped"}, {"ms": ms, "raw_ms": ms, **host}, case
        p0, e0, e1 = self._clocked(xs)
        t_enq = _perf()
        link.send(req)
        freezer.cont()
        reply = link.recv(timeout_s)
        t1 = _perf()
        stopped = freezer.stop()
        t2 = _perf()
        reply = self._finish(reply, stopped, e1, DONE_GRACE_S)
        return reply, self._timing(p0, e0, e1, "go-first", t_host, t_enq, t1, t2), case

    def _call_queued(self, link: Link, freezer: Freezer, req: dict, make, timeout_s: float, t_host: float):
        """A timed call whose clock holds the GPU work only: the child, continued, enqueues on its stream a wait
        for the go flag, its forward, the copy into the output region and the done flag, and replies at once
        (no sync); it is stopped again, and only then are its inputs written, the L2 reset and flushed, and
        E0, go, done, the output sample and E1 put on the driver's stream. Nothing the child enqueued can
        read this call's inputs before they exist (they are written after its last instruction ran), and
        nothing it does on the CPU overlaps the clock. A forward that waits on the GPU (a sync, .item())
        cannot reply before go: after QUEUE_WAIT_S the call falls back to continuing the child after go, its
        host time then inside the clock (`clock` "fallback"; after a fallback that is not a warm-up call, the
        pairing's later calls of that function go first). The clock's fixed part, the same for every
        forward (the switch of the GPU between the two processes' contexts, the output copy, the flags), is
        the pairing's floor (`floor`), taken off a queued call's time."""
        t_enq = _perf()
        link.send({**req, "queued": True})
        freezer.cont()
        reply = link.recv(min(QUEUE_WAIT_S, timeout_s))
        t1 = _perf()
        box = []  # the case, drawn in private memory while the signals land
        stopped = freezer.stop(during=lambda: box.append(make()))
        case = box[0] if box else make()
        t2 = _perf()
        clock = "queued" if reply is not None and reply.get("k") == self.k else "fallback"
        if clock == "fallback" and not req.get("warm"):  # a warm-up call may be slow once (a first profile, a cache)
            self.queue_ok[req["fn"]] = False
        p0, e0, e1 = self._clocked(case[0])
        if reply is None and stopped and not link.eof:  # still in its forward: continue it, the clock running
            freezer.cont()
            reply = link.recv(max(0.0, timeout_s - (_perf() - t_enq)))
            t1 = _perf()
            stopped = freezer.stop()
            t2 = _perf()
        reply = self._finish(reply, stopped, e1, max(DONE_GRACE_S, timeout_s - (_perf() - t_enq)))
        return reply, self._timing(p0, e0, e1, clock, t_host, t_enq, t1, t2), case

    def _clocked(self, xs) -> tuple:
        """Put a call on the driver's stream (the child stopped): the L2 reset, the preparation (timed from p0), E0,
        the go flag, a wait for the child's done flag, SAMPLES random output bytes read, E1."""
        import torch
        s = torch.cuda.current_stream()
        p0, e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        idx = torch.randint(self.out.size, (SAMPLES,), device=self.device)  # private: the child never sees it
        self.ops.reset_l2()
        p0.record()
        self._prepare(xs)
        e0.record()
        self.ops.write_flag(s.cuda_stream, self.flags.ptr, self.k)  # go: the inputs are in place
        self.ops.wait_flag(s.cuda_stream, self.flags.ptr + 4, self.k)  # done: the child's stream wrote it
        self.sample, self.sample_idx = self.out.bytes[idx], idx
        e1.record()
        return p0, e0, e1

    def _finish(self, reply: dict | None, stopped: bool, e1, grace_s: float) -> dict | None:
        """Wait (at most grace_s) for the done flag of a call the child says it did; write the flag from the side
        stream when no flag can come, so that the driver's stream never waits forever. The reply, or why not."""
        import torch
        if reply is not None and reply.get("k") == self.k and stopped:  # it says done: its stream must have too
            deadline = _perf() + grace_s
            while not e1.query() and _perf() < deadline:
                time.sleep(1e-4)
            if not e1.query():
                reply = {"error": "the child replied, but its stream never raised the done flag"}
        if reply is None or reply.get("k") != self.k or not stopped:  # no done flag may ever come: write it
            with torch.cuda.stream(self.side):
                self.flags.bytes[4:8].view(torch.int32).fill_(self.k)
        e1.synchronize()
        return reply if stopped else {"error": "the child could not be stopped"}

    def _timing(self, p0, e0, e1, clock: str, t_host: float, t_enq: float, t1: float, t2: float) -> dict:
        ms, prep = e0.elapsed_time(e1), p0.elapsed_time(e0)
        excess = max(0.0, prep - (PREP_SLACK[0] * self.prep_ms + PREP_SLACK[1]))
        floor = self.floor_ms if clock == "queued" else 0.0
        return {"ms": max(0.0, ms - floor) + excess, "raw_ms": ms, "floor_ms": floor, "prep_ms": prep,
                "excess_ms": excess, "clock": clock,
                "host_ms": (_perf() - t_host) * 1e3, "enqueue_ms": (t_enq - t_host) * 1e3,
                "reply_ms": (t1 - t_enq) * 1e3, "stop_ms": (t2 - t1) * 1e3}

    def judge(self, reply: dict | None, xs, ys, eof: bool = False) -> tuple[bool, str | None, dict]:
        """(ok, reason, comparison stats) of a call's output region against the reference outputs `ys`; the
        stats carry "violation" when the call broke a rule (its inputs modified)."""
        import torch
        if reply is None:
            return False, "no reply from the child (it exited)" if eof else "no reply from the child in time", {}
        if reply.get("error") or reply.get("violation"):
            return False, reply.get("error") or reply.get("violation"), {}
        if reply.get("kind") != self.out_kind:
            return False, f"returned a {reply.get('kind')}, the reference returns a {self.out_kind}", {}
        if self.ops and not torch.equal(self.out.bytes[self.sample_idx], self.sample):
            return False, "the output changed after the call ended (work still running after it said done)", {}
        if not all(nan_equal(v, x) for v, x in zip(self.in_views, xs)):
            return False, "forward modified its inputs", {"violation": "forward modified its inputs"}
        res = compare(ys, self.out_views, None, self.device, self.job["atol"], self.job["rtol"], self.device)
        return res["ok"], res["reason"], res

    # ------------------------------------------------------------------------- a pairing
    def pairing(self, req: dict, link_fd: int):
        import torch
        link, freezer, report = Link(link_fd), Freezer(req["root_pid"]), {"type": "pairing_end", "error": None}
        self.queue_ok = {}  # fn -> False once a queued call of it fell back: its later calls go first
        self.queue = bool(req.get("queued", True))  # --sandbox.gpu-clock
        self.floor_ms = 0.0
        if self.ops:  # a child of an earlier pairing may have written any value into the flags: they start at 0
            self.flags.bytes.zero_()
            torch.cuda.synchronize()
        try:
            hello = link.recv(req["attach_timeout_s"])
            if not (hello or {}).get("attached"):
                report["error"] = (hello or {}).get("error") or "the child did not attach to the shared buffers"
                return
            if not freezer.stop():
                report["error"] = "the child could not be stopped"
                return
            if self.ops and self.queue:
                report["floor_ms"] = self.floor_ms = self.floor(link, freezer, req)
            if req.get("eager") or req["role"] == "baseline":
                report.update(self.rounds(link, freezer, req, ["eager", "compile"] if req["role"] == "baseline"
                                          else ["eager"]))
            if req["role"] == "candidate":
                report["error"] = self.candidate(link, freezer, req)
        except Exception as e:  # noqa: BLE001 - the driver's own failure: the host stops using this driver
            report["driver_error"] = one_line(e)
        finally:
            try:
                link.send({"op": "end"})
            except OSError:
                pass
            freezer.cont()
            link.close()
            self.ch.send(report)

    def floor(self, link, freezer, req: dict) -> float:
        """The queued clock's fixed part in this pairing: the least time of FLOOR_CALLS null calls, each queued
        as a timed call is, whose forward does no work and returns tensors of the outputs' specs (the child's
        own, allocated once), copied into the output region as any forward's are. It runs before any candidate
        code exists in the child. The least of several is the part no forward can avoid: a call whose switches
        are slower is charged the difference (its time is never below what it computed)."""
        times = []
        for i in range(sum(FLOOR_CALLS)):
            reply, t, _ = self.call(link, freezer, {"op": "call", "fn": "null", "warm": True},
                                    lambda: self.case("plain", check=False), req["call_timeout_s"], True)
            if reply is None or reply.get("error") or reply.get("k") != self.k:
                return 0.0  # no floor: every queued call is charged in full
            if i >= FLOOR_CALLS[0] and t["clock"] == "queued":
                times.append(t["raw_ms"])
        return min(times) if times else 0.0

    def rounds(self, link, freezer, req: dict, fns: list) -> dict:
        """The baselines' rounds: fns in turn, each round `n` timed calls after its warm-up, so that a burst of
        load inflates one round of each, not a whole baseline; the host keeps each round's median."""
        n = max(5, req["iters"] // BASELINE_ROUNDS)
        out = {fn: [] for fn in fns} | {"compile_error": None, "clocks": {fn: {} for fn in fns}}
        for r in range(BASELINE_ROUNDS):
            for fn in list(fns):
                warm = (max(req["warmup"], 3) if fn == "compile" else req["warmup"]) if r == 0 else 1
                times = []
                for i in range(warm + n):
                    first = r == 0 and i == 0  # compile's first call compiles: never queued
                    limit = req["compile_timeout_s"] if fn == "compile" and first else req["call_timeout_s"]
                    reply, t, _ = self.call(link, freezer, {"op": "call", "fn": fn, "warm": i < warm},
                                            lambda: self.case(self._mix(), check=False), limit,
                                            self._queued(fn, first))
                    if reply is None or reply.get("error") or reply.get("k") != self.k:
                        err = (reply or {}).get("error") or "no reply in time"
                        if fn != "compile":  # the host falls back to the cached eager baseline
                            return {**out, fn: [], f"{fn}_error": err}
                        out["compile"], out["compile_error"] = None, err
                        fns.remove(fn)
                        break
                    if i >= warm:
                        times.append(t["ms"])
                        if "clock" in t:
                            out["clocks"][fn][t["clock"]] = out["clocks"][fn].get(t["clock"], 0) + 1
                else:
                    out[fn].append(statistics.median(times))
        return out

    def candidate(self, link, freezer, req: dict) -> str | None:
        """Load the candidate, then its trials, the profiler's call and the timed calls; None, or why the
        pairing ended early (each call is reported to the host as it is judged)."""
        link.send({"op": "load"})
        freezer.cont()
        reply = link.recv(req["load_timeout_s"])
        if not freezer.stop():
            return "the child could not be stopped"
        if not (reply or {}).get("loaded"):
            self.ch.send({"type": "load", **(reply or {"error": "the candidate did not load in time"})})
            return "load"
        variants = (list(VARIANTS) * req["n_trials"])[:req["n_trials"]]
        self.rng.shuffle(variants)
        plan = [("trial", v) for v in variants] + [("ops", "plain")]
        if req["profile"]:
            plan += [("time", self._mix()) for _ in range(req["warmup"] + req["iters"])]
        count = {}
        for phase, variant in plan:
            warm = phase == "time" and count.get(phase, -1) + 1 < req["warmup"]
            op = {"op": "ops" if phase == "ops" else "call", "fn": "cand", "warm": warm}
            reply, t, (xs, ys, drawn) = self.call(link, freezer, op, lambda: self.case(variant, check=True),
                                                  req["call_timeout_s"], self._queued("cand", phase != "time"))
            t_judge = _perf()
            ok, reason, stats = self.judge(reply, xs, ys, link.eof)
            t["judge_ms"] = (_perf() - t_judge) * 1e3
            i = count[phase] = count.get(phase, -1) + 1
            self.ch.send({"type": "call", "phase": phase, "i": i, "ok": ok, "reason": reason, "variant": drawn,
                          "violation": (reply or {}).get("violation") or stats.get("violation"),
                          "ops": (reply or {}).get("ops"),
                          **t, **{k: stats.get(k) for k in ("max_abs_err", "max_rel_err", "rel_l2", "first_bad_index")}})
            if not ok:
                return f"{phase} {i}"
        return None

    def _queued(self, fn: str, untimed: bool) -> bool:
        """Whether a call of fn is queued (GPU timed calls, until one of fn's falls back in this pairing)."""
        return bool(self.ops) and self.queue and not untimed and self.queue_ok.get(fn, True)

    def _mix(self) -> str:
        return self.rng.choices(VARIANTS, TIMED_MIX)[0]


def run_driver(job: dict, ch):
    """Load the task, share the regions, say ready, then serve pairings until the host says stop."""
    try:
        d = Driver(job, ch)
    except (ValueError, TypeError) as e:
        return ch.send({"type": "result", "task_error": str(e)[:400]})
    except BaseException as e:  # noqa: BLE001
        return ch.send({"type": "result", "task_error": f"reference forward failed: {one_line(e)}"})
    ch.send(d.ready())
    while True:
        req = ch.recv_control()
        if req.get("op") != "pairing":
            break
        _, fds = recv_fds(job["fd_sock"])
        d.pairing(req, fds[0])
    ch.send({"type": "result", "stage": "done"})

