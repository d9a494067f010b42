import os
import sys

import pytest

# tests/helpers is imported as `helpers` by the test modules and by spawned ranks.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
