"""4over6 adaptive block scaling in the reference (docs/numerics.md §12): Transformer Engine's golden bytes,
hand-computed blocks, and an independent numpy transcription of §12 on inputs where the options disagree."""
import dataclasses
import json

import numpy as np
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.formats import fp4_code_values, unpack_fp4
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.reference import dequantize_tensor, quantize_tensor
from nvfp4_dist.reference.fourover6 import FourOverSix, candidate_products, quantize_blocks_4over6
from nvfp4_dist.reference.quantize import compute_amax, compute_row_amax, decode_scale, encode_scale
from tests.helpers.golden import assert_golden_bytes

CASES = [f"4over6_{dtype}_{tile}_{mode}_{bound}_{math}" for dtype in ("bf16", "fp32") for tile in ("1x16", "16x16")
         for mode in ("MAE", "MSE") for bound in (448, 256) for math in ("exact", "fast")]
ROW_SCALED_CASE = "4over6_bf16_rowscaled_MAE_256_exact"
ALL_OPTIONS = [FourOverSix(mode, bound, fast) for mode in ("MAE", "MSE") for bound in (448, 256)
               for fast in (False, True)]


def _case(golden, name):
    config = json.loads(str(golden[f"{name}/config"]))
    dtype = getattr(torch, str(golden[f"{name}/input_dtype"]).split(".")[1])
    x = torch.from_numpy(golden[f"{name}/input_f32"]).to(dtype)
    assert torch.equal(x.float(), torch.from_numpy(golden[f"{name}/input_f32"])), "input not exact in its dtype"
    options = FourOverSix(config["nvfp4_4over6_err_mode"], config["nvfp4_e4m3_max"],
                          config.get("nvfp4_4over6_err_use_fast_math", False))
    return config, x, options


@pytest.mark.parametrize("name", CASES)
def test_golden_4over6_both_copies(golden_v2, name):
    config, x, options = _case(golden_v2, name)
    q = quantize_tensor(x, block_2d=config["tile"] == [16, 16], four_over_six=options)
    assert q.e4m3_bound == options.e4m3_bound
    assert_golden_bytes(golden_v2, name, q, columnwise=True)


@pytest.mark.parametrize("name", CASES)
def test_golden_4over6_through_the_recipe(golden_v2, name):
    """The recipe's fields reach the quantizer: 16x16 cases as 2D weights, 1x16 cases as activations."""
    config, x, options = _case(golden_v2, name)
    is_weight = config["tile"] == [16, 16]
    scope = "weights" if is_weight else "activations"
    recipe = NVFP4Recipe(rht=False, nvfp4_4over6=scope,
                         nvfp4_4over6_e4m3_use_256=scope if options.e4m3_bound == 256 else "none",
                         nvfp4_4over6_err_mode=options.err_mode, nvfp4_4over6_err_use_fast_math=options.fast_math)
    q = nv.quantize(x, "weight" if is_weight else "activation", recipe=recipe)
    assert_golden_bytes(golden_v2, name, q, columnwise=True)


def test_golden_4over6_row_scaled(golden_v2):
    config, x, options = _case(golden_v2, ROW_SCALED_CASE)
    q = quantize_tensor(x, columnwise=False, row_scaled=True, four_over_six=options)
    assert_golden_bytes(golden_v2, ROW_SCALED_CASE, q, columnwise=False)
    assert np.array_equal(q.amax_rowwise.numpy(), golden_v2[f"{ROW_SCALED_CASE}/amax_col"])


def test_golden_v2_covers_every_case(golden_v2):
    names = {key.split("/")[0] for key in golden_v2.files}
    assert sorted(n for n in names if n.startswith("4over6")) == sorted(CASES + [ROW_SCALED_CASE])


# Hand-computed blocks. With B = 256 and A = 1536, S_enc = 1: a block whose max is 6 has base scale 1 (map to 6)
# and 1.5 (map to 4), and e_c = 1 / s_c.
UNIT_AMAX_256 = torch.tensor([1536.0])


def _block(values):
    block = torch.zeros(1, 16)
    block[0, :len(values)] = torch.tensor(values)
    return block


def test_tie_keeps_map_to_6():
    # 6 and 3 sit on both grids (6 = 4 * 1.5, 3 = 2 * 1.5): both errors are 0, so the map-to-6 candidate stays
    for options in ALL_OPTIONS:
        options = dataclasses.replace(options, e4m3_bound=256)
        data, scale = quantize_blocks_4over6(_block([6.0, 3.0, -6.0]), UNIT_AMAX_256, options)
        assert scale.float().item() == 1.0
        assert unpack_fp4(data)[0, :4].tolist() == [7, 5, 15, 0]


def test_map_to_4_wins_where_it_is_closer():
    # map to 6: 4.5 is a tie between 4 and 6 and rounds to 4 (error 0.5); map to 4: 4.5 / 1.5 = 3, exact
    for options in ALL_OPTIONS:
        options = dataclasses.replace(options, e4m3_bound=256)
        data, scale = quantize_blocks_4over6(_block([6.0, 4.5]), UNIT_AMAX_256, options)
        assert scale.float().item() == 1.5
        assert unpack_fp4(data)[0, :2].tolist() == [6, 5]  # 4 * 1.5 = 6 and 2 * 1.5 = 3 ... of 4.5 / 1.5 = 3
        assert dequantize_tensor(quantize_tensor(_block([6.0, 4.5]), columnwise=False, four_over_six=options,
                                                 amax_rowwise=UNIT_AMAX_256), torch.float32,
                                 "rowwise")[0, :2].tolist() == [6.0, 4.5]


def test_global_scale_bound_256():
    a = torch.tensor([3.7])
    assert encode_scale(a, 256).item() == torch.div(torch.tensor(1536.0), a).item()
    assert decode_scale(a, 256).item() == torch.div(torch.tensor(1.0), encode_scale(a, 256)).item()
    assert encode_scale(a).item() == encode_scale(a, 448).item() == torch.div(torch.tensor(2688.0), a).item()


def _order_sensitive_block_amax(amax):
    """A block amax next to an E4M3 rounding tie where div(a_b, 6) * S_enc and a_b * (S_enc * fp32(1/6)) round to
    different E4M3 scales (searched among the FP32 neighbours of 6 * m / S_enc for E4M3 midpoints m)."""
    s_enc = encode_scale(amax, 448)
    for midpoint in (1.0625, 1.1875, 2.125, 3.25, 5.5, 10.5, 13.0, 100.0, 208.0):
        center = torch.tensor([midpoint * 6.0]) / s_enc
        candidates = (center.view(torch.int32) + torch.arange(-64, 65)).view(torch.float32)
        divided = (torch.div(candidates, torch.tensor(6.0)) * s_enc).to(torch.float8_e4m3fn).view(torch.uint8)
        folded = (candidates * (s_enc * torch.tensor(1 / 6))).to(torch.float8_e4m3fn).view(torch.uint8)
        differ = divided != folded
        if differ.any():
            return candidates[differ][0].item(), divided[differ][0].item(), folded[differ][0].item()
    pytest.fail("no block amax tells the two orders apart")


def test_base_scale_divides_before_multiplying():
    # docs/numerics.md §12.2: base = div(a_b, 6) * S_enc, not a_b * (S_enc * fp32(1/6)) as in §2.3
    amax = torch.tensor([3.7])
    a_b, divided, folded = _order_sensitive_block_amax(amax)
    s_enc = encode_scale(amax, 448)
    map_to_4 = (torch.div(torch.tensor([a_b]), torch.tensor(6.0)) * s_enc * 1.5).to(torch.float8_e4m3fn)
    _, scale = quantize_blocks_4over6(_block([a_b]), amax, FourOverSix("MAE", 448))
    kept = scale.view(torch.uint8).item()
    assert kept in (divided, map_to_4.view(torch.uint8).item())
    assert kept != folded


def test_candidate_products_have_fp16_semantics():
    """fp4value * E4M3 scale in FP32 equals the product rounded to FP16 (with subnormals), for every code and scale
    byte; a NaN scale gives NaN."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    products = candidate_products(codes, scales)
    in_fp16 = (fp4_code_values()[None, :].double() * scales.double()[:, None]).to(torch.float16).float()
    finite = torch.isfinite(scales.float())
    assert torch.equal(products[finite], in_fp16[finite])
    assert torch.isnan(products[~finite]).all() and (~finite).sum().item() == 2  # 0x7F and 0xFF


def test_four_over_six_options_are_validated():
    for bad, message in ((dict(err_mode="L1"), "err_mode"), (dict(e4m3_bound=300), "e4m3_bound"),
                         (dict(fast_math=1), "fast_math")):
        with pytest.raises(ValueError, match=message):
            FourOverSix(**bad)
    x = torch.randn(32, 32).bfloat16()
    with pytest.raises(ValueError, match="stochastic"):
        quantize_tensor(x, four_over_six=FourOverSix(), sr_seed=1)
    with pytest.raises(ValueError, match="RHT"):
        quantize_tensor(x, rht=True, four_over_six=FourOverSix())
    with pytest.raises(ValueError, match="row-scaled"):
        quantize_tensor(x, row_scaled=True, four_over_six=FourOverSix())
    with pytest.raises(ValueError, match="FourOverSix"):
        quantize_tensor(x, four_over_six="MAE")


def test_dequantize_uses_the_bound():
    x = torch.randn(32, 64)
    for bound in (448, 256):
        q = quantize_tensor(x, four_over_six=FourOverSix("MSE", bound))
        for copy in ("rowwise", "columnwise"):
            error = (dequantize_tensor(q, torch.float32, copy) - x).abs().max().item()
            assert error < 0.2 * x.abs().max().item(), (bound, copy, error)


# An independent transcription of docs/numerics.md §12 in numpy float32 (every operation IEEE-rounded, in the order
# §12 gives), with its own E4M3 and E2M1 rounding, vectorized over blocks only.
_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_F32 = np.float32
_FLT_MAX = np.finfo(np.float32).max


def _np_e4m3(v):
    """Round non-negative float32 values <= 448 to E4M3, ties to even (subnormal quantum 2^-9)."""
    out = np.zeros_like(v)
    positive = v > 0
    _, exponent = np.frexp(v[positive])
    quantum = np.ldexp(_F32(1), np.maximum(exponent - 1, -6) - 3).astype(np.float32)
    out[positive] = np.round(v[positive] / quantum) * quantum
    return out


def _np_fp4(v):
    """(codes, values) of float32 values in [-6, 6], ties to the even code: thresholds of docs/numerics.md §2.5."""
    a = np.abs(v)
    magnitude = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0], range(7), 7)
    codes = magnitude + 8 * (v < 0)
    return codes.astype(np.uint8), np.where(v < 0, -_GRID[magnitude], _GRID[magnitude]).astype(np.float32)


def _np_errors(blocks, amax, scale, s_enc, s_dec, options):
    """Per-block error of one candidate: blocks [n, 16], amax/s_enc/s_dec [n, 1], scale [n]."""
    with np.errstate(divide="ignore", over="ignore"):
        encode = np.minimum(_F32(1) / (scale[:, None] * s_dec), _FLT_MAX)
        scaled = np.clip(blocks * encode, -6, 6)
    codes, values = _np_fp4(scaled)
    if options.fast_math:
        products = (values * scale[:, None]).astype(np.float16).astype(np.float32)
        differences = products - blocks * s_enc
    else:
        differences = (values * scale[:, None]) * amax / _F32(6 * options.e4m3_bound) - blocks
    total = np.zeros(blocks.shape[0], np.float32)
    for i in range(16):
        total = total + (differences[:, i] * differences[:, i] if options.err_mode == "MSE"
                         else np.abs(differences[:, i]))
    return codes, total


def _np_quantize(x, amax_rows, options, block_2d, tree=True):
    """(codes [M, K], scale bytes [M, K/16] as float32 values) of x [M, K] float32; amax_rows [M] (per row)."""
    rows, cols = x.shape
    blocks = x.reshape(rows * cols // 16, 16)
    amax = np.repeat(amax_rows, cols // 16)[:, None].astype(np.float32)
    with np.errstate(divide="ignore"):
        s_enc = np.minimum(_F32(6 * options.e4m3_bound) / amax, _FLT_MAX)
    s_enc = np.where(s_enc == 0, _F32(1), s_enc).astype(np.float32)
    s_dec = (_F32(1) / s_enc).astype(np.float32)
    if block_2d:
        tile_amax = np.abs(x).reshape(rows // 16, 16, cols // 16, 16).max(axis=(1, 3))
        block_amax = np.repeat(tile_amax, 16, axis=0).reshape(-1)
    else:
        block_amax = np.abs(blocks).max(axis=1)
    base = (block_amax / _F32(6)) * s_enc[:, 0]
    scale6 = _np_e4m3(np.minimum(base, 448).astype(np.float32))
    scale4 = _np_e4m3(np.minimum(base * _F32(1.5), 448).astype(np.float32))
    codes4, err4 = _np_errors(blocks, amax, scale4, s_enc, s_dec, options)
    codes6, err6 = _np_errors(blocks, amax, scale6, s_enc, s_dec, options)
    if block_2d:
        def tile_sums(err):
            per_row = err.reshape(rows // 16, 16, cols // 16)
            if not tree:
                total = per_row[:, 0]
                for r in range(1, 16):
                    total = total + per_row[:, r]
                return total
            for half in (8, 4, 2, 1):
                per_row = per_row[:, :half] + per_row[:, half:2 * half]
            return per_row[:, 0]
        pick4 = np.repeat(tile_sums(err4) < tile_sums(err6), 16, axis=0).reshape(-1)
    else:
        pick4 = err4 < err6
    codes = np.where(pick4[:, None], codes4, codes6).reshape(rows, cols)
    return codes, np.where(pick4, scale4, scale6).reshape(rows, cols // 16), pick4


def _tie_input(rows, cols, seed):
    """FP32 blocks whose two candidates' errors are equal in exact arithmetic, so that FP32 rounding decides:
    with B = 256 and S_enc near 1536 / 1.1, every element is 1.1 / 1536 times 6 (each 16x16 tile's max) or one of
    0.625, 0.875, 2.125, 4.25, 5.25, which lie as far from the map-to-6 grid as from the map-to-4 grid; random
    signs, and a power-of-two scale per 16x16 tile."""
    generator = torch.Generator().manual_seed(seed)
    ties = torch.tensor([0.625, 0.875, 2.125, 4.25, 5.25])
    t = ties[torch.randint(len(ties), (rows, cols), generator=generator)]
    t[::16, ::16] = 6.0
    signs = torch.where(torch.rand(rows, cols, generator=generator) < 0.5, -1.0, 1.0)
    tile_scale = torch.exp2(torch.randint(-3, 1, (rows // 16, cols // 16), generator=generator).float())
    tile_scale = tile_scale.repeat_interleave(16, dim=0).repeat_interleave(16, dim=1)
    return t * signs * tile_scale * torch.tensor(1.1 / 1536)


def _random_bf16_input(rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * torch.exp2(torch.randn(rows, 1, generator=generator))
            ).bfloat16().float()


def _reference_codes(x, amax, options, block_2d):
    data, scale = quantize_blocks_4over6(x, amax, options, block_2d=block_2d)
    return unpack_fp4(data).numpy(), scale.float().numpy()


@pytest.mark.parametrize("options", ALL_OPTIONS, ids=lambda o: f"{o.err_mode}-{o.e4m3_bound}-{'fast' if o.fast_math else 'exact'}")
@pytest.mark.parametrize("layout", ["1x16", "16x16", "rowscaled"])
@pytest.mark.parametrize("make_input", [_tie_input, _random_bf16_input])
def test_reference_equals_numpy_transcription(options, layout, make_input):
    x = make_input(64, 256, seed=3)
    block_2d, row_scaled = layout == "16x16", layout == "rowscaled"
    amax = compute_row_amax(x) if row_scaled else compute_amax(x)
    amax_rows = amax.numpy() if row_scaled else np.full(x.shape[0], amax.item(), np.float32)
    codes, scale = _reference_codes(x, amax, options, block_2d)
    expected_codes, expected_scale, _ = _np_quantize(x.numpy(), amax_rows, options, block_2d)
    assert np.array_equal(scale, expected_scale)
    assert np.array_equal(codes, expected_codes)


def test_numpy_transcription_tells_the_options_apart():
    """The inputs of the test above are ones where exact and fast-math errors, and the 2D tree and a sequential
    row sum, pick different candidates for some blocks, so that test fails for an implementation that mixes
    them up."""
    x = _tie_input(64, 256, seed=3).numpy()
    amax_rows = np.full(x.shape[0], np.abs(x).max(), np.float32)
    for mode in ("MAE", "MSE"):
        exact = _np_quantize(x, amax_rows, FourOverSix(mode, 256, False), False)[2]
        fast = _np_quantize(x, amax_rows, FourOverSix(mode, 256, True), False)[2]
        assert (exact != fast).any() and exact.any() and not exact.all(), mode
        tree = _np_quantize(x, amax_rows, FourOverSix(mode, 256), True)[2]
        sequential = _np_quantize(x, amax_rows, FourOverSix(mode, 256), True, tree=False)[2]
        assert (tree != sequential).any(), mode


@pytest.mark.parametrize("bounds", [(256, 448), (448, 256), (256, 256)], ids=str)
def test_gemm_uses_each_operands_bound(bounds, monkeypatch):
    """S_dec = amax / (6 B) per operand (docs/numerics.md §12.7): the GEMM of 4over6 tensors equals the float64
    product of their dequantized values, through nvfp4_dist.gemm and through the cuBLASLt path's arguments (with
    tests/test_blackwell_arguments.py's decoded stand-in for torch._scaled_mm)."""
    from nvfp4_dist.gemm import blackwell
    from tests.test_blackwell_arguments import DecodedScaledMM
    monkeypatch.setattr(torch, "_scaled_mm", DecodedScaledMM())
    a = quantize_tensor(_random_bf16_input(64, 128, seed=1), columnwise=False, four_over_six=FourOverSix("MAE", bounds[0]))
    b = quantize_tensor(_random_bf16_input(48, 128, seed=2), columnwise=False, block_2d=True,
                        four_over_six=FourOverSix("MSE", bounds[1]))
    expected = dequantize_tensor(a, torch.float64, "rowwise") @ dequantize_tensor(b, torch.float64, "rowwise").t()
    y = nv.gemm(a, b, out_dtype=torch.float32)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    call = blackwell.scaled_mm_arguments(a.rowwise_data, a.rowwise_scale, a.amax_rowwise, b.rowwise_data,
                                         b.rowwise_scale, b.amax_rowwise, a_e4m3_bound=bounds[0],
                                         b_e4m3_bound=bounds[1])
    through_cublaslt = blackwell.finish_scaled_mm(blackwell.run_scaled_mm(call), call)
    torch.testing.assert_close(through_cublaslt, y, rtol=2e-6, atol=2e-6 * y.abs().max().item())
