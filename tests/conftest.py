import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_llama():
    from helpers import tiny_target

    return tiny_target("llama")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP oversubscription on a busy 2-core box."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
