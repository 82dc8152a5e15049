"""The 4over6 element numerics of the kernels (csrc/nvfp4_numerics.cuh, host-compiled with nvcc) equal the reference
(nvfp4_dist/reference/fourover6.py) byte for byte: candidates, errors, choice, the 16x16 tree, the bound 256."""
import ctypes
import json

import numpy as np
import pytest
import torch

from nvfp4_dist.reference.fourover6 import FourOverSix, quantize_blocks_4over6
from nvfp4_dist.reference.quantize import compute_amax, compute_row_amax
from tests.helpers.host_harness import compile_harness, needs_nvcc, pointer
from tests.test_reference_fourover6 import ALL_OPTIONS, CASES, ROW_SCALED_CASE, _random_bf16_input, _tie_input


# Host entry point over csrc/nvfp4_numerics.cuh's 4over6 functions, composed as csrc/quantize_4over6.cu composes
# them: one block's candidates, the choice (1x16), or the 16 rows' tree-summed errors (16x16); in the exact error mode
# the estimated errors first, the exact ones where the estimates do not settle the choice (counted). by_conversion:
# the codes and FP4 values as the Blackwell builds take them (the model of their FP4 conversions).
HARNESS = r"""
#include <type_traits>
#include "nvfp4_numerics.cuh"
using namespace nvfp4;
long blocks_seen = 0, blocks_redone = 0;
template <bool kMSE, bool kFast, bool kSixteen, bool kConversion>
void quantize(const float* x, long rows, long cols, const float* amax, long amax_count, float bound, int block_2d,
              unsigned char* codes, unsigned char* scales) {
  const long blocks = cols / kBlockSize;
  for (long r0 = 0; r0 < rows; r0 += block_2d ? kBlockSize : 1) {
    const int group = block_2d ? kBlockSize : 1;
    for (long b = 0; b < blocks; ++b) {
      float tile_amax = 0.0f;
      for (int g = 0; g < group; ++g)
        for (int i = 0; i < kBlockSize; ++i) tile_amax = fmaxf(tile_amax, fabsf(x[(r0 + g) * cols + b * kBlockSize + i]));
      FourOverSixCandidates c[kBlockSize];
      float errors[2][kBlockSize] = {}, block_amaxes[kBlockSize] = {}, choice_errors[2];
      float values[kBlockSize][kBlockSize];
      for (int g = 0; g < group; ++g) {
        for (int i = 0; i < kBlockSize; ++i) {
          values[g][i] = x[(r0 + g) * cols + b * kBlockSize + i];
          block_amaxes[g] = fmaxf(block_amaxes[g], fabsf(values[g][i]));
        }
      }
      const auto candidates = [&](auto estimate) {
        for (int g = 0; g < group; ++g) {
          const FourOverSixScale global = four_over_six_scale(amax[amax_count == 1 ? 0 : r0 + g], bound);
          c[g] = four_over_six_candidates<kMSE, kFast, kSixteen, decltype(estimate)::value, kConversion>(
              values[g], block_2d ? tile_amax : block_amaxes[g], global);
          errors[0][g] = c[g].error[0];
          errors[1][g] = c[g].error[1];
        }
        for (int k = 0; k < 2; ++k) choice_errors[k] = block_2d ? four_over_six_tile_error(errors[k]) : errors[k][0];
      };
      candidates(std::integral_constant<bool, !kFast>{});
      ++blocks_seen;
      const float a = block_2d ? tile_amax : block_amaxes[0];
      const auto slack = [&](float error) {
        return block_2d ? four_over_six_error_slack<kMSE, true>(a, error) : four_over_six_error_slack<kMSE, false>(a, error);
      };
      if (!kFast && !four_over_six_settled(choice_errors[0], choice_errors[1], slack(choice_errors[0]),
                                           slack(choice_errors[1]))) {
        ++blocks_redone;
        candidates(std::false_type{});
      }
      const int choice = four_over_six_choice(choice_errors[0], choice_errors[1]);
      for (int g = 0; g < group; ++g) {
        const long r = r0 + g;
        std::memcpy(codes + r * (cols / 2) + b * (kBlockSize / 2), &c[g].packed[choice], sizeof(uint2));
        scales[r * blocks + b] = static_cast<unsigned char>(c[g].scale[choice]);
      }
    }
  }
}
template <bool kMSE, bool kFast, bool kSixteen>
void quantize_by(int by_conversion, const float* x, long rows, long cols, const float* amax, long amax_count,
                 float bound, int block_2d, unsigned char* codes, unsigned char* scales) {
  if (by_conversion) {
    quantize<kMSE, kFast, kSixteen, true>(x, rows, cols, amax, amax_count, bound, block_2d, codes, scales);
  } else {
    quantize<kMSE, kFast, kSixteen, false>(x, rows, cols, amax, amax_count, bound, block_2d, codes, scales);
  }
}
extern "C" void quantize_4over6(const float* x, long rows, long cols, const float* amax, long amax_count, float bound,
                                int mse, int fast, int sixteen_bit, int block_2d, int by_conversion,
                                unsigned char* codes, unsigned char* scales) {
  const int variant = (mse ? 4 : 0) | (fast ? 2 : 0) | (sixteen_bit ? 1 : 0);
  const int c = by_conversion;
  switch (variant) {
    case 0: quantize_by<false, false, false>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
    case 1: quantize_by<false, false, true>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
    case 2: quantize_by<false, true, false>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
    case 3: quantize_by<false, true, true>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
    case 4: quantize_by<true, false, false>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
    case 5: quantize_by<true, false, true>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
    case 6: quantize_by<true, true, false>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
    default: quantize_by<true, true, true>(c, x, rows, cols, amax, amax_count, bound, block_2d, codes, scales); break;
  }
}
extern "C" long division_mismatches(float c) {  // divide_by_exact_constant against a / c, every significand in [1, 4)
  const float reciprocal = four_over_six_scale(1.0f, c / 6.0f).reciprocal;
  long mismatches = 0;
  for (uint32_t bits = 0x3F800000u; bits < 0x40800000u; ++bits) {
    const float a = bits_float(bits);
    mismatches += float_bits(divide_by_exact_constant(a, c, reciprocal)) != float_bits(a / c);
  }
  return mismatches;
}
extern "C" void redone_blocks(long* out) {  // blocks (1x16) or tiles (16x16) seen and redone exactly since the last call
  out[0] = blocks_seen;
  out[1] = blocks_redone;
  blocks_seen = blocks_redone = 0;
}
extern "C" float scale_reciprocal(float bound) { return four_over_six_scale(1.0f, bound).reciprocal; }
extern "C" float base_scale(float block_amax, float s_enc) { return four_over_six_base_scale(block_amax, s_enc); }
extern "C" float tile_error(const float* row_errors) {
  float rows[kBlockSize];
  for (int r = 0; r < kBlockSize; ++r) rows[r] = row_errors[r];
  return four_over_six_tile_error(rows);
}
"""


@pytest.fixture(scope="module")
def numerics(tmp_path_factory):
    lib = compile_harness(tmp_path_factory.mktemp("numerics_4over6"), HARNESS)
    lib.tile_error.restype = ctypes.c_float
    lib.division_mismatches.restype = ctypes.c_long
    lib.scale_reciprocal.restype = ctypes.c_float
    lib.base_scale.restype = ctypes.c_float
    return lib


@needs_nvcc
@pytest.mark.parametrize("bound", [256, 448])
def test_reciprocal_constants(numerics, bound):
    """The 1 / (6 B) the kernels multiply by is fp32(1 / (6 B))."""
    expected = np.float32(1.0) / np.float32(6 * bound)
    assert numerics.scale_reciprocal(ctypes.c_float(bound)) == expected


@needs_nvcc
@pytest.mark.parametrize("constant", [6.0, 1536.0, 2688.0])
def test_division_by_constant_is_correctly_rounded(numerics, constant):
    """divide_by_exact_constant (one multiply, two FMAs) equals the IEEE quotient for every significand: the 4over6
    error's division by 6 B and the block scale's division by 6 take it in their normal range."""
    assert numerics.division_mismatches(ctypes.c_float(constant)) == 0


def host_quantize(lib, x: torch.Tensor, amax: torch.Tensor, options: FourOverSix, block_2d: bool,
                  by_conversion: bool = False):
    """The kernels' 4over6 block encoding on the host; BF16 or FP16 x takes the kernels' 16-bit path;
    by_conversion: the Blackwell builds' codes and FP4 values (the model of their FP4 conversions)."""
    sixteen_bit = x.dtype in (torch.bfloat16, torch.float16)
    x_np = np.ascontiguousarray(x.to(torch.float32).numpy())
    rows, cols = x_np.shape
    amax_np = np.ascontiguousarray(amax.numpy().astype(np.float32))
    codes = np.zeros((rows, cols // 2), dtype=np.uint8)
    scales = np.zeros((rows, cols // 16), dtype=np.uint8)
    lib.quantize_4over6(pointer(x_np), ctypes.c_long(rows), ctypes.c_long(cols), pointer(amax_np),
                        ctypes.c_long(amax_np.size), ctypes.c_float(options.e4m3_bound),
                        ctypes.c_int(options.err_mode == "MSE"), ctypes.c_int(options.fast_math),
                        ctypes.c_int(sixteen_bit), ctypes.c_int(block_2d), ctypes.c_int(by_conversion), pointer(codes),
                        pointer(scales))
    return torch.from_numpy(codes), torch.from_numpy(scales)


def _assert_equal_to_reference(lib, x, amax, options, block_2d):
    """Both the Hopper encoding (the emulation's codes) and the Blackwell one (the conversions') equal the reference."""
    data, scale = quantize_blocks_4over6(x, amax, options, block_2d=block_2d)
    for by_conversion in (False, True):
        ours = host_quantize(lib, x, amax, options, block_2d, by_conversion)
        assert torch.equal(ours[1], scale.view(torch.uint8)), f"scales differ (by_conversion={by_conversion})"
        assert torch.equal(ours[0], data), f"codes differ (by_conversion={by_conversion})"


@needs_nvcc
@pytest.mark.parametrize("name", CASES + [ROW_SCALED_CASE])
def test_kernel_numerics_on_golden_inputs(numerics, golden_v2, name):
    """Both copies of every golden 4over6 case, through the kernels' numerics, equal the reference (which equals TE)."""
    config = json.loads(str(golden_v2[f"{name}/config"]))
    dtype = getattr(torch, str(golden_v2[f"{name}/input_dtype"]).split(".")[1])
    x = torch.from_numpy(golden_v2[f"{name}/input_f32"]).to(dtype)
    options = FourOverSix(config["nvfp4_4over6_err_mode"], config["nvfp4_e4m3_max"],
                          config.get("nvfp4_4over6_err_use_fast_math", False))
    block_2d = config["tile"] == [16, 16]
    row_scaled = config.get("row_scaled_nvfp4", False)
    sources = [x] if row_scaled else [x, x.t().contiguous()]
    for source in sources:
        amax = compute_row_amax(source) if row_scaled else compute_amax(source)
        _assert_equal_to_reference(numerics, source, amax, options, block_2d)
    assert torch.equal(host_quantize(numerics, x, compute_row_amax(x) if row_scaled else compute_amax(x), options,
                                     block_2d)[0], torch.from_numpy(golden_v2[f"{name}/data"]))


@needs_nvcc
@pytest.mark.parametrize("options", ALL_OPTIONS, ids=lambda o: f"{o.err_mode}-{o.e4m3_bound}-{'fast' if o.fast_math else 'exact'}")
@pytest.mark.parametrize("layout", ["1x16", "16x16", "rowscaled"])
def test_kernel_numerics_on_near_ties(numerics, options, layout):
    """Inputs whose candidates' errors tie in exact arithmetic (rounding decides: exact vs fast-math, the 2D tree)."""
    for x in (_tie_input(64, 256, seed=5), _random_bf16_input(64, 256, seed=5).bfloat16()):
        amax = compute_row_amax(x) if layout == "rowscaled" else compute_amax(x)
        _assert_equal_to_reference(numerics, x, amax, options, layout == "16x16")


def redone_blocks(lib):
    """(blocks or tiles seen, redone with the exact errors) since the last call."""
    counts = np.zeros(2, dtype=np.int64)
    lib.redone_blocks(pointer(counts))
    return counts.tolist()


@needs_nvcc
@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
@pytest.mark.parametrize("layout", ["1x16", "16x16"])
def test_estimated_errors_settle_nearly_every_block(numerics, err_mode, layout):
    """The exact error mode chooses from estimated errors (one FMA a value) wherever they settle the choice: on random
    inputs all but a few blocks; the tie inputs take the exact errors, and both equal the reference."""
    options = FourOverSix(err_mode, 448, False)
    redone_blocks(numerics)
    x = _random_bf16_input(256, 1024, seed=11).bfloat16()
    _assert_equal_to_reference(numerics, x, compute_amax(x), options, layout == "16x16")
    seen, redone = redone_blocks(numerics)
    assert seen > 0 and redone <= seen // 100, f"{redone} of {seen} redone"
    x = _tie_input(64, 256, seed=5)
    _assert_equal_to_reference(numerics, x, compute_amax(x), options, layout == "16x16")
    seen, redone = redone_blocks(numerics)
    assert redone > 0, "no tie input took the exact errors"


@needs_nvcc
def test_kernel_numerics_special_blocks(numerics):
    """Zeros, -0.0, tiny values whose block scale underflows to 0, FP16 subnormals, a supplied amax below the data
    (scales clamp at 448), and an all-zero tensor (amax 0)."""
    x = torch.zeros(32, 64)
    x[0, :16] = -0.0
    x[1, :16] = torch.linspace(-1e-30, 1e-30, 16)
    x[2, :16] = torch.tensor([6e-8, -6e-8] * 8)
    x[3] = torch.randn(64) * 1e4
    x[4:20] = torch.randn(16, 64)
    for options in ALL_OPTIONS:
        for block_2d in (False, True):
            for amax in (compute_amax(x), torch.tensor([1.0]), torch.tensor([0.0])):
                _assert_equal_to_reference(numerics, x, amax, options, block_2d)
            _assert_equal_to_reference(numerics, x.half(), compute_amax(x.half()), options, block_2d)


@needs_nvcc
def test_base_scale_at_the_ends_of_the_fast_division(numerics):
    """a_b / 6 (four_over_six_base_scale: divide_by_exact_constant inside [2^-97, 2^126] and for 0, the IEEE
    division outside) at and beyond the ends of that range: subnormal, huge, inf."""
    amaxes = np.array([0.0, 1e-45, 2.0 ** -126, 6.310887e-30, 6.3108867e-30, 2.0 ** 126, 8.5070596e37, 3.4028235e38,
                       np.inf], dtype=np.float32)
    for amax in amaxes:
        expected = torch.div(torch.tensor(float(amax)), torch.tensor(6.0)).item()
        assert numerics.base_scale(ctypes.c_float(amax), ctypes.c_float(1.0)) == np.float32(expected), amax


@needs_nvcc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_numerics_across_block_magnitudes(numerics, dtype):
    """16-bit blocks whose maxima span many binades below the tensor's amax: their E4M3 scales run from normal down
    into the subnormals and to 0, so blocks take the common case (map-to-4 below 4.5, quotients in range) and the
    general one (a scale coarse enough to push a scaled value past 4.5, a product below the common range), side by
    side; and a huge tensor amax, past the common case's bound on A."""
    generator = torch.Generator().manual_seed(11)
    blocks = torch.randn(64, 8, 16, generator=generator)
    exponents = torch.randint(-14, 1, (64, 8, 1), generator=generator).to(torch.float32)
    x = (blocks * torch.exp2(exponents)).reshape(64, 128)
    x[0, :16] = 2.0 ** 8  # the tensor amax: the other blocks sit up to 22 binades below it
    tensors = [x.to(dtype)]
    if dtype == torch.bfloat16:  # the same blocks 2^106 larger (A * 2^14 would overflow), and 2^120 smaller (the
        tensors += [(x * 2.0 ** 106).to(dtype), (x * 2.0 ** -120).to(dtype)]  # products below the common range)
    for x in tensors:
        for options in ALL_OPTIONS:
            for block_2d in (False, True):
                _assert_equal_to_reference(numerics, x, compute_amax(x), options, block_2d)
                _assert_equal_to_reference(numerics, x, torch.tensor([3.0e38]), options, block_2d)


@needs_nvcc
def test_tile_error_is_the_tree(numerics):
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        errors = (torch.rand(16, generator=generator) * torch.exp2(torch.randint(-20, 20, (16,), generator=generator)))
        ours = numerics.tile_error(pointer(np.ascontiguousarray(errors.numpy())))
        t = errors
        for half in (8, 4, 2, 1):
            t = t[:half] + t[half:2 * half]
        assert ours == t.item()
