"""Shared pytest setup: the repo root on sys.path, and GPU tests skipped when there is no CUDA."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: scripts/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
