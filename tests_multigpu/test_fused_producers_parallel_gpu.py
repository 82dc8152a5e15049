"""The fused producers in the tensor-parallel layers on GPUs (NCCL, the CUDA kernels):

    torchrun --nproc-per-node 2 -m pytest -q tests_multigpu/test_fused_producers_parallel_gpu.py
    torchrun --nproc-per-node 4 -m pytest -q tests_multigpu/test_fused_producers_parallel_gpu.py

ColumnParallelLinear(input_norm=...) and RowParallelLinear.forward(activation=...), with and without sequence
parallelism (and the overlapped comm carrying the input's columnwise copy): the fused layers equal the unfused
ones byte for byte (outputs and every gradient), and the column-parallel output is the GEMM of the full norm
output's copies (tests/test_fused_producers.py check_parallel_producers, here at hidden 4096).
"""
import pytest
import torch
import torch.distributed as dist

from tests import test_fused_producers as fused_checks

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs GPUs"),
              pytest.mark.usefixtures("nccl_group")]


@pytest.mark.parametrize("hidden,local", [(64, 32), (4096, 512)], ids=["small", "hidden_4096"])
def test_parallel_layers_fuse_their_producers(hidden, local):
    fused_checks.check_parallel_producers(dist.get_rank(), dist.get_world_size(), device="cuda", hidden=hidden,
                                          local=local, seq_per_rank=64)
