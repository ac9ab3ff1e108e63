"""Shared test setup: GPU tests skip cleanly without CUDA; CPU tests use few threads."""

import pytest
import torch

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
