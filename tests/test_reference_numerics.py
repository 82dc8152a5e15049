"""Hand-computed vectors and properties of the reference quantizer (docs/numerics.md sections 1-7)."""
import pytest
import torch

from nvfp4_dist.formats import FLT_MAX, fp4_to_float, pack_fp4, unpack_fp4
from nvfp4_dist.reference import (compute_row_amax, decode_scale, dequantize_blocks, dequantize_tensor,
                                  encode_scale, quantize_blocks, quantize_tensor)

UNIT_AMAX = torch.tensor([2688.0])  # S_enc = S_dec = 1, so a block whose max is 6 gets scale 1


def _codes_with_unit_scale(values):
    """Codes of `values` placed in a block with max 6 under a tensor amax of 2688 (scale 1, e_b = 1)."""
    block = torch.zeros(16)
    block[0] = 6.0
    block[1:1 + len(values)] = torch.tensor(values)
    data, scale = quantize_blocks(block.reshape(1, 16), UNIT_AMAX)
    assert scale.float().item() == 1.0
    return unpack_fp4(data)[0, 1:1 + len(values)].tolist()


def test_every_rounding_tie_goes_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    # 0.25->0, 0.75->1.0 (code 2), 1.25->1.0 (2), 1.75->2.0 (4), 2.5->2.0 (4), 3.5->4.0 (6), 5->4.0 (6)
    assert _codes_with_unit_scale(ties) == [0, 2, 2, 4, 4, 6, 6]
    assert _codes_with_unit_scale([-t for t in ties]) == [8, 10, 10, 12, 12, 14, 14]


def test_values_just_off_ties_round_to_nearest():
    assert _codes_with_unit_scale([0.2500001, 0.7499999, 1.2500001, 4.9999995, 5.0000005]) == [1, 1, 3, 6, 7]


def test_negative_zero_codes():
    # a small negative value rounding to zero gives -0 (code 8); -0.0 itself gives code 0
    assert _codes_with_unit_scale([-0.1, -0.0, 0.0, 0.1]) == [8, 0, 0, 0]


def test_grid_points_are_exact():
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert _codes_with_unit_scale(grid) == [0, 1, 2, 3, 4, 5, 6]


def test_saturation_at_six_when_scale_rounds_down():
    # block amax 6.2: s_b = e4m3(6.2/6 = 1.033) = 1.0, so 6.2 * e_b = 6.2 clamps to 6 (code 7)
    block = torch.zeros(1, 16)
    block[0, 0], block[0, 1] = 6.2, -6.2
    data, scale = quantize_blocks(block, UNIT_AMAX)
    assert scale.float().item() == 1.0
    assert unpack_fp4(data)[0, :2].tolist() == [7, 15]


def test_largest_block_gets_scale_448():
    x = torch.tensor([[1000.0] + [1.0] * 15])
    data, scale = quantize_blocks(x, torch.tensor([1000.0]))
    assert scale.view(torch.uint8).item() == 0x7E and scale.float().item() == 448.0
    assert unpack_fp4(data)[0, 0].item() == 7


def test_block_scale_is_clamped_to_448():
    # an amax supplied smaller than the data (a wrong reduction) must still give finite scales
    x = torch.full((1, 16), 100.0)
    _, scale = quantize_blocks(x, torch.tensor([1.0]))
    assert scale.float().item() == 448.0


def test_global_scale_special_cases():
    assert encode_scale(torch.tensor([0.0])).item() == FLT_MAX
    assert encode_scale(torch.tensor([float("inf")])).item() == 1.0
    # correctly rounded 2688 / A, not reciprocal(A) * 2688
    a = torch.tensor([3.7], dtype=torch.float32)
    assert encode_scale(a).item() == torch.div(torch.tensor(2688.0), a).item()
    assert decode_scale(a).item() == torch.div(torch.tensor(1.0), encode_scale(a)).item()


def test_all_zero_input_gives_zero_codes():
    q = quantize_tensor(torch.zeros(32, 32))
    assert q.rowwise_data.eq(0).all() and q.columnwise_data.eq(0).all()
    assert q.rowwise_scale.float().eq(0).all()
    assert dequantize_tensor(q, torch.float32, "rowwise").eq(0).all()


def test_nibble_order_low_first():
    codes = torch.tensor([[2, 4, 15, 1]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x42, 0x1F]]
    assert torch.equal(unpack_fp4(packed), codes)
    assert fp4_to_float(packed).tolist() == [[1.0, 2.0, -6.0, 0.5]]


def _half_gap(v):
    a = v.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_error_bound(dtype):
    torch.manual_seed(0)
    x = (torch.randn(64, 256) * torch.logspace(-3, 3, 256)).to(dtype)
    amax = x.float().abs().amax().reshape(1)
    data, scale = quantize_blocks(x, amax)
    back = dequantize_blocks(data, scale, amax)
    s_block = (scale.float() * decode_scale(amax)).repeat_interleave(16, dim=1)
    v = x.float() / s_block.clamp(min=1e-30)
    # rounding on the FP4 grid, plus what clamping to +-6 cuts off where the E4M3 scale rounded down (or to 0)
    bound = 1.0001 * _half_gap(v) * s_block + (x.float().abs() - 6 * s_block).clamp(min=0)
    assert ((x.float() - back).abs() <= bound).all()


def test_2d_columnwise_is_transpose_of_rowwise():
    torch.manual_seed(1)
    w = torch.randn(64, 96)
    q = quantize_tensor(w, block_2d=True)
    assert torch.equal(unpack_fp4(q.columnwise_data), unpack_fp4(q.rowwise_data).t())
    tile_scales = q.rowwise_scale.view(torch.uint8)[::16]                       # [N/16, K/16]
    assert torch.equal(q.rowwise_scale.view(torch.uint8), tile_scales.repeat_interleave(16, 0))
    assert torch.equal(q.columnwise_scale.view(torch.uint8), tile_scales.t().repeat_interleave(16, 0))


def test_row_scaled_uses_each_rows_amax():
    torch.manual_seed(2)
    x = (torch.randn(8, 64) * torch.logspace(-2, 2, 8)[:, None]).to(torch.bfloat16)
    q = quantize_tensor(x, columnwise=False, row_scaled=True)
    assert torch.equal(q.amax_rowwise, compute_row_amax(x))
    for r in range(8):
        data, scale = quantize_blocks(x[r:r + 1], q.amax_rowwise[r:r + 1])
        assert torch.equal(data, q.rowwise_data[r:r + 1])
        assert torch.equal(scale.view(torch.uint8), q.rowwise_scale[r:r + 1].view(torch.uint8))
    # every row reaches the full FP4 range, whatever its magnitude
    assert (q.rowwise_scale.float().amax(dim=1) == 448.0).all()
