// NVFP4 numerics shared by the kernels: SPEC sections 2, 5 and 7, element by element.
// Every function is __host__ __device__ so a host build can check it against the reference.
// All arithmetic is FP32 in the SPEC's order; compile without fast-math and with -fmad=false.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#define NVFP4_HD __host__ __device__ __forceinline__

namespace nvfp4 {

constexpr int kBlockSize = 16;                       // elements per block scale
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr float kGlobalScaleNumerator = 2688.0f;     // 448 * 6
constexpr float kE4M3Max = 448.0f;
constexpr float kFp4Max = 6.0f;
constexpr float kOneSixth = static_cast<float>(1.0 / 6.0);  // fp32(1/6), as torch.tensor(1/6, float32)

NVFP4_HD uint32_t float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

NVFP4_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// S_enc = min(2688 / A, FLT_MAX); 1.0 where that is 0 (A = inf). One IEEE division (SPEC 2.2).
NVFP4_HD float encode_scale(float amax) {
  float s_enc = fminf(kGlobalScaleNumerator / amax, kFltMax);
  return s_enc == 0.0f ? 1.0f : s_enc;
}

NVFP4_HD float decode_scale(float s_enc) { return 1.0f / s_enc; }

// E4M3 block scale s_b = e4m3(clamp(min(a_b * (S_enc * fp32(1/6)), FLT_MAX), +-448)), RNE (SPEC 2.3).
NVFP4_HD uint8_t block_scale_e4m3(float block_amax, float s_enc) {
  const float factor = s_enc * kOneSixth;
  float v = fminf(block_amax * factor, kFltMax);
  v = fminf(fmaxf(v, -kE4M3Max), kE4M3Max);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Exact FP32 value of an E4M3 (float8_e4m3fn) byte; 0x7F/0xFF (NaN) never occur as scales.
NVFP4_HD float e4m3_to_float(uint8_t byte) {
  const uint32_t sign = static_cast<uint32_t>(byte >> 7) << 31;
  const uint32_t exponent = (byte >> 3) & 0xF;
  const uint32_t mantissa = byte & 0x7;
  if (exponent == 0) {  // subnormal: mantissa * 2^-9, exact
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// e_b = min(1 / (fp32(s_b) * S_dec), FLT_MAX) (SPEC 2.4).
NVFP4_HD float block_encode_factor(uint8_t scale, float s_dec) {
  const float denominator = e4m3_to_float(scale) * s_dec;
#ifdef __CUDA_ARCH__
  return fminf(__frcp_rn(denominator), kFltMax);  // the correctly rounded 1 / denominator
#else
  return fminf(1.0f / denominator, kFltMax);
#endif
}

NVFP4_HD float clamp_fp4(float v) { return fminf(fmaxf(v, -kFp4Max), kFp4Max); }

// x + kRoundMagic holds round-to-nearest-even(x) in its low mantissa bits, for 0 <= x < 2^22.
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23, whose ulp is 1

// floor(x) + kRoundMagic for 0 <= x < 2^22 (one FADD rounding down on the GPU).
NVFP4_HD float add_magic_round_down(float x) {
#ifdef __CUDA_ARCH__
  return __fadd_rd(x, kRoundMagic);
#else
  return floorf(x) + kRoundMagic;
#endif
}

// Index 0..7 of the FP4 magnitude nearest to a >= 0 (ties to the even code; above 6 gives 7), SPEC 2.5.
// The grid has steps 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6]; rounding a on each step gives the
// candidates rint(2a), rint(a) + 2 and rint(a/2) + 4, and the smallest of them (and 7) is the index.
// Each candidate is one exactly-rounded FMA/FADD into the magic constant's integer bits.
NVFP4_HD uint32_t fp4_index_rne(float a) {
  const float fine = fmaf(a, 2.0f, kRoundMagic);
  const float middle = a + (kRoundMagic + 2.0f);
  const float coarse = fmaf(a, 0.5f, kRoundMagic + 4.0f);
  const float best = fminf(fminf(fine, middle), fminf(coarse, kRoundMagic + 7.0f));
  return float_bits(best) & 0xFu;
}

// Code of a value (clamped to [-6, 6] or not: beyond 6 saturates), round to nearest even on the
// E2M1 grid. A negative value that rounds to 0 gives code 8; -0.0 gives code 0 (sign test v < 0).
NVFP4_HD uint32_t fp4_code_rne(float v) { return fp4_index_rne(fabsf(v)) | (v < 0.0f ? 8u : 0u); }

// Magnitude of FP4 code index 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
NVFP4_HD float fp4_magnitude(uint32_t index) {
  return index < 4 ? 0.5f * static_cast<float>(index) : (index == 4 ? 2.0f : (index == 5 ? 3.0f : (index == 6 ? 4.0f : 6.0f)));
}

// Exact FP32 value of an FP4 code: E2M1 bits placed in an FP16 are the value times 2^-14.
NVFP4_HD float fp4_value(uint32_t code) {
  const uint16_t half_bits = static_cast<uint16_t>(((code & 7u) << 9) | ((code & 8u) << 12));
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(half_bits)) * 16384.0f;
#else
  const float magnitude = fp4_magnitude(code & 7u);
  (void)half_bits;
  return (code & 8u) ? -magnitude : magnitude;
#endif
}

// Stochastic rounding of v in [-6, 6] with 16 random bits (SPEC 7, reference/quantize.py):
// up in magnitude iff float(bits) < p * 65536, p = (|v| - lo) / (hi - lo).
// On the step of a's range (0.5, 1 or 2), q = a / step is exact, lo / step = floor(q), and
// p = q - floor(q) equals the reference's correctly rounded division (both are exact).
NVFP4_HD uint32_t fp4_code_stochastic(float v, uint32_t bits16) {
  const float a = fabsf(v);
  const bool fine = a < 2.0f, middle = a < 4.0f;
  const float inverse_step = fine ? 2.0f : (middle ? 1.0f : 0.5f);
  const uint32_t first_index = fine ? 0u : (middle ? 2u : 4u);
  const float q = a * inverse_step;
  const float floor_plus_magic = add_magic_round_down(q);
  const float probability_up = q - (floor_plus_magic - kRoundMagic);
  const uint32_t lower = (float_bits(floor_plus_magic) & 0xFu) + first_index;
  uint32_t magnitude = lower + (static_cast<float>(bits16) < probability_up * 65536.0f ? 1u : 0u);
  magnitude = magnitude > 7 ? 7 : magnitude;
  return magnitude | (v < 0.0f ? 8u : 0u);
}

// Philox4x32-10, the same as curand's Philox4_32_10 and reference/philox.py.
struct PhiloxWords {
  uint32_t w[4];
};

NVFP4_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#ifdef __CUDA_ARCH__
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
#endif
}

NVFP4_HD PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(0xD2511F53u, c0, hi0, lo0);
    mulhilo32(0xCD9E8D57u, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// The 4 Philox words serving the 8 columns [8*group, 8*group+8) of global row `row` in `stream`.
NVFP4_HD PhiloxWords stochastic_rounding_words(uint64_t row, uint64_t group, uint32_t stream, uint64_t seed) {
  return philox4x32_10(static_cast<uint32_t>(row), static_cast<uint32_t>(group), stream, 0u,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// 16 random bits of global column `col` from its group's words: word (col%8)/2, low half for even col.
NVFP4_HD uint32_t bits_of_column(const PhiloxWords& words, uint32_t column_in_group) {
  const uint32_t word_index = column_in_group >> 1;
  const uint32_t word = word_index == 0 ? words.w[0] : (word_index == 1 ? words.w[1] : (word_index == 2 ? words.w[2] : words.w[3]));
  return (column_in_group & 1u) ? (word >> 16) : (word & 0xFFFFu);
}

// The RHT sign of entry (i, j) of H = diag(s) . H16 / 4 (SPEC 5): true where the entry is -1/4.
constexpr uint32_t kRhtSignMask = 0xD7E8u;  // bit i set where s_i = -1: s = 1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1
NVFP4_HD constexpr bool parity4(int v) { return ((v ^ (v >> 1) ^ (v >> 2) ^ (v >> 3)) & 1) != 0; }
NVFP4_HD constexpr bool rht_entry_negative(int i, int j, bool random_sign) {
  return parity4(i & j) != (random_sign && ((kRhtSignMask >> i) & 1u));
}

// y = c . H for one 16-chunk, in FP32, summed in index order i = 0..15 (the order of torch's CPU
// matmul of [., 16] x [16, 16], which every product c_i * (+-1/4) enters exactly).
template <bool kRandomSign>
NVFP4_HD void rht_chunk(const float (&c)[kBlockSize], float (&y)[kBlockSize]) {
  float quarter[kBlockSize];
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) quarter[i] = c[i] * 0.25f;
#pragma unroll
  for (int j = 0; j < kBlockSize; ++j) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) acc = rht_entry_negative(i, j, kRandomSign) ? acc - quarter[i] : acc + quarter[i];
    y[j] = acc;
  }
}

// x = y . H^T for one 16-chunk (the inverse transform), summed in index order j = 0..15.
template <bool kRandomSign>
NVFP4_HD void inverse_rht_chunk(const float (&y)[kBlockSize], float (&x)[kBlockSize]) {
  float quarter[kBlockSize];
#pragma unroll
  for (int j = 0; j < kBlockSize; ++j) quarter[j] = y[j] * 0.25f;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kBlockSize; ++j) acc = rht_entry_negative(i, j, kRandomSign) ? acc - quarter[j] : acc + quarter[j];
    x[i] = acc;
  }
}

}  // namespace nvfp4
