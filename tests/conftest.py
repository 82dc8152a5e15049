"""Shared pytest fixtures for the CPU test suite."""
import pathlib

import numpy as np
import pytest

GOLDEN = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "te_reference_vectors.npz"


@pytest.fixture(scope="session")
def golden():
    """Transformer Engine's reference vectors (../shared/golden beside the checkout)."""
    if not GOLDEN.exists():
        pytest.fail(f"golden vectors not found at {GOLDEN}: the checkout needs ../shared beside it")
    return np.load(GOLDEN)
