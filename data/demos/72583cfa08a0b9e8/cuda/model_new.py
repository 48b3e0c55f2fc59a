"""Generated demo (synth.emit_demo): torch.erfc -> nn.Mish fused into one elementwise kernel."""
import ctypes

import torch
import torch.nn as nn

from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("fused_pointwise")
lib.fused_pointwise_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
lib.fused_pointwise_forward.restype = None


class ModelNew(nn.Module):
    def __init__(self, *init_inputs):   # same constructor as Model (pointwise tasks take no arguments)
        super().__init__()

    def forward(self, x):
        assert x.dtype == torch.float32 and x.is_contiguous(), "the kernel expects contiguous float32"
        y = torch.empty_like(x)
        lib.fused_pointwise_forward(ptr(x), ptr(y), x.numel(), stream())
        return y
