"""Shared set-up of the GPU test suite: a skip with its reason where no GPU is present, and the NCCL group
of the multi-rank test files (torchrun ... -m pytest FILE)."""
import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """The current CUDA device; skips the test (with the reason) on a machine without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (these tests check the CUDA kernels)")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def nccl_group(request):
    """An NCCL process group over the torchrun ranks for one test file; use it with
    pytestmark = pytest.mark.usefixtures("nccl_group")."""
    if "LOCAL_RANK" not in os.environ:
        pytest.fail(f"launch with torchrun --nproc-per-node N -m pytest {os.path.relpath(request.module.__file__)}")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    yield
    dist.destroy_process_group()
