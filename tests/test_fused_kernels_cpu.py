"""CPU-side checks of the fused-producer kernels (csrc/norm_quantize.cu, csrc/activation_quantize.cu): no GPU needed.

- nvfp4_dist.fused_kernels imports without CUDA and mirrors the reference's signatures;
- the kernels' element numerics (csrc/producer_numerics.cuh, host-compiled with nvcc) equal the reference
  bit for bit: the fixed-order row sum as the kernels split it over threads and meet the threads' shares, the
  norm statistics stage by stage (mean, sum of squares, rstd) and the norm of each value, the BF16 rounding,
  exp / erfc and the activations.
"""
import ctypes
import inspect

import numpy as np
import pytest
import torch

from nvfp4_dist import fused_kernels
from nvfp4_dist.reference import fused_producers as R
from tests.helpers.host_harness import compile_harness, needs_nvcc, pointer

# Host entry points over csrc/producer_numerics.cuh, composed as csrc/norm_quantize.cu composes them: thread t of
# `threads` holds blocks row_block_of_thread(t, k, threads) of a row (k < K, the kernel's blocks per thread), zeros
# past the row's end; its share of the row sum is thread_share_of_row_sum<K>, and the threads' shares meet as
# block_halving_sums (csrc/producer_cast.cuh) meets them: lane l adds warp w's and warp w + warps / 2's values at
# lane l (the levels of stride threads / 2 .. 32) by halving_sum over the warps, then the warp's XOR shuffles of
# stride 16 .. 1, each lane adding its partner's value to its own.
HARNESS = r"""
#include <vector>
#include "producer_numerics.cuh"
using namespace nvfp4;

template <int kWarps>
static std::vector<float> lanes_after_warp_levels(const std::vector<float>& shared) {
  std::vector<float> lanes(32);
  for (int lane = 0; lane < 32; ++lane) {
    float by_warp[kWarps];
    for (int w = 0; w < kWarps; ++w) by_warp[w] = shared[32 * w + lane];
    lanes[lane] = halving_sum<kWarps>(by_warp);
  }
  return lanes;
}

static float block_halving_sum(const std::vector<float>& shared) {
  const int threads = static_cast<int>(shared.size());
  std::vector<float> lanes = threads == 256 ? lanes_after_warp_levels<8>(shared)
                           : threads == 128 ? lanes_after_warp_levels<4>(shared)
                           : threads == 64  ? lanes_after_warp_levels<2>(shared)
                                            : lanes_after_warp_levels<1>(shared);
  for (int stride = 16; stride >= 1; stride /= 2) {
    std::vector<float> shuffled(32);
    for (int lane = 0; lane < 32; ++lane) shuffled[lane] = lanes[lane ^ stride];
    for (int lane = 0; lane < 32; ++lane) lanes[lane] = lanes[lane] + shuffled[lane];
  }
  return lanes[0];
}

template <int K>
static float row_sum(const std::vector<float>& row, int threads) {
  const long blocks = static_cast<long>(row.size()) / kBlockSize;
  std::vector<float> shares(threads);
  for (int t = 0; t < threads; ++t) {
    float block_sums[K];
    for (int k = 0; k < K; ++k) {
      const long block = row_block_of_thread(t, k, threads);
      float v[kBlockSize] = {};
      if (block < blocks) for (int i = 0; i < kBlockSize; ++i) v[i] = row[block * kBlockSize + i];
      block_sums[k] = halving_sum16(v);
    }
    shares[t] = thread_share_of_row_sum<K>(block_sums);
  }
  return block_halving_sum(shares);
}

static float row_sum_of(const std::vector<float>& row, int threads, int blocks_per_thread) {
  switch (blocks_per_thread) {
    case 1: return row_sum<1>(row, threads);
    case 2: return row_sum<2>(row, threads);
    case 4: return row_sum<4>(row, threads);
    default: return row_sum<8>(row, threads);
  }
}

extern "C" {
// LayerNorm (layer_norm != 0) or RMSNorm of each row, as the norm kernel's row pass: mean, the sum of squares
// before rstd, rstd and the output rounded to BF16 (returned as FP32).
void norm_rows(const float* x, long rows, long cols, const float* weight, const float* bias, int layer_norm,
               float eps, int threads, int blocks_per_thread, float* mean, float* sum_of_squares, float* rstd,
               float* y) {
  const float width = static_cast<float>(cols);
  for (long r = 0; r < rows; ++r) {
    std::vector<float> v(x + r * cols, x + (r + 1) * cols);
    float m = 0.0f;
    if (layer_norm) {
      m = mean_of_row(row_sum_of(v, threads, blocks_per_thread), width);
      for (auto& value : v) value = value - m;
    }
    std::vector<float> squares(v.size());
    for (size_t i = 0; i < v.size(); ++i) squares[i] = v[i] * v[i];
    sum_of_squares[r] = row_sum_of(squares, threads, blocks_per_thread);
    const float s = rstd_of_row(sum_of_squares[r], width, eps);
    mean[r] = m;
    rstd[r] = s;
    for (long c = 0; c < cols; ++c) {
      const float out =
          layer_norm ? layer_norm_of_centred(v[c], s, weight[c], bias[c]) : rms_norm_of(v[c], s, weight[c]);
      y[r * cols + c] = rounded_to_bf16(out);
    }
  }
}

// rstd_of_row of each sum of squares.
void rstd_of_rows(const float* sums, long n, float cols, float eps, float* out) {
  for (long i = 0; i < n; ++i) out[i] = rstd_of_row(sums[i], cols, eps);
}

// kind 0: exp, 1: erfc, 2: SiLU, 3: GELU, 4: SwiGLU of (x, up), 5: BF16 rounding, 6: rounded_bf16_bits of |x|.
void elementwise(const float* x, const float* up, long n, int kind, float* out) {
  for (long i = 0; i < n; ++i) {
    switch (kind) {
      case 0: out[i] = fixed_order_exp(x[i]); break;
      case 1: out[i] = fixed_order_erfc(x[i]); break;
      case 2: out[i] = silu_of(x[i]); break;
      case 3: out[i] = gelu_of(x[i]); break;
      case 4: out[i] = swiglu_of(x[i], up[i]); break;
      case 6: out[i] = bits_float(rounded_bf16_bits(float_bits(x[i]) & 0x7FFFFFFFu)); break;
      default: out[i] = rounded_to_bf16(x[i]); break;
    }
  }
}

// kind 0: GELU rounded to BF16, 1: SiLU, of BF16 values x as the kernels look them up, from tables built here
// by the kernels' table entries (activation_table_kernel).
std::vector<uint32_t> gelu_table_words() {
  std::vector<uint32_t> gelu(kGeluWindow);
  for (int i = 0; i < kGeluWindow; ++i) gelu[i] = gelu_table_word(i);
  return gelu;
}

void activation_by_table(const float* x, long n, int kind, float* out) {
  const std::vector<uint32_t> gelu = gelu_table_words();
  std::vector<float> silu(silu_table().entries());
  for (int i = 0; i < silu_table().entries(); ++i) silu[i] = silu_table_entry(i);
  for (long i = 0; i < n; ++i) {
    out[i] = kind == 0 ? bits_float(gelu_bf16_bits_by_table(float_bits(x[i]) >> 16, gelu.data()) << 16)
                       : silu_by_table(x[i], silu.data());
  }
}

// GELU of the BF16 pairs in words (gelu_bf16_pair_by_table), and the common path alone (gelu_bf16_pair_common)
// with its redo bits (1: redo).
void gelu_pairs_by_table(const uint32_t* words, long n, uint32_t* out, uint32_t* common, uint8_t* redo) {
  const std::vector<uint32_t> gelu = gelu_table_words();
  for (long i = 0; i < n; ++i) {
    out[i] = gelu_bf16_pair_by_table(words[i], gelu.data());
    uint32_t bits = 0u;
    common[i] = gelu_bf16_pair_common(words[i], gelu.data(), bits);
    redo[i] = gelu_pair_redo(bits) ? 1 : 0;
  }
}

// SiLU of the BF16 pairs in words by the common path (silu_pair_common: low, high) with its redo bits (1: redo).
void silu_pairs_by_table(const uint32_t* words, long n, float* low, float* high, uint8_t* redo) {
  std::vector<float> silu(silu_table().entries());
  for (int i = 0; i < silu_table().entries(); ++i) silu[i] = silu_table_entry(i);
  for (long i = 0; i < n; ++i) {
    uint32_t bits = 0u;
    silu_pair_common(words[i], silu.data(), low[i], high[i], bits);
    redo[i] = silu_pair_redo(bits) ? 1 : 0;
  }
}

// The tables' entries and bytes: GELU, SiLU.
void activation_table_sizes(int* out) {
  out[0] = gelu_table().entries();
  out[1] = kGeluTableBytes;
  out[2] = silu_table().entries();
  out[3] = kSiluTableBytes;
}
}
"""


@pytest.fixture(scope="module")
def numerics(tmp_path_factory):
    """The harness compiled by nvcc for the host, loaded through ctypes."""
    return compile_harness(tmp_path_factory.mktemp("producer_numerics"), HARNESS)


def f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to(torch.float32).numpy())


def assert_bits_equal(got: np.ndarray, want: torch.Tensor, what: str):
    got_t = torch.from_numpy(got)
    want = want.to(torch.float32).contiguous()
    both_nan = torch.isnan(got_t) & torch.isnan(want)
    differ = (got_t.view(torch.int32) != want.view(torch.int32)) & ~both_nan
    index = differ.nonzero()[:5].tolist()
    assert not differ.any(), f"{what}: {int(differ.sum())} differ, at {index}"


def test_fused_kernels_mirror_reference_signatures():
    for name in ("norm_row_sums", "norm_forward", "norm_amaxes", "norm_quantize", "activation_forward",
                 "activation_amaxes", "activation_quantize"):
        ours, theirs = inspect.signature(getattr(fused_kernels, name)), inspect.signature(getattr(R, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()], name


def test_fused_kernels_reject_cpu_tensors_with_value_error():
    with pytest.raises(ValueError, match="CUDA tensor"):
        fused_kernels.activation_forward(torch.randn(16, 32), activation="gelu", out_dtype=torch.bfloat16)


def test_norm_kernel_widths():
    """The blocks each of the row pass's threads holds: the power of two that covers the row."""
    assert fused_kernels.norm_blocks_per_thread(4096) == 1
    assert fused_kernels.norm_blocks_per_thread(4112) == 2
    assert fused_kernels.norm_blocks_per_thread(8192) == 2
    assert fused_kernels.norm_blocks_per_thread(16384) == 4
    assert fused_kernels.takes_norm_width(16384, torch.bfloat16)
    assert not fused_kernels.takes_norm_width(16400, torch.bfloat16)
    assert not fused_kernels.takes_norm_width(40, torch.bfloat16)  # not whole 16-blocks


def spread(rows, cols, seed, offset=0.0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    scale = torch.exp2(torch.randint(-8, 9, (rows, 1), generator=generator).float())
    return (x * scale + offset * scale).to(torch.bfloat16).float()


def host_norm_rows(numerics, x, weight, bias, layer_norm, threads, blocks_per_thread):
    """(mean, sum of squares, rstd, y) of the harness's row pass."""
    rows, cols = x.shape
    mean, sums, rstd = (np.zeros(rows, np.float32) for _ in range(3))
    y = np.zeros((rows, cols), np.float32)
    numerics.norm_rows(pointer(f32(x)), ctypes.c_long(rows), ctypes.c_long(cols), pointer(f32(weight)),
                       pointer(f32(bias)), ctypes.c_int(layer_norm), ctypes.c_float(1e-5), ctypes.c_int(threads),
                       ctypes.c_int(blocks_per_thread), pointer(mean), pointer(sums), pointer(rstd), pointer(y))
    return mean, sums, rstd, y


@needs_nvcc
@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("cols", [16, 256, 272, 4096, 5120, 8192, 16384])
def test_norm_rows_match_reference(numerics, normalization, cols):
    """Stage by stage: the mean, the sum of squares, rstd, the output."""
    x = spread(24, cols, seed=cols, offset=1.5)
    x[3] = 0.0
    x[4, ::3] = 1e30
    x[5] = -0.0  # sums to -0 where the tree has no padding: the mean is +0 all the same
    generator = torch.Generator().manual_seed(1)
    weight = (1 + 0.3 * torch.randn(cols, generator=generator)).bfloat16().float()
    bias = (0.2 * torch.randn(cols, generator=generator)).bfloat16().float()
    layer_norm = normalization == "LayerNorm"
    mean_ref, sums_ref = R.norm_row_sums(x, normalization=normalization)
    y_ref, _, rstd_ref = R.norm_forward(x, weight, bias if layer_norm else None, normalization=normalization,
                                        eps=1e-5, out_dtype=torch.bfloat16)
    mean, sums, rstd, y = host_norm_rows(numerics, x, weight, bias, layer_norm, fused_kernels.NORM_THREADS,
                                         fused_kernels.norm_blocks_per_thread(cols))
    if layer_norm:
        assert_bits_equal(mean, mean_ref, "mean")
    assert_bits_equal(sums, sums_ref, "sum of squares")
    assert_bits_equal(rstd, rstd_ref, "rstd")
    assert_bits_equal(y, y_ref, "y")


@needs_nvcc
def test_row_sum_split_over_threads_is_the_reference_tree(numerics):
    """Any power-of-two thread count and blocks per thread covering the row give the reference's sums (the
    tree's zero padding changes nothing): the kernels may pick their split."""
    x = spread(6, 3000 // 16 * 16, seed=9)
    x[2] = -0.0
    ones = torch.ones(x.shape[1])
    mean_ref, sums_ref = R.norm_row_sums(x, normalization="LayerNorm")
    for threads, blocks in ((256, 1), (128, 2), (64, 4), (32, 8), (256, 4)):
        mean, sums, _, _ = host_norm_rows(numerics, x, ones, ones, 1, threads, blocks)
        assert_bits_equal(mean, mean_ref, f"mean, {threads} threads x {blocks} blocks")
        assert_bits_equal(sums, sums_ref, f"sum of squares, {threads} threads x {blocks} blocks")


@needs_nvcc
def test_rstd_matches_reference_densely(numerics):
    """rstd = 1 / sqrt(sum / cols + eps) over many sums and several widths: the reference's square root is the
    correctly rounded one that the kernels' sqrtf is."""
    generator = torch.Generator().manual_seed(5)
    sums = torch.rand(200000, generator=generator) * torch.exp2(torch.randint(-30, 40, (200000,), generator=generator))
    sums = torch.cat([sums, torch.tensor([0.0, float("inf"), float("nan")])])
    for cols, eps in ((4096, 1e-5), (5120, 1e-6), (272, 0.0)):
        out = np.zeros(sums.numel(), np.float32)
        numerics.rstd_of_rows(pointer(f32(sums)), ctypes.c_long(sums.numel()), ctypes.c_float(cols),
                              ctypes.c_float(eps), pointer(out))
        assert_bits_equal(out, R.rstd_of(sums, cols, eps), f"rstd at {cols} columns, eps {eps}")


def elementwise(numerics, kind, x, up=None):
    x_np = f32(x.reshape(-1))
    up_np = f32(up.reshape(-1)) if up is not None else x_np
    out = np.zeros_like(x_np)
    numerics.elementwise(pointer(x_np), pointer(up_np), ctypes.c_long(x_np.size), ctypes.c_int(kind), pointer(out))
    return out


def probe_values():
    """A dense sweep, the ranges' edges, special values and every 2^-17 step's neighbours near 0."""
    sweep = torch.linspace(-110, 95, 300001)
    fine = torch.linspace(-8, 8, 200001)
    edges = torch.tensor([R._EXP_MAX, R._EXP_MIN, 88.7228, -103.97, 0.0, -0.0, 1e-45, -1e-45, 1e-30, 3.4e38, -3.4e38,
                          float("inf"), -float("inf"), float("nan")])
    near_edges = torch.cat([torch.nextafter(edges[:2], torch.tensor(float("inf"))),
                            torch.nextafter(edges[:2], torch.tensor(-float("inf")))])
    return torch.cat([sweep, fine, edges, near_edges])


@needs_nvcc
@pytest.mark.parametrize("kind,function", [(0, R.exp), (1, R.erfc), (2, R.silu), (3, R.gelu)],
                         ids=["exp", "erfc", "silu", "gelu"])
def test_activation_numerics_match_reference(numerics, kind, function):
    x = probe_values()
    assert_bits_equal(elementwise(numerics, kind, x), function(x), function.__name__)


@needs_nvcc
def test_swiglu_and_bf16_rounding_match_reference(numerics):
    gate, up = probe_values(), torch.flip(probe_values(), [0])
    h = torch.stack([gate, up], dim=0).t().reshape(-1, 2)
    want = R.activated(torch.cat([h[:, :1], h[:, 1:]], dim=1), "swiglu")[:, 0]
    assert_bits_equal(elementwise(numerics, 4, gate, up), want, "swiglu")
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200000,), generator=torch.Generator().manual_seed(4),
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert_bits_equal(elementwise(numerics, 5, bits), bits.to(torch.bfloat16).float(), "bf16 rounding")


@needs_nvcc
def test_amax_rounded_once_equals_the_largest_rounded_value(numerics):
    """The amax passes keep the largest |value| by its bits and round it to BF16 once (rounded_bf16_bits); the
    reference rounds every value, then takes the largest. Groups of 16 values: random bit patterns (NaNs among
    them), values between two BF16 neighbours, values that round up to the next octave or to infinity."""
    generator = torch.Generator().manual_seed(6)
    patterns = torch.randint(-2 ** 31, 2 ** 31 - 1, (16 * 20000,), generator=generator,
                             dtype=torch.int64).to(torch.int32).view(torch.float32)
    bf16 = torch.randn(16 * 20000, generator=generator).to(torch.bfloat16).float()
    between = bf16 * (1 + torch.rand(bf16.shape, generator=generator) * 2 ** -8)
    edges = torch.tensor([3.3895e38, 3.3961e38, 3.4e38, 1.99609375, 1.998, 255.9, 0.0, -0.0, 1e-40,
                          float("inf")]).repeat(16 * 100)[: 16 * 1000]
    for values in (patterns, between, edges[torch.randperm(edges.numel(), generator=generator)]):
        groups = values.reshape(-1, 16)
        want = groups.to(torch.bfloat16).float().abs().amax(dim=1)  # NaN where a group holds one
        largest_bits = (groups.view(torch.int32) & 0x7FFFFFFF).amax(dim=1)
        assert_bits_equal(elementwise(numerics, 6, largest_bits.view(torch.float32)), want, "amax rounded once")


def every_bf16_value() -> torch.Tensor:
    """All 2^16 BF16 bit patterns (infinities and NaNs included), as FP32."""
    return torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


@needs_nvcc
@pytest.mark.parametrize("kind,name", [(0, "gelu"), (1, "silu")])
def test_activation_tables_equal_the_formulas_on_every_bf16_input(numerics, kind, name):
    """The lookup (table entries, the rules outside the tables, the slots) equals the formula on all 2^16 inputs."""
    x = every_bf16_value()
    x_np = f32(x)
    out = np.zeros_like(x_np)
    numerics.activation_by_table(pointer(x_np), ctypes.c_long(x_np.size), ctypes.c_int(kind), pointer(out))
    want = R.gelu(x).to(torch.bfloat16).float() if name == "gelu" else R.silu(x)
    assert_bits_equal(out, want, f"{name} by table")


def gelu_bf16_bits(halves: torch.Tensor) -> torch.Tensor:
    """The reference's GELU rounded to BF16, as BF16 bits (int64), of BF16 bit patterns."""
    x = halves.to(torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return R.gelu(x).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def assert_halves_equal(got: torch.Tensor, want: torch.Tensor, what: str):
    """BF16 bit patterns equal, a NaN matching any NaN."""
    nan_got, nan_want = (got & 0x7FFF) > 0x7F80, (want & 0x7FFF) > 0x7F80
    differ = (nan_got != nan_want) | (~nan_want & (got != want))
    assert not differ.any(), f"{what}: {int(differ.sum())} differ, at {differ.nonzero()[:5].flatten().tolist()}"


@needs_nvcc
def test_gelu_pairs_by_word_arithmetic_equal_the_formula(numerics):
    """Both BF16 values of a word of h looked up at once (gelu_bf16_pair_by_table) equal the reference's GELU rounded
    to BF16: every BF16 value in the low and in the high half, beside a random partner and beside 1.0. The common
    path is right wherever it asks no redo, and asks none for magnitudes from 0x0100 to the table's end."""
    every = torch.arange(2 ** 16, dtype=torch.int64)
    partner = torch.randperm(2 ** 16, generator=torch.Generator().manual_seed(7))
    one = torch.full_like(every, 0x3F80)
    low = torch.cat([every, partner, every, one])
    high = torch.cat([partner, every, one, every])
    words = np.ascontiguousarray((low | (high << 16)).to(torch.int64).numpy().astype(np.uint32))
    out, common = np.zeros_like(words), np.zeros_like(words)
    redo = np.zeros(words.size, dtype=np.uint8)
    numerics.gelu_pairs_by_table(pointer(words), ctypes.c_long(words.size), pointer(out), pointer(common),
                                 pointer(redo))
    want_low, want_high = gelu_bf16_bits(low), gelu_bf16_bits(high)
    out_t, common_t = torch.from_numpy(out.astype(np.int64)), torch.from_numpy(common.astype(np.int64))
    assert_halves_equal(out_t & 0xFFFF, want_low, "low halves")
    assert_halves_equal(out_t >> 16, want_high, "high halves")
    fast = torch.from_numpy(redo) == 0
    assert_halves_equal(common_t[fast] & 0xFFFF, want_low[fast], "low halves, common path")
    assert_halves_equal(common_t[fast] >> 16, want_high[fast], "high halves, common path")
    usual = ((low & 0x7FFF) >= 0x0100) & ((low & 0x7FFF) <= 0x434A) & ((high & 0x7FFF) >= 0x0100) & \
        ((high & 0x7FFF) <= 0x434A)
    assert torch.equal(fast[usual], torch.ones_like(fast[usual])), "the common path redoes usual magnitudes"
    assert not fast[~usual].any(), "the common path keeps a pair it cannot look up"


@needs_nvcc
def test_silu_pairs_by_word_arithmetic_equal_the_formula(numerics):
    """Both BF16 values of a word of gate looked up at once (silu_pair_common) equal the reference's SiLU wherever the
    common path asks no redo, and it asks none exactly for magnitudes in the table's window (9e-8 to 384): every
    BF16 value in the low and in the high half, beside a random partner and beside 1.0."""
    every = torch.arange(2 ** 16, dtype=torch.int64)
    partner = torch.randperm(2 ** 16, generator=torch.Generator().manual_seed(8))
    one = torch.full_like(every, 0x3F80)
    low = torch.cat([every, partner, every, one])
    high = torch.cat([partner, every, one, every])
    words = np.ascontiguousarray((low | (high << 16)).numpy().astype(np.uint32))
    got_low, got_high = np.zeros(words.size, dtype=np.float32), np.zeros(words.size, dtype=np.float32)
    redo = np.zeros(words.size, dtype=np.uint8)
    numerics.silu_pairs_by_table(pointer(words), ctypes.c_long(words.size), pointer(got_low), pointer(got_high),
                                 pointer(redo))
    fast = torch.from_numpy(redo) == 0

    def silu_of_halves(halves):
        return R.silu(halves.to(torch.int32).to(torch.int16).view(torch.bfloat16).float())

    assert_bits_equal(got_low[fast.numpy()], silu_of_halves(low[fast]), "low halves, common path")
    assert_bits_equal(got_high[fast.numpy()], silu_of_halves(high[fast]), "high halves, common path")
    in_window = ((low & 0x7FFF) >= 0x33C1) & ((low & 0x7FFF) <= 0x43C0) & ((high & 0x7FFF) >= 0x33C1) & \
        ((high & 0x7FFF) <= 0x43C0)
    assert torch.equal(fast, in_window), "the common path redoes a pair in the window, or keeps one outside"


@needs_nvcc
def test_activation_tables_are_small_and_padded(numerics):
    """The tables fit a CTA's shared memory beside the cast's tile, padded to the kernels' 16-byte copies."""
    sizes = np.zeros(4, dtype=np.int32)
    numerics.activation_table_sizes(pointer(sizes))
    gelu_entries, gelu_bytes, silu_entries, silu_bytes = sizes.tolist()
    assert gelu_bytes % 16 == 0 and gelu_entries * 2 <= gelu_bytes < gelu_entries * 2 + 16
    assert silu_bytes % 16 == 0 and silu_entries * 4 <= silu_bytes < silu_entries * 4 + 16
    assert gelu_bytes <= 8 * 1024 and silu_bytes <= 32 * 1024
