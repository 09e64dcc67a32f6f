import os
import sys

import pytest
import torch

# the checkout's own packages, before any installed copy
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one); on a GPU machine: -m gpu")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
