import torch
import torch.nn as nn

import cuda_extension  # binding.cpp + kernels/*: one torch extension, built by the harness


class ModelNew(nn.Module):
    def __init__(self, *args):   # TODO: the same arguments as Model.__init__
        super().__init__()

    def forward(self, *inputs):
        raise NotImplementedError("TODO: allocate outputs and call your ops, e.g. cuda_extension.{name}_forward")
