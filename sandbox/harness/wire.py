"""The framed result channel between a sandbox child and the host (nonce-framed JSON heads with tensors as raw
frames, and the control pipe's JSON lines), file descriptors over a unix socket, and the `Link` between a
check's driver and the child that computes. A child sends with `Channel`; the host reads with `tensor_specs`
and `decode` (sandbox.child._reader). Runs INSIDE a child too (bound beside sandbox_worker.py); imports
nothing of the project.
"""
from __future__ import annotations

import json
import os
import select
import socket
import struct
import time

_perf = time.perf_counter  # bound at import, before any candidate code exists in the child
_T: dict = {}  # torch.empty, bound by bind_torch() before candidate import


def bind_torch():
    import torch
    _T.update(empty=torch.empty)


WIRE_DTYPES = ("float32", "float16", "bfloat16", "float64", "complex64", "complex128", "int64", "int32", "int16",
               "int8", "uint8", "bool")  # all a message's tensors may be (the host allocates from this list)


def encode(msg, place=None) -> tuple[bytes, list]:
    """(JSON head, [contiguous cpu tensors]) for plain data with tensors in it. Tensors travel as raw bytes
    after the head, so neither side pickles (the host never unpickles what a child wrote)."""
    import torch
    tensors: list = []

    def enc(o):
        if isinstance(o, torch.Tensor):
            o = o.detach()
            assert str(o.dtype)[6:] in WIRE_DTYPES and o.layout == torch.strided, f"cannot send a {o.dtype} tensor"
            spec = {"__t__": len(tensors), "dtype": str(o.dtype)[6:], "shape": list(o.shape)}
            # through pinned memory: a device-to-host copy into fresh pageable memory ran at ~1 GB/s on an H200
            # host (page faults), into pinned memory at ~50 GB/s (docs/RESULTS.md)
            t = _T.get("empty", torch.empty)(o.shape, dtype=o.dtype, pin_memory=True).copy_(o) if o.is_cuda \
                else o.contiguous()
            tensors.append(t)
            return spec
        if isinstance(o, dict):
            if all(type(k) is str and not k.startswith("__") for k in o):
                return {k: enc(v) for k, v in o.items()}
            return {"__items__": [[enc(k), enc(v)] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"__tuple__": [enc(x) for x in o]}
        if isinstance(o, list):
            return [enc(x) for x in o]
        if o is None or type(o) in (bool, int, float, str):
            return o
        raise TypeError(f"cannot send a {type(o).__name__}")
    return json.dumps(enc(msg)).encode(), tensors


def tensor_specs(head) -> list[tuple[str, list[int]]]:
    """The (dtype, shape) of each tensor a decoded head refers to, in order; raises ValueError if malformed."""
    specs: dict[int, tuple] = {}

    def walk(o):
        if isinstance(o, dict):
            if "__t__" in o:
                i, dt, shape = o.get("__t__"), o.get("dtype"), o.get("shape")
                if set(o) != {"__t__", "dtype", "shape"} or type(i) is not int or i in specs or \
                        dt not in WIRE_DTYPES or not isinstance(shape, list) or \
                        not all(type(d) is int and d >= 0 for d in shape):
                    raise ValueError("bad tensor spec")
                specs[i] = (dt, shape)
            else:
                for v in o.values():
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(head)
    if sorted(specs) != list(range(len(specs))):
        raise ValueError("bad tensor numbering")
    return [specs[i] for i in range(len(specs))]


def decode(head, tensors: list):
    """Inverse of `encode` (the host's side), given the tensors read for `tensor_specs(head)`."""
    if isinstance(head, dict):
        if "__t__" in head:
            return tensors[head["__t__"]]
        if "__items__" in head:
            return {decode(k, tensors): decode(v, tensors) for k, v in head["__items__"]}
        if "__tuple__" in head:
            return tuple(decode(x, tensors) for x in head["__tuple__"])
        return {k: decode(v, tensors) for k, v in head.items()}
    if isinstance(head, list):
        return [decode(x, tensors) for x in head]
    return head


class Channel:
    """Nonce-framed messages on the inherited result fd: nonce(16) | len(8) | JSON head, then one frame
    nonce(16) | len(8) | raw bytes per tensor the head names (`encode`) that is not in the shared buffer."""

    def __init__(self, fd: int, nonce: bytes, control_fd: int | None):
        self.fd, self.nonce, self.control_fd, self._buf = fd, nonce, control_fd, b""

    def _write(self, data):
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view):]

    def send(self, msg: dict):
        import torch
        head, tensors = encode(msg)
        self._write(self.nonce + struct.pack(">Q", len(head)) + head)
        for t in tensors:
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            self._write(self.nonce + struct.pack(">Q", t.numel() * t.element_size()))
            self._write(raw)

    def recv_control(self, spin_s: float = 0.0) -> dict:
        """One JSON line from the host. The host writes one line per request it answers, so the pipe never
        holds a request before the previous one is answered (a seed exists in this process only once it is
        used); only the nonce and a warm child's job line can arrive together. With `spin_s` it polls for
        that long before blocking: between timed calls the process stays awake, so the next call's host-side
        launch path is not slowed by a sleep (~30 us on an H200 host, docs/RESULTS.md)."""
        deadline = _perf() + spin_s
        while b"\n" not in self._buf:
            if spin_s and _perf() < deadline and not select.select([self.control_fd], [], [], 0)[0]:
                continue
            chunk = os.read(self.control_fd, 4096)
            assert chunk, "host closed the control pipe"
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)


def send_fds(fd: int, obj: dict, fds: list[int]):
    """`obj` (one JSON datagram) with file descriptors, over a unix socket (the host relays the driver's shared
    buffers and the driver-child link this way: descriptors are the only handles that cross PID namespaces)."""
    with socket.socket(fileno=os.dup(fd)) as s:
        socket.send_fds(s, [json.dumps(obj).encode()], fds)


def recv_fds(fd: int, max_fds: int = 16) -> tuple[dict, list[int]]:
    with socket.socket(fileno=os.dup(fd)) as s:
        data, fds, _, _ = socket.recv_fds(s, 1 << 16, max_fds)
    return json.loads(data), list(fds)


class Link:
    """JSON lines between the driver and the computing child, over a unix stream socket the host gave both. The
    driver reads what a candidate's process wrote: a line that is not a JSON object, or longer than MAX_LINE,
    reads as {"error": ...}, never as an exception; `eof` tells a closed link from a timeout."""
    MAX_LINE = 1 << 20

    def __init__(self, fd: int):
        self.sock, self._buf, self.eof = socket.socket(fileno=fd), b"", False

    def send(self, obj: dict):
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout_s: float | None = None) -> dict | None:
        """The next message, or None at EOF or after `timeout_s`."""
        deadline = None if timeout_s is None else _perf() + timeout_s
        while b"\n" not in self._buf:
            if len(self._buf) > self.MAX_LINE:
                self._buf = b""
                return {"error": f"a message longer than {self.MAX_LINE} bytes on the link"}
            left = None if deadline is None else deadline - _perf()
            if left is not None and left <= 0:
                return None
            if not select.select([self.sock], [], [], left)[0]:
                return None
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        return msg if isinstance(msg, dict) else {"error": "a malformed message on the link"}

    def close(self):
        self.sock.close()
