"""Shared pytest fixtures for the CPU test suite."""
import pathlib

import numpy as np
import pytest

GOLDEN = pathlib.Path(__file__).resolve().parent / "data" / "te_reference_vectors.npz"


@pytest.fixture(scope="session")
def golden():
    """Transformer Engine's reference vectors (tests/data, README there)."""
    if not GOLDEN.exists():
        pytest.fail(f"golden vectors not found at {GOLDEN}")
    return np.load(GOLDEN)
