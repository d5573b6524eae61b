import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

torch.set_num_threads(min(2, os.cpu_count() or 1))
# One step graph per model: which attention forms a compiled model takes comes from timing probes, and the tests'
# graph counts must not depend on them. The tests of the per-form graphs turn it on (models/attention.py).
os.environ.setdefault("ANCHORSPEC_FEW_ROWS_GRAPH", "off")

# The evaluation data lives beside the repository (../shared/data), never inside it: a bare clone has none.
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data_file(rel: str) -> Path:
    """A file of ../shared/data (found relative to this repository); skips the test, saying why, when absent."""
    path = SHARED_DATA / rel
    if not path.is_file():
        pytest.skip(f"needs {rel} from the evaluation data, expected at {path} (beside the repository)")
    return path


@pytest.fixture
def shared_data():
    """`shared_data("mt_bench/question.jsonl")` -> Path, or a skip that names the missing file."""
    return shared_data_file


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


@pytest.fixture(scope="session", autouse=True)
def emulated_device():
    """ANCHORSPEC_TEST_DEVICE=emulated: the whole session runs under CUDA's device rules on the CPU, the tiny
    models' parameters on a virtual device (tests/device_emulation.py); session-wide, since module fixtures
    build targets before any test starts."""
    if os.environ.get("ANCHORSPEC_TEST_DEVICE") != "emulated":
        yield None
        return
    import device_emulation

    with device_emulation.emulating() as mode:
        yield mode
