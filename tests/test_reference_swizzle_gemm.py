"""128x4 scale swizzle (docs/numerics.md §8), swap_first_dims (docs/numerics.md §9) and the reference GEMM."""
import pytest
import torch

from nvfp4_dist.reference import (dequantize_tensor, gemm_reference, padded_scale_shape, quantize_tensor,
                                  swap_first_dims, swizzle_offset, swizzle_scales, unswizzle_scales)


@pytest.mark.parametrize("rows,cols", [(128, 4), (200, 9), (300, 17), (1, 1)])
def test_swizzle_round_trip_and_offsets(rows, cols):
    raw = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    scale = raw.view(torch.float8_e4m3fn)
    swizzled = swizzle_scales(scale)
    padded_rows, padded_cols = padded_scale_shape(rows, cols)
    assert swizzled.numel() == padded_rows * padded_cols
    assert torch.equal(unswizzle_scales(swizzled, rows, cols).view(torch.uint8), raw)
    flat = swizzled.view(torch.uint8)
    generator = torch.Generator().manual_seed(rows)
    for _ in range(50):
        r = int(torch.randint(rows, (1,), generator=generator))
        c = int(torch.randint(cols, (1,), generator=generator))
        assert flat[swizzle_offset(r, c, padded_cols)] == raw[r, c]
    assert int(flat.ne(0).sum()) == rows * cols  # padding is zeros


def test_swizzle_offsets_by_hand():
    assert swizzle_offset(0, 0, 4) == 0
    assert swizzle_offset(1, 0, 4) == 16
    assert swizzle_offset(32, 0, 4) == 4
    assert swizzle_offset(0, 3, 4) == 3
    assert swizzle_offset(0, 4, 8) == 512
    assert swizzle_offset(128, 0, 8) == 1024


def test_swap_first_dims():
    world, k, x = 3, 4, 5
    per_rank = [torch.arange(k * x).reshape(k, x) + 100 * r for r in range(world)]
    gathered = torch.cat(per_rank, dim=0)
    assert torch.equal(swap_first_dims(gathered, world), torch.cat(per_rank, dim=1))


def _operands(m, n, k, seed):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator) * 3
    b = torch.randn(n, k, generator=generator) / 5
    return a, b


@pytest.mark.parametrize("m,n,k", [(32, 48, 64), (16, 16, 256)])
def test_gemm_reference_matches_float64(m, n, k):
    a, b = _operands(m, n, k, m)
    qa, qb = quantize_tensor(a, columnwise=False), quantize_tensor(b, columnwise=False, block_2d=True)
    y = gemm_reference(qa.rowwise_data, qa.rowwise_scale, qa.amax_rowwise,
                       qb.rowwise_data, qb.rowwise_scale, qb.amax_rowwise)
    exact = dequantize_tensor(qa, torch.float64, "rowwise") @ dequantize_tensor(qb, torch.float64, "rowwise").t()
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_gemm_reference_row_scaled():
    a, b = _operands(32, 16, 64, 7)
    a = a * torch.logspace(-3, 3, 32)[:, None]
    qa = quantize_tensor(a.to(torch.bfloat16), columnwise=False, row_scaled=True)
    qb = quantize_tensor(b, columnwise=False)
    y = gemm_reference(qa.rowwise_data, qa.rowwise_scale, qa.amax_rowwise,
                       qb.rowwise_data, qb.rowwise_scale, qb.amax_rowwise)
    exact = dequantize_tensor(qa, torch.float64, "rowwise") @ dequantize_tensor(qb, torch.float64, "rowwise").t()
    row_tolerance = 1e-5 * exact.abs().amax(dim=1, keepdim=True)   # rows span six decades
    assert ((y.double() - exact).abs() <= row_tolerance).all()
