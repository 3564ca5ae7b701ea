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
