"""RHT (docs/numerics.md §5) and stochastic rounding (docs/numerics.md §7) properties of the reference."""
import torch

import nvfp4_dist as nv
from nvfp4_dist.formats import FP4_MAGNITUDES, fp4_to_float
from nvfp4_dist.reference import (dequantize_blocks, hadamard_16, inverse_rht_chunks, inverse_rht_transpose,
                                  philox4x32, quantize_blocks, quantize_tensor, rht_chunks, rht_matrix, rht_transpose)
from nvfp4_dist.reference.quantize import decode_scale


def test_hadamard_and_rht_are_orthogonal():
    h16 = hadamard_16()
    assert torch.equal(h16 @ h16.t(), 16 * torch.eye(16))
    for random_sign in (True, False):
        h = rht_matrix(random_sign)
        assert torch.equal(h @ h.t(), torch.eye(16))
    assert rht_matrix(True)[:, 0].tolist() == [v / 4 for v in (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)]


def test_rht_butterflies_are_the_matrix_product():
    """Exact where no sum rounds (small integers); where sums round, the butterfly order decides, and it
    differs from a matmul's (so the order is a real part of the definition)."""
    generator = torch.Generator().manual_seed(2)
    small = torch.randint(-64, 64, (1000, 16), generator=generator).float()
    for random_sign in (True, False):
        h = rht_matrix(random_sign)
        assert torch.equal(rht_chunks(small, random_sign), small @ h)
        assert torch.equal(inverse_rht_chunks(small, random_sign), small @ h.t())
    wide = (torch.randn(20000, 16, generator=generator)
            * torch.exp2(torch.randint(-30, 30, (20000, 16), generator=generator).float())).to(torch.bfloat16).float()
    exact = wide.double() @ rht_matrix().double()
    error_bound = 4 * 2.0 ** -24 * (wide.double().abs() @ rht_matrix().double().abs())  # 4 rounded levels
    assert ((rht_chunks(wide).double() - exact).abs() <= error_bound).all()
    assert not torch.equal(rht_chunks(wide), wide @ rht_matrix())
    signs = torch.tensor([-0.0, 0.0] * 8)
    assert not torch.signbit(rht_chunks(signs)).any() and not torch.signbit(inverse_rht_chunks(signs)).any()


def test_rht_preserves_wgrad_product():
    torch.manual_seed(0)
    dy = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(64, 48).to(torch.bfloat16)
    exact = dy.double().t() @ x.double()
    transformed = rht_transpose(dy).double() @ rht_transpose(x).double().t()
    assert (transformed - exact).norm() / exact.norm() < 1e-2     # BF16 rounding of the transformed operands
    assert torch.allclose(inverse_rht_transpose(rht_transpose(x)), x.float(), rtol=1e-2, atol=1e-2)


def test_rht_columnwise_copy_dequantizes_back():
    torch.manual_seed(1)
    x = torch.randn(64, 32).to(torch.bfloat16)
    q = quantize_tensor(x, rht=True)
    back = nv.dequantize(q, torch.float32, copy="columnwise")
    assert (back - x.float()).norm() / x.float().norm() < 0.15
    assert q.amax_columnwise.item() == rht_transpose(x).float().abs().max().item()


def test_philox_known_answers():
    # Random123's kat_vectors for philox4x32_10
    zero = [torch.tensor(0)] * 4
    assert [int(w) for w in philox4x32(zero, (0, 0))] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    pi = [torch.tensor(v) for v in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)]
    assert [int(w) for w in philox4x32(pi, (0xA4093822, 0x299F31D0))] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_sr_bits_grid_equals_per_element_bits():
    from nvfp4_dist.reference import stochastic_rounding_bits, stochastic_rounding_bits_grid
    for row_offset, col_offset in ((0, 0), (16, 5), (3, 13)):
        rows = torch.arange(7)[:, None].expand(7, 29) + row_offset
        cols = torch.arange(29)[None, :].expand(7, 29) + col_offset
        expected = stochastic_rounding_bits(rows, cols, 1, 2 ** 40 + 3)
        assert torch.equal(stochastic_rounding_bits_grid(7, 29, row_offset, col_offset, 1, 2 ** 40 + 3), expected)


def _scaled_values(x, amax):
    """x * e_b clamped: the exact values that the FP4 rounding sees."""
    _, scale = quantize_blocks(x, amax)
    denominator = scale.float() * decode_scale(amax)
    encode = torch.div(torch.ones_like(denominator), denominator)
    return (x.reshape(x.shape[0], -1, 16) * encode[:, :, None]).clamp(-6, 6).reshape(x.shape)


def test_sr_outputs_are_neighbours():
    torch.manual_seed(2)
    x = torch.randn(32, 64)
    amax = x.abs().amax().reshape(1)
    v = _scaled_values(x, amax)
    data, _ = quantize_blocks(x, amax, sr_seed=1234)
    q = fp4_to_float(data)
    mags = torch.tensor(FP4_MAGNITUDES)
    lower = mags[(torch.bucketize(v.abs(), mags, right=True) - 1).clamp(0, 7)]
    upper = mags[torch.bucketize(v.abs(), mags, right=False).clamp(0, 7)]
    assert ((q.abs() == lower) | (q.abs() == upper)).all()
    assert (torch.sign(q) * torch.sign(v) >= 0).all()


def test_sr_is_unbiased_and_beats_round_to_nearest_on_average():
    torch.manual_seed(3)
    x = torch.randn(16, 64)
    amax = x.abs().amax().reshape(1)
    draws = torch.stack([dequantize_blocks(*quantize_blocks(x, amax, sr_seed=seed), amax) for seed in range(400)])
    sr_mean_error = (draws.mean(0) - x).abs().mean()
    rn_error = (dequantize_blocks(*quantize_blocks(x, amax), amax) - x).abs().mean()
    assert sr_mean_error < 0.25 * rn_error


def test_sr_reproducible_from_seed_and_draws_differ():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    amax = x.abs().amax().reshape(1)
    a, _ = quantize_blocks(x, amax, sr_seed=7)
    b, _ = quantize_blocks(x, amax, sr_seed=7)
    c, _ = quantize_blocks(x, amax, sr_seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sr_shard_equals_slice_of_full_tensor():
    torch.manual_seed(5)
    x = torch.randn(64, 48).to(torch.bfloat16)
    full = quantize_tensor(x, rht=True, sr_seed=99)
    shard = quantize_tensor(x[16:48], rht=True, sr_seed=99, sr_row_offset=16,
                            amax_rowwise=full.amax_rowwise, amax_columnwise=full.amax_columnwise)
    assert torch.equal(shard.rowwise_data, full.rowwise_data[16:48])
    assert torch.equal(shard.columnwise_data, full.columnwise_data[:, 8:24])
    assert torch.equal(shard.columnwise_scale.view(torch.uint8), full.columnwise_scale.view(torch.uint8)[:, 1:3])
