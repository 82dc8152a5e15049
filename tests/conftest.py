"""Shared pytest fixtures for the CPU test suite, and the slow checks' opt-in.

A test marked `@pytest.mark.slow(reason=...)` takes minutes on a 2-core machine (compiling every kernel for
every target, training jobs run several times over): README's test command skips it and says why;
`--run-slow`, or RUN_SLOW_TESTS=1 in the environment (which reaches the pytest runs of `python -m
tests.mutations` too), runs it, as CI does (.ci/run).
"""
import os
import pathlib

import numpy as np
import pytest

GOLDEN = pathlib.Path(__file__).resolve().parent / "data" / "te_reference_vectors.npz"
GOLDEN_V2 = GOLDEN.with_name("te_reference_vectors_v2.npz")
RUN_SLOW = "--run-slow"
RUN_SLOW_VARIABLE = "RUN_SLOW_TESTS"


def pytest_addoption(parser):
    parser.addoption(RUN_SLOW, action="store_true",
                     help=f"also run the tests marked slow (minutes each on 2 cores; CI runs them: .ci/run); "
                          f"{RUN_SLOW_VARIABLE}=1 in the environment does the same")


def pytest_collection_modifyitems(config, items):
    if config.getoption(RUN_SLOW) or os.environ.get(RUN_SLOW_VARIABLE) == "1":
        return
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            if "reason" not in marker.kwargs:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs reason=...")
            item.add_marker(pytest.mark.skip(reason=f"slow: {marker.kwargs['reason']}; run with {RUN_SLOW} or "
                                                    f"{RUN_SLOW_VARIABLE}=1 (CI does, .ci/run)"))


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


@pytest.fixture(autouse=True)
def fresh_device_capabilities():
    """Tests emulate GPUs by patching torch.cuda.get_device_capability, which the GEMM dispatch asks once per device
    and process: forget its answers around each test."""
    from nvfp4_dist.gemm import dispatch
    dispatch._capability_of_index.cache_clear()
    yield
    dispatch._capability_of_index.cache_clear()
