"""Shared pytest fixtures for the CPU test suite."""
import pathlib

import numpy as np
import pytest

GOLDEN = pathlib.Path(__file__).resolve().parent / "data" / "te_reference_vectors.npz"
GOLDEN_V2 = GOLDEN.with_name("te_reference_vectors_v2.npz")


@pytest.fixture(scope="session")
def golden():
    """Transformer Engine's reference vectors (tests/data, README there)."""
    if not GOLDEN.exists():
        pytest.fail(f"golden vectors not found at {GOLDEN}")
    return np.load(GOLDEN)


@pytest.fixture(scope="session")
def golden_v2():
    """Transformer Engine's reference vectors for 4over6 and the row-scaled columnwise copy (tests/data, README)."""
    if not GOLDEN_V2.exists():
        pytest.fail(f"golden vectors not found at {GOLDEN_V2}")
    return np.load(GOLDEN_V2)
