"""The CPU multi-rank checks on GPUs with NCCL and the CUDA kernels, plus swap_first_dims kernel vs reference.

    torchrun --nproc-per-node 2 -m pytest tests_multigpu/test_parallel_gpu.py -q
    torchrun --nproc-per-node 4 -m pytest tests_multigpu/test_parallel_gpu.py -q

Layers run with the reference GEMM backend (on the GPU) so that they can be compared exactly with the
reference emulation; NCCL's BF16 sums over more than 2 ranks are checked within their rounding bound.
The quantized all-gather is checked byte for byte against quantizing the full tensor (CUDA kernels and
the CPU reference), through both the grouped (coalesced) NCCL launch and the packed byte buffer.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist import reference
from nvfp4_dist.parallel import ColumnParallelLinear
from tests import test_parallel_comm as comm_checks
from tests import test_parallel_layers as layer_checks
from tests.helpers import oracle as O
from tests.helpers.emulation import draw_seed_like_backward, linear_magnitudes

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
    """With the fast GEMM backend, the column-parallel SP layer equals the reference-GEMM layer (exact, shown above)
    within the backends' difference, element by element: per GEMM both BF16 roundings and the accumulation allowance
    on its sum of |terms| (oracle.backend_difference_bound); the input gradient is a reduce-scatter of such
    partials, NCCL's order alike in both runs, each of its W - 1 BF16 roundings applied to different addends."""
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
    torch.manual_seed(layer_checks.BACKWARD_SEED)
    magnitudes = linear_magnitudes(x.reshape(-1, layer_checks.COLUMN_IN), weight.chunk(world_size)[rank],
                                   dy_local.reshape(-1, dy_local.shape[-1]), recipe, draw_seed_like_backward("cuda"))
    (y0, dx0, dw0), (y1, dx1, dw1) = (r[:3] for r in results)
    for what, e, f, unit in (("y", y0, y1, O.BF16_UNIT_ROUNDOFF), ("dW", dw0, dw1, O.FP32_UNIT_ROUNDOFF)):
        value = O.as_float32(e).astype(np.float64)
        O.check_within(what, f, value, O.backend_difference_bound(value, magnitudes[what], unit))
    partial = torch.from_numpy(magnitudes["dx"]).to("cuda")  # this rank's dgrad partial: |partial| <= magnitude
    total = partial.clone()
    dist.all_reduce(total)
    per_partial = O.backend_difference_bound(total.cpu().numpy(), total.cpu().numpy())
    bound = per_partial + 2 * (world_size - 1) * O.BF16_UNIT_ROUNDOFF * 1.01 * total.cpu().numpy()
    rows = np.array_split(bound, world_size, axis=0)[rank]
    O.check_within("dx", dx1, O.as_float32(dx0).astype(np.float64), rows)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("shape", [(64, 48), (4096, 2304), (16, 1)])
def test_swap_first_dims_kernel_matches_reference(world_size, shape):
    gathered = torch.randint(0, 256, (shape[0] * world_size, shape[1]), dtype=torch.uint8, device="cuda")
    expected = reference.swap_first_dims(gathered.cpu(), world_size)
    assert torch.equal(nv.swap_first_dims(gathered, world_size).cpu(), expected)
    scales = gathered.view(torch.float8_e4m3fn)
    assert torch.equal(nv.swap_first_dims(scales, world_size).view(torch.uint8).cpu(), expected)
