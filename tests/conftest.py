"""Shared pytest setup: the repo root on sys.path, and GPU tests skipped when there is no CUDA."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# No CUDA: Triton kernels (engine/moe_kernel.py) run on CPU tensors under Triton's interpreter. Triton reads the
# variable when it is imported (its tl.* helpers) and when a kernel is decorated, and test modules import it
# indirectly (peft, torch._dynamo) long before tests/test_moe_kernel.py, so it is set here, first.
if "TRITON_INTERPRET" not in os.environ:
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: scripts/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
