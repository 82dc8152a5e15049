"""The symmetric-memory switch (parallel/symmetric.py) on CPU: gloo groups fall back to NCCL's path, bad switches fail.

The peer-memory kernels themselves need GPUs: tests_multigpu/test_symmetric_gpu.py.
"""
import pytest
import torch

from nvfp4_dist.parallel import all_reduce_amax, symmetric
from tests.helpers.distributed import run_distributed


def _gloo_group_is_not_symmetric(rank, world_size, monkeypatch_value):
    import os
    os.environ["NVFP4_SYMMETRIC_MEMORY"] = monkeypatch_value
    assert symmetric.enabled() is False
    amax = torch.tensor([float(rank)])
    all_reduce_amax([amax])
    assert amax.item() == world_size - 1
    with pytest.raises(ValueError, match="float32 CUDA"):
        symmetric.all_reduce_max([torch.zeros(9)])


@pytest.mark.parametrize("switch", ["auto", "0"])
def test_gloo_group_takes_the_plain_path(switch):
    run_distributed(_gloo_group_is_not_symmetric, 2, switch)


def _bad_switch(rank, world_size):
    import os
    os.environ["NVFP4_SYMMETRIC_MEMORY"] = "sometimes"
    with pytest.raises(ValueError, match="NVFP4_SYMMETRIC_MEMORY='sometimes'"):
        symmetric.enabled()


def test_bad_switch_is_rejected():
    run_distributed(_bad_switch, 2)
