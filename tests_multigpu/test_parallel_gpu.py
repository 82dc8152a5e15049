"""The CPU multi-rank checks on GPUs with NCCL and the CUDA kernels, plus swap_first_dims kernel vs reference.

    torchrun --nproc-per-node 2 -m pytest tests_multigpu/test_parallel_gpu.py -q
    torchrun --nproc-per-node 4 -m pytest tests_multigpu/test_parallel_gpu.py -q

Layers run with the reference GEMM backend (on the GPU) so that they can be compared exactly with the
reference emulation; NCCL's BF16 sums over more than 2 ranks are checked within their rounding bound.
The quantized all-gather is checked byte for byte against quantizing the full tensor (CUDA kernels and
the CPU reference), through both the grouped (coalesced) NCCL launch and the packed byte buffer.
"""
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist import reference
from nvfp4_dist.parallel import ColumnParallelLinear

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_parallel_comm as comm_checks  # noqa: E402
import test_parallel_layers as layer_checks  # noqa: E402

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs GPUs"),
              pytest.mark.usefixtures("nccl_group")]
EXACT = nv.NVFP4Recipe(gemm_backend="reference")


def rank_and_size():
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.parametrize("packed", [False, True])
def test_quantized_all_gather_byte_exact(packed):
    comm_checks._check_comm(*rank_and_size(), device="cuda", packed=packed)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_column_parallel(sequence_parallel):
    layer_checks.check_column(*rank_and_size(), sequence_parallel, EXACT, device="cuda")


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_row_parallel(sequence_parallel):
    layer_checks.check_row(*rank_and_size(), sequence_parallel, EXACT, device="cuda")


def test_recipe_variants_and_options():
    rank, world_size = rank_and_size()
    layer_checks.check_column(rank, world_size, True, EXACT.replace(rht=False, weight_2d=False), device="cuda")
    layer_checks.check_row(rank, world_size, True, EXACT.replace(rht=False, weight_2d=False), device="cuda")
    layer_checks.check_options(rank, world_size, EXACT, device="cuda")
    layer_checks.check_row_scaled_and_megatron_hooks(rank, world_size, device="cuda", recipe_backend="reference")


def test_default_gemm_backend_layers_run():
    """With the fast GEMM the outputs stay within the TP=1 tolerances (exactness is shown above)."""
    rank, world_size = rank_and_size()
    recipe = nv.NVFP4Recipe()
    out_features = layer_checks.LOCAL_FEATURES * world_size
    x, dy, weight, bias = layer_checks.full_tensors(world_size, layer_checks.COLUMN_IN, out_features, "cuda")
    exact, fast = (ColumnParallelLinear(layer_checks.COLUMN_IN, out_features, sequence_parallel=True, recipe=r,
                                        device="cuda", init_method=lambda w: w.copy_(weight))
                   for r in (EXACT, recipe))
    x_local = x.chunk(world_size)[rank]
    dy_local = dy.chunk(world_size, dim=-1)[rank]
    results = [layer_checks.run(layer, x_local, dy_local) for layer in (exact, fast)]
    for what, e, f in zip(("y", "dx", "dW"), results[0], results[1]):
        distance = ((f.float() - e.float()).norm() / e.float().norm()).item()
        assert distance <= 8e-3, f"{what}: {distance:.2e}"


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("shape", [(64, 48), (4096, 2304), (16, 1)])
def test_swap_first_dims_kernel_matches_reference(world_size, shape):
    gathered = torch.randint(0, 256, (shape[0] * world_size, shape[1]), dtype=torch.uint8, device="cuda")
    expected = reference.swap_first_dims(gathered.cpu(), world_size)
    assert torch.equal(nv.swap_first_dims(gathered, world_size).cpu(), expected)
    scales = gathered.view(torch.float8_e4m3fn)
    assert torch.equal(nv.swap_first_dims(scales, world_size).view(torch.uint8).cpu(), expected)
