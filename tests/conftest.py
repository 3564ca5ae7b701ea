from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # sample_models is a top-level folder, not installed
    sys.path.insert(0, str(ROOT))

SAMPLES = ROOT / "sample_models"
SAMPLE_NAMES = ("mlp", "cnn", "gpt", "llama", "moe")


@pytest.fixture(params=SAMPLE_NAMES)
def sample_name(request) -> str:
    return request.param


@pytest.fixture
def samples_dir() -> Path:
    return SAMPLES


@pytest.fixture
def one_thread():
    """One intra-op thread for a test whose figures are op outputs, the same whatever
    the threads: two threads spinning on a shared 2-core machine take 10x longer. A
    module asks for it with ``pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
