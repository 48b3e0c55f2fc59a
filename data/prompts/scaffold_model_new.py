import ctypes

import torch
import torch.nn as nn
from sandbox_worker import load_kernel, ptr, stream

lib = load_kernel("{name}")   # kernels/{name}.{ext}, compiled by the harness
# lib.my_op.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]


class ModelNew(nn.Module):
    def __init__(self, *args):   # TODO: the same arguments as Model.__init__
        super().__init__()

    def forward(self, *inputs):
        raise NotImplementedError("TODO: allocate outputs and call your kernels")
