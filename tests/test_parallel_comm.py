"""Communication primitives on real gloo groups of 2 and 4 ranks: the quantized all-gather is byte-exact."""
import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist import reference
from nvfp4_dist.linear import operand_amaxes, quantize_operand
from nvfp4_dist.parallel import symmetric
from nvfp4_dist.parallel.layer_comm import ColumnParallelComm
from nvfp4_dist.parallel import (all_gather_bf16, all_gather_nvfp4, all_reduce_amax, all_reduce_bf16,
                                 reduce_scatter_bf16)
from tests.helpers.distributed import run_distributed

FIELDS = ("rowwise_data", "rowwise_scale", "amax_rowwise", "columnwise_data", "columnwise_scale", "amax_columnwise")


def assert_bytes_equal(got, expected, what):
    assert tuple(got.shape) == tuple(expected.shape), what
    for name in FIELDS:
        g, e = getattr(got, name), getattr(expected, name)
        assert (g is None) == (e is None), (what, name)
        if g is not None:
            assert g.dtype == e.dtype and g.shape == e.shape, (what, name, g.shape, e.shape)
            assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), (what, name)
    assert (got.rht, got.block_2d, got.row_scaled) == (expected.rht, expected.block_2d, expected.row_scaled), what


def sharded_then_gathered(local, role, recipe, rank, sr_seed, async_op, packed=None):
    """docs/numerics.md §9: reduce amaxes, quantize the shard (global SR positions), gather in NVFP4."""
    amaxes = list(operand_amaxes(local, role, recipe))
    all_reduce_amax(amaxes)
    q = quantize_operand(local, role, recipe, amax_rowwise=amaxes[0], amax_columnwise=amaxes[1], sr_seed=sr_seed,
                         sr_row_offset=rank * local.shape[0])
    if not async_op:
        return all_gather_nvfp4(q, packed=packed)
    handle, finish = all_gather_nvfp4(q, async_op=True, packed=packed)
    assert handle is not None or (not packed and symmetric.enabled()), "NCCL/gloo gathers return a handle"
    return finish()


CASES = [  # (role, recipe, dtype, async)
    ("activation", nv.NVFP4Recipe(), torch.bfloat16, False),
    ("activation", nv.NVFP4Recipe(rht=False), torch.bfloat16, True),
    ("gradient", nv.NVFP4Recipe(), torch.bfloat16, False),
    ("gradient", nv.NVFP4Recipe(rht=False), torch.bfloat16, True),
    ("gradient", nv.NVFP4Recipe(rht_random_sign=False), torch.float32, False),
    ("activation", nv.NVFP4Recipe(), torch.float16, True),
]


def _check_comm(rank, world_size, device="cpu", packed=None):
    """All checks on one rank; on GPUs the result is also compared with the CPU reference byte for byte."""
    local_rows, cols = 32, 48
    torch.manual_seed(0)
    full = (torch.randn(world_size * local_rows, cols) * torch.logspace(-2, 2, cols)).to(device)
    for index, (role, recipe, dtype, async_op) in enumerate(CASES):
        x = full.to(dtype)
        local = x.chunk(world_size)[rank]
        seed = 1234 + index
        got = sharded_then_gathered(local, role, recipe, rank, seed, async_op, packed)
        expected = quantize_operand(x, role, recipe, sr_seed=seed)
        assert_bytes_equal(got, expected, (role, recipe, dtype))
        if x.is_cuda:
            assert_bytes_equal(got.to("cpu"), quantize_operand(x.cpu(), role, recipe, sr_seed=seed), "vs CPU")

    # Row-scaled activations: no amax reduction, the per-row amaxes travel with their rows (docs/numerics.md §6).
    recipe = nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)
    x = full.to(torch.bfloat16)
    q = nv.quantize(x.chunk(world_size)[rank], "activation", columnwise=False, recipe=recipe)
    expected = nv.quantize(x, "activation", columnwise=False, recipe=recipe)
    assert_bytes_equal(all_gather_nvfp4(q, packed=packed), expected, "row-scaled")

    # Row-scaled with the columnwise (wgrad) copy (docs/numerics.md §6b): the column-parallel input's per-column
    # amaxes, a K-vector, are all-reduced (MAX) before quantizing, so the gathered copy equals the full tensor's;
    # without and with the RHT (and a local columnwise amax that differs from the reduced one).
    for rht in (False, True):
        recipe = nv.NVFP4Recipe(row_scaled_activation=True, rht=rht)
        local = x.chunk(world_size)[rank]
        q = ColumnParallelComm(None, sequence_parallel=True, keep_input_columnwise=False).quantize_input(
            local, recipe, columnwise=True)
        expected = nv.quantize(x, "activation", recipe=recipe)
        assert not torch.equal(nv.ops.compute_amaxes(local, recipe=recipe)[1], expected.amax_columnwise)
        assert_bytes_equal(all_gather_nvfp4(q, packed=packed), expected, ("row-scaled columnwise", rht))

    # amax all-reduce: MAX, in place, None entries left alone, one tensor per entry.
    a, b = torch.tensor([float(rank)], device=device), torch.tensor([10.0 - rank], device=device)
    result = all_reduce_amax([a, None, b])
    assert result[1] is None and a.item() == world_size - 1 and b.item() == 10.0

    # BF16 primitives.
    parts = [torch.full((4, 3), float(r + 1), dtype=torch.bfloat16, device=device) for r in range(world_size)]
    assert torch.equal(all_gather_bf16(parts[rank]), torch.cat(parts))
    handle, finish = all_gather_bf16(parts[rank], async_op=True)
    assert torch.equal(finish(), torch.cat(parts))
    ramp = torch.arange(world_size * 2 * 3, dtype=torch.bfloat16, device=device).reshape(world_size * 2, 3)
    stacked, total = ramp * (rank + 1), ramp * sum(r + 1 for r in range(world_size))
    assert torch.equal(reduce_scatter_bf16(stacked), total.chunk(world_size)[rank])
    assert torch.equal(all_reduce_bf16(stacked.clone()), total)
    with pytest.raises(ValueError, match="divisible"):
        reduce_scatter_bf16(torch.zeros(world_size + 1, 2, device=device))
    assert dist.get_world_size() == world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_quantized_all_gather_and_primitives(world_size):
    run_distributed(_check_comm, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_swap_first_dims_reference_builds_gathered_columnwise_copy(world_size):
    """Gathering per-rank [K, X] blocks into [W*K, X] then swapping gives the column concatenation [K, W*X]."""
    blocks = [torch.randint(0, 256, (8, 5), dtype=torch.uint8) for _ in range(world_size)]
    swapped = reference.swap_first_dims(torch.cat(blocks), world_size)
    assert torch.equal(swapped, torch.cat(blocks, dim=1))
    assert torch.equal(nv.swap_first_dims(torch.cat(blocks), world_size), swapped)
