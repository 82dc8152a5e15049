"""CPU-side checks of the CUDA kernel layer: no GPU needed.

- nvfp4_dist.kernels imports without CUDA and mirrors the reference's signatures;
- the extension loader fails with a RuntimeError that says how to build;
- the kernels' element numerics (csrc/nvfp4_numerics.cuh, host-compiled with nvcc) equal the
  reference byte for byte: block scales, RNE and stochastic codes, Philox bits, the RHT sums;
- the quantize kernels' tile order and its division-free quotient (csrc/tile_order.cuh);
- csrc/compile_check.sh compiles every kernel for every target (nvfp4_dist._extension.SASS_TARGETS, the PTX
  fallback) or names those the toolkit lacks.
"""
import ctypes
import inspect
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from nvfp4_dist import _extension, kernels, reference
from nvfp4_dist.reference.philox import CURAND_ROUNDS, SR_ROUNDS, philox4x32
from tests.helpers import oracle as O
from tests.helpers.host_harness import CSRC, compile_harness, needs_nvcc, pointer

# Host entry points over csrc/nvfp4_numerics.cuh and csrc/tile_order.cuh, composed exactly as csrc/quantize.cu
# composes them.
HARNESS = r"""
#include "nvfp4_numerics.cuh"
#include "tile_order.cuh"
using namespace nvfp4;
extern "C" {
void tile_positions(long tile_rows, long column_tiles, int shift, int row_major, int* rows, int* cols) {
  const TileOrder order(tile_rows, column_tiles, shift);
  for (long t = 0; t < tile_rows * column_tiles; ++t) {
    const int2 position = row_major ? order.row_major(static_cast<int>(t)) : order.row_and_column(static_cast<int>(t));
    rows[t] = position.x;
    cols[t] = position.y;
  }
}
void fast_quotients(const int* n, const int* d, long count, int* out) {
  for (long i = 0; i < count; ++i) out[i] = FastDivisor(d[i]).quotient(n[i]);
}
// Rows of 16-element blocks along the last dim; amax per tensor (amax_count 1) or per row. sixteen_bit: the
// values are BF16 or FP16 numbers, encoded as the kernels encode 16-bit inputs. by_conversion: round to nearest
// with the codes of Blackwell's FP4 conversion (its model on the host), as the kernels encode on Blackwell.
void quantize_rows(const float* x, long rows, long cols, const float* amax, long amax_count, int stochastic,
                   unsigned long long seed, long row_offset, long col_offset, unsigned stream, int sixteen_bit,
                   int by_conversion, unsigned char* codes, unsigned char* scales) {
  for (long r = 0; r < rows; ++r) {
    const float s_enc = encode_scale(amax[amax_count == 1 ? 0 : r]);
    const float s_dec = decode_scale(s_enc);
    for (long b = 0; b < cols / kBlockSize; ++b) {
      const float* v = x + r * cols + b * kBlockSize;
      float block_amax = 0.0f;
      for (int i = 0; i < kBlockSize; ++i) block_amax = fmaxf(block_amax, fabsf(v[i]));
      const unsigned char scale = block_scale_e4m3_of_nonnegative(block_amax, s_enc * kOneSixth);
      const float e_b = block_encode_factor(scale, s_dec);
      const float encode = stochastic ? encode_block_factor<true>(e_b) : encode_block_factor<false>(e_b);
      scales[r * (cols / kBlockSize) + b] = scale;
      float block[kBlockSize];
      for (int i = 0; i < kBlockSize; ++i) block[i] = v[i];
      const long row = row_offset + r, column = col_offset + b * kBlockSize;
      uint2 packed;
      if (stochastic) {
        packed = sixteen_bit ? encode_block<true, true>(block, encode, block_amax, seed, stream, row, column)
                             : encode_block<true>(block, encode, block_amax, seed, stream, row, column);
      } else if (by_conversion) {
        packed = sixteen_bit ? encode_block<false, true, true>(block, encode, block_amax, seed, stream, row, column)
                             : encode_block<false, false, true>(block, encode, block_amax, seed, stream, row, column);
      } else {
        packed = sixteen_bit ? encode_block<false, true>(block, encode, block_amax, seed, stream, row, column)
                             : encode_block<false>(block, encode, block_amax, seed, stream, row, column);
      }
      std::memcpy(codes + r * (cols / 2) + b * (kBlockSize / 2), &packed, sizeof(packed));
    }
  }
}
void fp4_codes(const float* v, long n, const unsigned* bits, int stochastic, unsigned char* out) {
  for (long i = 0; i < n; ++i)
    out[i] = static_cast<unsigned char>(stochastic ? fp4_code_stochastic(clamp_fp4(v[i]), bits[i]) : fp4_code_rne(v[i]));
}
void conversion_codes(const float* v, long n, unsigned char* out) {
  for (long i = 0; i < n; ++i) out[i] = static_cast<unsigned char>(fp4_code_by_conversion_rule(v[i]));
}
void philox(const unsigned* counters, long n, unsigned k0, unsigned k1, int rounds, unsigned* out) {
  for (long i = 0; i < n; ++i) {
    const unsigned* c = counters + 4 * i;
    const PhiloxWords w = rounds == 10 ? philox4x32<10>(c[0], c[1], c[2], c[3], k0, k1)
                                       : philox4x32<kStochasticRoundingPhiloxRounds>(c[0], c[1], c[2], c[3], k0, k1);
    for (int j = 0; j < 4; ++j) out[4 * i + j] = w.w[j];
  }
}
void rht(const float* chunks, long n, int random_sign, int inverse, float* out) {
  for (long c = 0; c < n; ++c) {
    float in[kBlockSize], result[kBlockSize];
    for (int i = 0; i < kBlockSize; ++i) in[i] = chunks[c * kBlockSize + i];
    if (inverse) { if (random_sign) inverse_rht_chunk<true>(in, result); else inverse_rht_chunk<false>(in, result); }
    else { if (random_sign) rht_chunk_odd_negated<true>(in, result); else rht_chunk_odd_negated<false>(in, result); }
    for (int i = 0; i < kBlockSize; ++i) out[c * kBlockSize + i] = (!inverse && (i & 1)) ? -result[i] : result[i];
  }
}
void dequantize_codes(const unsigned char* codes, const unsigned char* scales, long rows, long cols, const float* amax,
                      float* out) {
  const float s_dec = decode_scale(encode_scale(amax[0]));
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < cols; ++c)
      out[r * cols + c] = (fp4_value(codes[r * cols + c]) * e4m3_to_float(scales[r * (cols / kBlockSize) + c / kBlockSize])) * s_dec;
}
}
"""


@pytest.fixture(scope="module")
def numerics(tmp_path_factory):
    """The harness compiled by nvcc for the host, loaded through ctypes."""
    return compile_harness(tmp_path_factory.mktemp("numerics"), HARNESS)


def host_quantize(lib, x: torch.Tensor, amax: torch.Tensor, sr_seed=None, offset=(0, 0), stream=0, encoding="emulated"):
    """The kernels' block encoding on the host; BF16 or FP16 x takes the kernels' 16-bit path. encoding: round to
    nearest by Hopper's emulation, or by Blackwell's FP4 conversion ("conversion", its model on the host)."""
    sixteen_bit = x.dtype in (torch.bfloat16, torch.float16)
    x_np = np.ascontiguousarray(x.to(torch.float32).numpy())
    rows, cols = x_np.shape
    amax_np = np.ascontiguousarray(amax.numpy().astype(np.float32))
    codes = np.zeros((rows, cols // 2), dtype=np.uint8)
    scales = np.zeros((rows, cols // 16), dtype=np.uint8)
    lib.quantize_rows(pointer(x_np), ctypes.c_long(rows), ctypes.c_long(cols), pointer(amax_np),
                      ctypes.c_long(amax_np.size), ctypes.c_int(sr_seed is not None), ctypes.c_ulonglong(sr_seed or 0),
                      ctypes.c_long(offset[0]), ctypes.c_long(offset[1]), ctypes.c_uint(stream),
                      ctypes.c_int(sixteen_bit), ctypes.c_int(encoding == "conversion"), pointer(codes), pointer(scales))
    return torch.from_numpy(codes), torch.from_numpy(scales)


def test_kernels_mirror_reference_signatures():
    for name in ("compute_amaxes", "quantize_tensor", "dequantize_tensor", "swap_first_dims", "transpose_codes",
                 "swizzle_scales"):
        ours, theirs = inspect.signature(getattr(kernels, name)), inspect.signature(getattr(reference, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()], name


def test_kernels_reject_cpu_tensors_with_value_error():
    with pytest.raises(ValueError, match="CUDA tensor"):
        kernels.quantize_tensor(torch.randn(32, 32))


def test_extension_failure_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_extension, "_module", None)
    if torch.version.cuda is None:
        with pytest.raises(RuntimeError, match="python -m nvfp4_dist.build"):
            _extension.load_extension()
    import torch.utils.cpp_extension as cpp_extension

    def broken_load(**_):
        raise OSError("ninja: not found")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    monkeypatch.setattr(_extension, "arch_flags", lambda: ["-gencode=arch=compute_90a,code=sm_90a"])
    monkeypatch.setattr(_extension, "build_directory", lambda arch: pathlib.Path("/tmp"))
    with pytest.raises(RuntimeError, match=r"ninja: not found.*python -m nvfp4_dist.build"):
        _extension.load_extension()


def test_cublas_lt_comes_from_the_toolkit_or_from_torchs_cublas_wheel(monkeypatch, tmp_path):
    import sys
    import types

    import torch.utils.cpp_extension as cpp_extension
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "lib64").mkdir()
    (toolkit / "include" / "cublasLt.h").write_text("")
    (toolkit / "lib64" / "libcublasLt.so").write_text("")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(toolkit))
    assert _extension.cublas_lt_flags() == ([], [f"-L{toolkit / 'lib64'}", "-lcublasLt"])

    (toolkit / "include" / "cublasLt.h").unlink()  # a toolkit without cuBLAS: the wheel's header and library
    wheel = tmp_path / "site-packages" / "nvidia" / "cu13"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "include" / "cublasLt.h").write_text("")
    (wheel / "lib" / "libcublasLt.so.13").write_text("")
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(wheel.parent)]))
    assert _extension.cublas_lt_flags() == ([str(wheel / "include")],
                                            [f"-L{wheel / 'lib'}", "-l:libcublasLt.so.13",
                                             f"-Wl,-rpath,{wheel / 'lib'}"])


def test_sources_are_every_cu_file_plus_bindings():
    sources = [pathlib.Path(s).name for s in _extension.source_files()]
    assert "bindings.cpp" in sources and "quantize.cu" in sources and "amax.cu" in sources
    assert "-fmad=false" in _extension.NVCC_FLAGS and not any("fast-math" in f for f in _extension.NVCC_FLAGS)


def wide_range(rows, cols, seed, low=-20, high=20):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    return x * torch.exp2(torch.randint(low, high, (rows, cols // 16, 1), generator=generator).float()).repeat_interleave(16, 1).reshape(rows, cols)


ENCODINGS = pytest.mark.parametrize("encoding", ["emulated", "conversion"])  # Hopper's, Blackwell's (modelled)


@needs_nvcc
@ENCODINGS
@pytest.mark.parametrize("row_scaled", [False, True])
def test_block_numerics_match_reference(numerics, row_scaled, encoding):
    x = wide_range(256, 512, seed=1)
    x[3] = 0.0
    x[4, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.1, 6.0, -6.0, 1e-30, -1e-30, 3.0, 4.0, 0.5])
    amax = reference.compute_row_amax(x) if row_scaled else reference.compute_amax(x)
    data, scale = reference.quantize_blocks(x, amax)
    host_data, host_scale = host_quantize(numerics, x, amax, encoding=encoding)
    assert torch.equal(host_scale, scale.view(torch.uint8))
    assert torch.equal(host_data, data)


@needs_nvcc
@ENCODINGS
def test_bin_edges_and_extremes_match_reference(numerics, encoding):
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0])
    x = edges.repeat(64, 4)
    amax = torch.tensor([2688.0])
    for candidate in (amax, torch.tensor([0.0]), torch.tensor([float("inf")]), torch.tensor([3.4e38]), torch.tensor([1e-30])):
        data, scale = reference.quantize_blocks(x, candidate)
        host_data, host_scale = host_quantize(numerics, x, candidate, encoding=encoding)
        assert torch.equal(host_scale, scale.view(torch.uint8)), candidate
        assert torch.equal(host_data, data), candidate


@needs_nvcc
@pytest.mark.parametrize("stochastic,encoding", [(False, "emulated"), (False, "conversion"), (True, "emulated")])
def test_sixteen_bit_rare_blocks_match_reference(numerics, stochastic, encoding):
    """The kernels' 16-bit path finds its rare blocks (e_b below 2^-16, products that underflow to -0.0,
    saturation) by one compare of an underflow-marked e_b; the codes must still equal the reference's."""
    x = wide_range(128, 256, seed=3, low=-12, high=20)
    x[5, :16] = torch.tensor([1e6, -1e-40, -3e-39, -0.0, 1e-40, -1e-38, 7e5, -6e5, 0.0, -1.0, 2.5, -2.5, 1e-30, -1e-30,
                              3e5, -4e5])
    x = x.to(torch.bfloat16)
    amax = reference.compute_amax(x.float())
    seed = 0x0123456789ABCDEF if stochastic else None
    data, scale = reference.quantize_blocks(x.float(), amax, sr_seed=seed, sr_stream=0)
    host_data, host_scale = host_quantize(numerics, x, amax, sr_seed=seed, encoding=encoding)
    assert torch.equal(host_scale, scale.view(torch.uint8))
    assert torch.equal(host_data, data)


@needs_nvcc
@pytest.mark.parametrize("offset", [(0, 0), (48, 13), (7, 8)])
def test_stochastic_rounding_matches_reference(numerics, offset):
    x = wide_range(64, 256, seed=2, low=-3, high=3)
    amax = reference.compute_amax(x)
    seed = 0xDEADBEEF_12345678
    data, scale = reference.quantize_blocks(x, amax, sr_seed=seed, sr_offset=offset, sr_stream=1)
    host_data, host_scale = host_quantize(numerics, x, amax, sr_seed=seed, offset=offset, stream=1)
    assert torch.equal(host_scale, scale.view(torch.uint8))
    assert torch.equal(host_data, data)


def rounding_probe_values() -> torch.Tensor:
    """Every grid point and midpoint of E2M1 with its 4 neighbouring floats each side, both signs,
    a dense sweep of [0, 8) and values far beyond 6."""
    import struct
    anchors = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0]
    bits = torch.tensor([struct.unpack("<i", struct.pack("<f", a))[0] for a in anchors], dtype=torch.int64)
    near = (bits[:, None] + torch.arange(-4, 5)[None, :]).clamp(min=0).flatten().to(torch.int32).view(torch.float32)
    sweep = torch.linspace(0, 8, 400001)
    extremes = torch.tensor([1e-45, 1e-38, 1e-20, 6.0000005, 100.0, 3.4e38, float("inf")])
    values = torch.cat([near, sweep, extremes])
    return torch.cat([values, -values])


@needs_nvcc
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_fp4_rounding_matches_reference(numerics, stochastic):
    from nvfp4_dist.formats import fp4_round_to_nearest_even
    from nvfp4_dist.reference.quantize import _stochastic_codes
    v = rounding_probe_values()
    n = v.numel()
    v_np = np.ascontiguousarray(v.numpy())
    if stochastic:
        v_np = np.clip(v_np, -6, 6)
        rows = torch.arange(n, dtype=torch.int64)
        want = _stochastic_codes(torch.from_numpy(v_np)[None, :], 77, (0, 0), 0)[0]
        from nvfp4_dist.reference.philox import stochastic_rounding_bits
        bits = stochastic_rounding_bits(torch.zeros_like(rows), rows, 0, 77).numpy().astype(np.uint32)
    else:
        want = fp4_round_to_nearest_even(torch.from_numpy(v_np).clamp(-6, 6))
        bits = np.zeros(n, dtype=np.uint32)
    out = np.zeros(n, dtype=np.uint8)
    numerics.fp4_codes(pointer(v_np), ctypes.c_long(n), pointer(np.ascontiguousarray(bits)), ctypes.c_int(stochastic),
                       pointer(out))
    got = torch.from_numpy(out)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, e.g. v={v_np[bad[:5].numpy()]} got {got[bad[:5]]} want {want[bad[:5]]}"


@needs_nvcc
def test_conversion_rule_rounds_as_the_reference(numerics):
    """The model of Blackwell's cvt.rn.satfinite.e2m1x2.f32 (csrc/nvfp4_numerics.cuh) on every E2M1 grid point and
    midpoint with its neighbouring floats, a dense sweep and values far beyond 6: the reference's codes wherever
    encode_block can pass the value (no -0.0: its + 0 makes +0.0; above 6 in magnitude saturated to 6, as its clamp
    does); -0.0 keeps its sign bit (code 8) and a NaN gives 7, as the instruction documents."""
    from nvfp4_dist.formats import fp4_round_to_nearest_even
    v = rounding_probe_values()
    v = v[~((v == 0) & torch.signbit(v))]
    v_np = np.ascontiguousarray(v.numpy())
    out = np.zeros(v_np.size, dtype=np.uint8)
    numerics.conversion_codes(pointer(v_np), ctypes.c_long(v_np.size), pointer(out))
    want = fp4_round_to_nearest_even(v.clamp(-6, 6))
    bad = (torch.from_numpy(out) != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, e.g. v={v_np[bad[:5].numpy()]} got {out[bad[:5].numpy()]}"
    special = np.array([-0.0, float("nan"), -float("nan"), float("-inf")], dtype=np.float32)
    out = np.zeros(special.size, dtype=np.uint8)
    numerics.conversion_codes(pointer(special), ctypes.c_long(special.size), pointer(out))
    assert out.tolist() == [8, 7, 7, 15]


@needs_nvcc
def test_stochastic_rounding_ties_of_the_random_bits(numerics, monkeypatch):
    """Values whose p * 65536 is an integer, with bits just below, at and above it (the strict '<'): the kernels'
    codes equal the reference's rule fed the same bits, and the oracle's."""
    import nvfp4_dist.reference.quantize as reference_quantize
    steps = torch.tensor([0.5] * 4 + [1.0] * 2 + [2.0])
    lows = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    fractions = torch.tensor([0, 1, 2, 255, 32768, 40000, 65534, 65535], dtype=torch.float32)
    a = (lows[:, None] + steps[:, None] * fractions[None, :] / 65536).flatten()
    a = torch.cat([a, torch.tensor([6.0, 1e-30, 1e-45])])
    v = torch.cat([a, -a]).repeat_interleave(3)
    base = (torch.cat([fractions.repeat(7), torch.zeros(3)]).repeat(2).repeat_interleave(3)).long()
    bits = (base + torch.tensor([-1, 0, 1]).repeat(v.numel() // 3)).clamp(0, 65535)
    # the reference's own rule, its random bits replaced by these
    monkeypatch.setattr(reference_quantize, "stochastic_rounding_bits_grid", lambda *args: bits[None, :])
    want = reference_quantize._stochastic_codes(v[None, :], 0, (0, 0), 0)[0]
    assert np.array_equal(want.numpy(), O.stochastic_e2m1(v.numpy(), bits.numpy(), levels=65536))
    v_np = np.ascontiguousarray(v.numpy())
    bits_np = np.ascontiguousarray(bits.numpy().astype(np.uint32))
    out = np.zeros(v.numel(), dtype=np.uint8)
    numerics.fp4_codes(pointer(v_np), ctypes.c_long(v.numel()), pointer(bits_np), ctypes.c_int(1), pointer(out))
    assert torch.equal(torch.from_numpy(out), want)


@needs_nvcc
@pytest.mark.parametrize("rounds", [CURAND_ROUNDS, SR_ROUNDS])
def test_philox_matches_reference(numerics, rounds):
    generator = torch.Generator().manual_seed(3)
    counters = torch.randint(0, 2 ** 32, (1000, 4), generator=generator, dtype=torch.int64)
    key = (0x89ABCDEF, 0x01234567)
    want = torch.stack(philox4x32(tuple(counters.t()), key, rounds), dim=1)
    counters_np = np.ascontiguousarray(counters.numpy().astype(np.uint32))
    out = np.zeros((1000, 4), dtype=np.uint32)
    numerics.philox(pointer(counters_np), ctypes.c_long(1000), ctypes.c_uint(key[0]), ctypes.c_uint(key[1]),
                    ctypes.c_int(rounds), pointer(out))
    assert torch.equal(torch.from_numpy(out.astype(np.int64)), want)


@needs_nvcc
@pytest.mark.parametrize("random_sign", [True, False])
def test_rht_sums_match_reference(numerics, random_sign):
    """The butterflies' FP32 sums equal the reference's bit for bit, also where they round (wide range).

    The forward kernel transform returns its odd outputs negated (undone in the harness) and may give an exact
    zero sum as -0.0 where the reference's + 0 gives +0.0; nothing reads that sign (a cast's v * e + 0 and the
    amaxes' |v| are the same for both), so forward results are compared after + 0.0, the inverse's as they are."""
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(20000, 16, generator=generator)
         * torch.exp2(torch.randint(-30, 30, (20000, 16), generator=generator).float())).to(torch.bfloat16).float()
    x[:100] = 0.0
    x[100:200] = -0.0
    chunks = np.ascontiguousarray(x.numpy())
    for inverse, want in ((0, reference.rht_chunks(x, random_sign)), (1, reference.inverse_rht_chunks(x, random_sign))):
        out = np.zeros_like(chunks)
        numerics.rht(pointer(chunks), ctypes.c_long(chunks.shape[0]), ctypes.c_int(random_sign), ctypes.c_int(inverse),
                     pointer(out))
        got = torch.from_numpy(out)
        if not inverse:
            got, want = got + 0.0, want + 0.0
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"inverse={inverse}"


@needs_nvcc
def test_dequantize_numerics_match_reference(numerics):
    x = wide_range(64, 128, seed=5, low=-4, high=4)
    amax = reference.compute_amax(x)
    data, scale = reference.quantize_blocks(x, amax)
    codes = np.ascontiguousarray(torch.stack([data & 0xF, data >> 4], -1).flatten(-2).numpy())
    scales = np.ascontiguousarray(scale.view(torch.uint8).numpy())
    amax_np = amax.numpy().astype(np.float32)
    out = np.zeros((64, 128), dtype=np.float32)
    numerics.dequantize_codes(pointer(codes), pointer(scales), ctypes.c_long(64), ctypes.c_long(128), pointer(amax_np),
                              pointer(out))
    want = reference.dequantize_blocks(data, scale, amax)
    assert torch.equal(torch.from_numpy(out).view(torch.int32), want.view(torch.int32))


def expected_tile_order(tile_rows, column_tiles, shift):
    """Bands of 2^shift tile rows (the last one shorter), column-major within a band."""
    band = 1 << shift
    return [(first + r, c) for first in range(0, tile_rows, band)
            for c in range(column_tiles) for r in range(min(band, tile_rows - first))]


@needs_nvcc
@pytest.mark.parametrize("shift", [0, 4])
def test_tile_order_visits_bands_column_major(numerics, shift):
    for tile_rows in (1, 2, 15, 16, 17, 18, 31, 32, 33, 64, 66):
        for column_tiles in (1, 3, 64, 89, 128):
            count = tile_rows * column_tiles
            rows, cols = np.zeros(count, dtype=np.int32), np.zeros(count, dtype=np.int32)
            for row_major in ((0, 1) if shift == 0 else (0,)):
                numerics.tile_positions(ctypes.c_long(tile_rows), ctypes.c_long(column_tiles), ctypes.c_int(shift),
                                        ctypes.c_int(row_major), pointer(rows), pointer(cols))
                got = list(zip(rows.tolist(), cols.tolist()))
                assert got == expected_tile_order(tile_rows, column_tiles, shift), (tile_rows, column_tiles, row_major)


@needs_nvcc
def test_fast_divisor_quotients_are_exact(numerics):
    generator = np.random.default_rng(8)
    divisors = np.concatenate([np.arange(1, 2049), generator.integers(1, 2**31 - 1, 2000),
                               [2**k for k in range(31)], [2**k - 1 for k in range(1, 32)], [2**k + 1 for k in range(30)]])
    d = np.repeat(divisors, 6).astype(np.int32)
    n = np.concatenate([[0, 1, x - 1, x, x + 1, 2**31 - 1] for x in divisors]).clip(0, 2**31 - 1)
    n = np.concatenate([n, generator.integers(0, 2**31 - 1, d.size)]).astype(np.int32)
    d = np.concatenate([d, d]).astype(np.int32)
    out = np.zeros(d.size, dtype=np.int32)
    numerics.fast_quotients(pointer(n), pointer(d), ctypes.c_long(d.size), pointer(out))
    want = n.astype(np.int64) // d.astype(np.int64)
    assert np.array_equal(out, want), np.nonzero(out != want)[0][:5]


@needs_nvcc
@pytest.mark.slow(reason="nvcc compiles every kernel for every target: 13 minutes on a busy 2-core machine")
def test_compile_check_passes():
    """Every csrc/*.cu compiles for every target the toolkit has (the others named), and bindings.cpp, against
    the headers of the torch that runs the tests."""
    result = subprocess.run(["bash", str(CSRC / "compile_check.sh")], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"-std={_extension.cxx_standard()}" in result.stdout
    lacking = next((line for line in result.stdout.splitlines() if "cannot build" in line), "")
    for target in [*_extension.SASS_TARGETS.values(), _extension.PTX_FALLBACK]:
        for source in sorted(CSRC.glob("*.cu")):
            assert f"ok    {source.name} {target}" in result.stdout or target in lacking.split(), (source, target)
    assert "ok    bindings.cpp" in result.stdout
