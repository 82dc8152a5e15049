"""Shared set-up of the GPU test suite: a skip with its reason where no GPU is present."""
import pytest
import torch


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """The current CUDA device; skips the test (with the reason) on a machine without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (these tests check the CUDA kernels)")
    return torch.device("cuda", torch.cuda.current_device())
