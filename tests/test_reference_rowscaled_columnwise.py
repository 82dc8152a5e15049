"""The columnwise copy of a row-scaled activation in the reference (docs/numerics.md §6b): one amax per row of x^T
(after the RHT), Transformer Engine's golden bytes, the wgrad GEMM's per-column scale, and sharding along tokens."""
import json

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.reference import (compute_amaxes, dequantize_blocks, dequantize_tensor, gemm_reference,
                                  quantize_tensor, rht_transpose, swap_first_dims)
from nvfp4_dist.reference.quantize import decode_scale
from tests.helpers.golden import assert_golden_bytes

CASES = ["rowscaled_columnwise_bf16_128x256", "rowscaled_columnwise_bf16_128x256_rht",
         "rowscaled_columnwise_bf16_128x256_rht_nosign"]


def _case(golden, name):
    config = json.loads(str(golden[f"{name}/config"]))
    x = torch.from_numpy(golden[f"{name}/input_f32"]).to(torch.bfloat16)
    assert torch.equal(x.float(), torch.from_numpy(golden[f"{name}/input_f32"])), "input not exact in BF16"
    return config, x


@pytest.mark.parametrize("name", CASES)
def test_golden_row_scaled_with_columnwise_copy(golden_v2, name):
    config, x = _case(golden_v2, name)
    q = quantize_tensor(x, row_scaled=True, rht=config["with_rht"], rht_random_sign=config["with_random_sign_mask"])
    assert q.amax_rowwise.shape == (x.shape[0],) and q.amax_columnwise.shape == (x.shape[1],)
    assert_golden_bytes(golden_v2, name, q)


def test_golden_through_the_public_quantize(golden_v2):
    _, x = _case(golden_v2, CASES[0])
    recipe = NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)
    assert_golden_bytes(golden_v2, CASES[0], nv.quantize(x, "activation", recipe=recipe))


@pytest.mark.parametrize("rht", [False, True])
def test_column_amax_is_taken_after_the_rht(rht):
    x = torch.randn(64, 48).bfloat16()
    _, amax_col = compute_amaxes(x, rowwise=False, row_scaled=True, rht=rht)
    source = rht_transpose(x) if rht else x.t()
    assert torch.equal(amax_col, source.float().abs().amax(dim=1))
    assert amax_col.shape == (48,)


def test_columnwise_copy_dequantizes_with_its_column_amaxes():
    x = torch.randn(64, 48) * torch.logspace(-3, 3, 48)  # columns of very different magnitude
    q = quantize_tensor(x, row_scaled=True)
    x_t = dequantize_blocks(q.columnwise_data, q.columnwise_scale, q.amax_columnwise)
    assert torch.equal(dequantize_tensor(q, torch.float32, "columnwise"), x_t.t())
    relative = ((x_t.t() - x).abs().amax(dim=0) / x.abs().amax(dim=0))
    assert relative.max().item() < 0.2  # each column keeps its own scale, however small


def test_wgrad_reference_gemm_scales_output_columns():
    """dW = dy^T . x with x's columnwise copy row-scaled: output column k carries S_dec(amax_col[k])."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 32, generator=generator) * torch.logspace(-2, 2, 32)).bfloat16()
    dy = torch.randn(64, 48, generator=generator).bfloat16()
    xq = quantize_tensor(x, rowwise=False, row_scaled=True)
    dyq = quantize_tensor(dy, rowwise=False)
    dw = gemm_reference(dyq.columnwise_data, dyq.columnwise_scale, dyq.amax_columnwise,
                        xq.columnwise_data, xq.columnwise_scale, xq.amax_columnwise)
    dy_t = dequantize_blocks(dyq.columnwise_data, dyq.columnwise_scale, dyq.amax_columnwise).double()
    x_t = dequantize_blocks(xq.columnwise_data, xq.columnwise_scale, xq.amax_columnwise).double()
    expected = dy_t @ x_t.t()
    assert dw.shape == (48, 32)
    assert torch.allclose(dw.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    # and it is the unit-global-scale product times the per-column factor amax_col / 2688
    unit = gemm_reference(dyq.columnwise_data, dyq.columnwise_scale, dyq.amax_columnwise, xq.columnwise_data,
                          xq.columnwise_scale, torch.full_like(xq.amax_columnwise, 2688.0))
    assert torch.allclose(dw, unit * decode_scale(xq.amax_columnwise)[None, :], rtol=1e-6, atol=0)


@pytest.mark.parametrize("rht", [False, True])
def test_shards_with_reduced_column_amaxes_gather_to_the_full_copy(rht):
    """Sequence parallelism (docs/numerics.md §6b): each token shard quantizes with the MAX over shards of the
    per-column amaxes; the gathered columnwise copy (swap_first_dims) equals quantizing the full tensor."""
    world = 4
    x = (torch.randn(128, 48) * torch.logspace(-2, 2, 48)).bfloat16()
    full = quantize_tensor(x, row_scaled=True, rht=rht)
    shards = x.chunk(world)
    local = [compute_amaxes(s, rowwise=False, row_scaled=True, rht=rht)[1] for s in shards]
    reduced = torch.stack(local).amax(dim=0)
    assert torch.equal(reduced, full.amax_columnwise)
    pieces = [quantize_tensor(s, row_scaled=True, rht=rht, amax_columnwise=reduced) for s in shards]
    data = swap_first_dims(torch.cat([p.columnwise_data for p in pieces]), world)
    scale = swap_first_dims(torch.cat([p.columnwise_scale.view(torch.uint8) for p in pieces]), world)
    assert torch.equal(data, full.columnwise_data)
    assert torch.equal(scale, full.columnwise_scale.view(torch.uint8))
    assert torch.equal(torch.cat([p.rowwise_data for p in pieces]), full.rowwise_data)
    assert not torch.equal(local[0], reduced)  # the reduction matters for this input


def test_row_scaled_combinations_that_stay_refused():
    x = torch.randn(32, 32).bfloat16()
    with pytest.raises(ValueError, match="stochastic"):
        quantize_tensor(x, row_scaled=True, sr_seed=1)
    with pytest.raises(ValueError, match="block_2d"):
        quantize_tensor(x, row_scaled=True, block_2d=True)
    recipe = NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False)
    with pytest.raises(ValueError, match="amax_columnwise"):
        nv.quantize(x, recipe=recipe, amax_columnwise=torch.ones(1))
    q = nv.quantize(x, recipe=recipe, amax_columnwise=torch.full((32,), 4.0))
    assert torch.equal(q.amax_columnwise, torch.full((32,), 4.0))
    assert torch.equal(q.rowwise_data, quantize_tensor(x, columnwise=False, row_scaled=True).rowwise_data)


def test_wgrad_through_gemm():
    """nvfp4_dist.gemm takes B with one amax per row (the reference backend here; the cuBLASLt path's arguments:
    tests/test_blackwell_arguments.py)."""
    x = (torch.randn(128, 64) * torch.logspace(-2, 2, 64)).bfloat16()
    dy = torch.randn(128, 48).bfloat16()
    xq = quantize_tensor(x, rowwise=False, row_scaled=True)
    dyq = quantize_tensor(dy, rowwise=False)
    args = (dyq.columnwise_data, dyq.columnwise_scale, dyq.amax_columnwise,
            xq.columnwise_data, xq.columnwise_scale, xq.amax_columnwise)
    expected = gemm_reference(*args)
    assert torch.equal(nv.gemm(dyq, xq, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32), expected)
