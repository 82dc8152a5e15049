// NVFP4 numerics shared by the kernels: docs/numerics.md sections 2, 5 and 7, element by element.
// Every function is __host__ __device__ so a host build can check it against the reference.
// All arithmetic is FP32 in the SPEC's order; compile without fast-math and with -fmad=false.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#define NVFP4_HD __host__ __device__ __forceinline__

namespace nvfp4 {

constexpr int kBlockSize = 16;                       // elements per block scale
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr float kGlobalScaleNumerator = 2688.0f;     // 448 * 6
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

// S_enc = min(6 B / A, FLT_MAX); 1.0 where that is 0 (A = inf). One IEEE division (docs/numerics.md §2.2). The
// numerator 6 B is 2688 (B = 448), or 1536 for 4over6 tensors with the bound 256 (docs/numerics.md §12.1).
NVFP4_HD float encode_scale(float amax, float numerator = kGlobalScaleNumerator) {
  float s_enc = fminf(numerator / amax, kFltMax);
  return s_enc == 0.0f ? 1.0f : s_enc;
}

NVFP4_HD float decode_scale(float s_enc) { return 1.0f / s_enc; }

// The GEMM's alpha = S_dec(a) * S_dec(b) from the operands' amaxes (docs/numerics.md §8), one FP32 product; each
// operand's numerator 6 B (2688, or 1536 for 4over6 tensors with the bound 256, docs/numerics.md §12.7).
NVFP4_HD float gemm_alpha(float a_amax, float b_amax, float a_numerator = kGlobalScaleNumerator,
                          float b_numerator = kGlobalScaleNumerator) {
  return decode_scale(encode_scale(a_amax, a_numerator)) * decode_scale(encode_scale(b_amax, b_numerator));
}

// E4M3 block scale s_b = e4m3(clamp(min(a_b * (S_enc * fp32(1/6)), FLT_MAX), +-448)), RNE (docs/numerics.md §2.3), for
// block_amax >= 0 (or NaN) and a finite factor = S_enc * fp32(1/6) > 0: the product is then in
// [0, +inf], and SATFINITE alone clamps it to 448 (+inf included; a NaN stays NaN, 0x7F, as the
// reference's clamp leaves it). On the GPU the byte comes zero-extended from the conversion itself,
// so that indexing a table with it needs no mask.
NVFP4_HD uint32_t block_scale_e4m3_of_nonnegative(float block_amax, float factor) {
#ifdef __CUDA_ARCH__
  uint32_t byte;
  asm("{.reg .b16 h, z; mov.b16 z, 0; cvt.rn.satfinite.e4m3x2.f32 h, %1, %2; mov.b32 %0, {h, z};}"
      : "=r"(byte)
      : "f"(0.0f), "f"(block_amax * factor));
  return byte;
#else
  return __nv_cvt_float_to_fp8(block_amax * factor, __NV_SATFINITE, __NV_E4M3);
#endif
}

// Exact FP32 value of an E4M3 (float8_e4m3fn) byte; 0x7F/0xFF (NaN) occur as scales only for a NaN amax,
// and decode here as 480 (not NaN).
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

// e_b = min(1 / (fp32(s_b) * S_dec), FLT_MAX) (docs/numerics.md §2.4).
NVFP4_HD float block_encode_factor(uint8_t scale, float s_dec) {
  const float denominator = e4m3_to_float(scale) * s_dec;
#ifdef __CUDA_ARCH__
  return fminf(__frcp_rn(denominator), kFltMax);  // the correctly rounded 1 / denominator
#else
  return fminf(1.0f / denominator, kFltMax);
#endif
}

NVFP4_HD float clamp_fp4(float v) { return fminf(fmaxf(v, -kFp4Max), kFp4Max); }

// Rounding constants c = 1.5 * 2^n, whose low 22 bits are zero: for 0 <= x < 2^(n-1) one FADD rounds x + c to
// the ulp of c, 2^(n-23) (to nearest even), and the multiple of the ulp lands in the low bits of the sum.
constexpr float kRoundToHalves = 6291456.0f;  // 1.5 * 2^22, ulp 0.5
constexpr float kRoundToOnes = 12582912.0f;   // 1.5 * 2^23, ulp 1
constexpr float kRoundToTwos = 25165824.0f;   // 1.5 * 2^24, ulp 2

// The unsigned minimum of three words' low 16 bits, in the low 16 bits (the high 16 bits: the high halves'
// minimum on the GPU, one VIMNMX3.U16x2; zero on the host).
NVFP4_HD uint32_t min_of_low_halves(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t ab, abc;
  asm("min.u16x2 %0, %1, %2;" : "=r"(ab) : "r"(a), "r"(b));
  asm("min.u16x2 %0, %1, %2;" : "=r"(abc) : "r"(ab), "r"(c));
  return abc;
#else
  const uint32_t ab = (a & 0xFFFFu) < (b & 0xFFFFu) ? (a & 0xFFFFu) : (b & 0xFFFFu);
  return ab < (c & 0xFFFFu) ? ab : (c & 0xFFFFu);
#endif
}

// The index 0..7 of the FP4 magnitude nearest to |v| < 7 (ties to the even code) in the low 16 bits, docs/numerics.md §2.5.
// The grid has steps 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6]; rounding |v| on each step gives the
// candidates rint(2|v|), rint(|v|) + 2 and rint(|v|/2) + 4, each one exactly-rounded FADD of a rounding
// constant (the + 2 and + 4 folded into it), and the smallest of them is the index (below 7 the coarse one
// is at most 7, so no saturation step). Immediate operands only: no constant held in a register.
NVFP4_HD uint32_t fp4_index_rne_below_7_in_low_half(float v) {
  const float a = fabsf(v);
  const uint32_t fine = float_bits(a + kRoundToHalves);            // low half rint(2a)
  const uint32_t middle = float_bits(a + (kRoundToOnes + 2.0f));   // rint(a) + 2
  const uint32_t coarse = float_bits(a + (kRoundToTwos + 8.0f));   // rint(a / 2) + 4
  return min_of_low_halves(fine, middle, coarse);
}

// The FP4 code (0..15) of v: round to nearest even on the E2M1 grid, saturating above 6 (an index capped
// at 7; NaN gives 7), docs/numerics.md §2.5. A negative value that rounds to 0 gives code 8; -0.0 gives 0.
NVFP4_HD uint32_t fp4_code_rne(float v) {
  const uint32_t index = fabsf(v) < 7.0f ? fp4_index_rne_below_7_in_low_half(v) & 0xFFFFu : 7u;
  return index | (v < 0.0f ? 8u : 0u);
}

// Eight codes in the low bits of words whose bits 4..7 are clear -> one word, element i in nibble i: each
// pair's byte is the low byte of (odd << 4) + even (one LEA), three byte permutes gather them.
NVFP4_HD uint32_t pack_eight_codes(const uint32_t* codes) {
  uint32_t pairs[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) pairs[p] = (codes[2 * p + 1] << 4) + codes[2 * p];
#ifdef __CUDA_ARCH__
  return __byte_perm(__byte_perm(pairs[0], pairs[1], 0x0040), __byte_perm(pairs[2], pairs[3], 0x0040), 0x5410);
#else
  return (pairs[0] & 0xFFu) | ((pairs[1] & 0xFFu) << 8) | ((pairs[2] & 0xFFu) << 16) | ((pairs[3] & 0xFFu) << 24);
#endif
}

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

// Stochastic rounding (docs/numerics.md §7) of a = min(|v|, 6) on the FP32 bits, the reference's rule
// (reference/quantize.py): up in magnitude iff bits16 < p * 65536, p = (a - lo) / (hi - lo).
// The carrier c = RU(a * 2^-126) puts a in the E2M1 grid's shape: [0, 1) lands in FP32's subnormals,
// whose step 2^-149 matches that of the first normal binade [2^-126, 2^-125), so the grid's uniform
// steps of 1/2 below 2 and its one-mantissa-bit steps above are alike "2 steps per binade". c's bits
// hold 2^22 * (lo's index) + 2^22 * p: exactly for a >= 1 (a power-of-2 scaling), and rounded up on
// the 2^-23 grid of a for a < 1 (rounding up commutes with comparing against the thresholds below).
// One FMUL.RP on the GPU (denormals kept: no -ftz).
NVFP4_HD uint32_t stochastic_rounding_carrier_bits(float a) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(__fmul_ru(a, 1.17549435082228750797e-38f));  // 2^-126
#else
  if (a >= 1.0f) return float_bits(a) - (126u << 23);
  return static_cast<uint32_t>(std::ceil(static_cast<double>(a) * 8388608.0));  // 2^23 is 2^-126's bits
#endif
}

// The subtrahend that turns 4 * carrier bits into the index in bits 24..27: bits 0..23 hold
// bits16 * 256 + 1, so subtracting them from the fraction 4 * p * 2^22 borrows from bit 24 unless
// p * 65536 > bits16; bits 24..31 hold 255, -1 mod 256, which that borrow, or its absence, makes
// lo's index or lo's index + 1.
NVFP4_HD uint32_t stochastic_rounding_subtrahend(uint32_t bits16) { return (255u << 24) | (bits16 << 8) | 1u; }

// The stochastic FP4 magnitude index of a = min(|v|, 6) in bits 24..27 (bit 27 clear), bits 28..31 clear,
// bits 0..23 arbitrary: one FMUL and IMAD. For 6 <= a < 8 the index is 7 or 8 (bit 27 set), for
// 4 <= a < 6 as for a itself.
NVFP4_HD uint32_t fp4_magnitude_stochastic_word(float a, uint32_t subtrahend) {
  return stochastic_rounding_carrier_bits(a) * 4u - subtrahend;
}

// Eight packed stochastic magnitude indices (nibbles 0..8) with 8, from magnitudes in [6, 8), made 7:
// what min(|v|, 6) gives. Three instructions for eight elements instead of one FMNMX per element.
NVFP4_HD uint32_t saturate_stochastic_codes(uint32_t packed) { return packed - ((packed & 0x88888888u) >> 3); }

// The stochastic FP4 code of v: v < 0 sets the sign (a negative value that rounds to 0 gives code 8;
// -0.0 and NaN do not), NaN rounds as 6.
NVFP4_HD uint32_t fp4_code_stochastic(float v, uint32_t bits16) {
  const uint32_t magnitude = fp4_magnitude_stochastic_word(fminf(fabsf(v), kFp4Max), stochastic_rounding_subtrahend(bits16));
  return (magnitude >> 24) | (v < 0.0f ? 8u : 0u);
}

// Eight codes in bits 24..27 of their words -> one word, element i in nibble i: the even and the odd
// elements' top bytes gathered by three byte permutes each, then one shift-add (one LEA).
NVFP4_HD uint32_t pack_eight_top_byte_codes(const uint32_t* words) {
#ifdef __CUDA_ARCH__
  const uint32_t even = __byte_perm(__byte_perm(words[0], words[2], 0x0073), __byte_perm(words[4], words[6], 0x0073), 0x5410);
  const uint32_t odd = __byte_perm(__byte_perm(words[1], words[3], 0x0073), __byte_perm(words[5], words[7], 0x0073), 0x5410);
  return (odd << 4) + even;  // one LEA: the bytes' indices are at most 8, so the nibbles do not carry
#else
  uint32_t packed = 0;
  for (int i = 0; i < 8; ++i) packed |= (words[i] >> 24) << (4 * i);
  return packed;
#endif
}

// PTX prmt.b32 with an immediate selector: byte i of the result is byte (nibble i & 7) of b:a; a nibble with bit 3
// set fills its byte with the sign (bit 7) of the byte it names.
template <uint32_t kSelector>
NVFP4_HD uint32_t byte_permute(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "n"(kSelector));
  return d;
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (kSelector >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

// The FP4 sign bits of eight values whose sign bit is set only where v < 0 (no -0.0): element i's
// sign bit in bit 4i + 3. Three sign-filling byte permutes gather the even elements' signs as bytes
// 0xFF/0x00, three the odd elements', and two LOPs keep bit 3 and bit 7 of each byte.
NVFP4_HD uint32_t sign_bits_of_eight(const float* v) {
  constexpr uint32_t kSignsOfTwo = 0xFB;  // byte 0: sign of a's byte 3, byte 1: sign of b's byte 3
  const uint32_t even = byte_permute<0x5410>(byte_permute<kSignsOfTwo>(float_bits(v[0]), float_bits(v[2])),
                                             byte_permute<kSignsOfTwo>(float_bits(v[4]), float_bits(v[6])));
  const uint32_t odd = byte_permute<0x5410>(byte_permute<kSignsOfTwo>(float_bits(v[1]), float_bits(v[3])),
                                            byte_permute<kSignsOfTwo>(float_bits(v[5]), float_bits(v[7])));
  return (even & 0x08080808u) | (odd & 0x80808080u);
}

// Blackwell's FP4 conversion: cvt.rn.satfinite.e2m1x2.f32 rounds two FP32 values to nearest even on the E2M1 grid,
// saturating to +-6, and keeps each sign bit (a value of either sign that rounds to zero keeps its sign: code 8 for a
// negative one and for -0.0; a NaN gives 7). On values that encode_block has scaled (and clamped where it may
// overflow) that is its code, index | sign bit: one instruction for two codes where the emulation takes ten. The
// instruction exists in the Blackwell targets' arch- and family-specific code (sm_100a, sm_103a, sm_110a, sm_120a,
// their f variants), nowhere else; NVFP4_NATIVE_E2M1 is 1 while compiling for one of them.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000 && \
    __CUDA_ARCH_FAMILY_SPECIFIC__ < 1300
#define NVFP4_NATIVE_E2M1 1
#else
#define NVFP4_NATIVE_E2M1 0
#endif

// The E2M1 code of v as cvt.rn.satfinite.e2m1x2.f32 gives it (the instruction's documented rule, above), worked
// out on the grid itself, independently of the emulation's rounding constants: the host's model of the
// instruction, which the CPU tests compare with the emulation that Hopper runs.
NVFP4_HD uint32_t fp4_code_by_conversion_rule(float v) {
  if (v != v) return 7u;
  constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float a = fabsf(v);
  uint32_t index = 7u;  // above the midpoint of 4 and 6, 6 (and saturation above it)
  for (uint32_t k = 0; k < 7u; ++k) {
    const float midpoint = 0.5f * (kGrid[k] + kGrid[k + 1]);  // exact: grid values have one mantissa bit
    if (a < midpoint || (a == midpoint && k % 2 == 0)) {  // a tie goes to the even index
      index = k;
      break;
    }
  }
  return index | ((float_bits(v) >> 28) & 8u);
}

// Codes of eight values, element i in nibble i, as the conversion gives them: four cvt.rn.satfinite.e2m1x2.f32
// (the first source in the high nibble) where NVFP4_NATIVE_E2M1, else fp4_code_by_conversion_rule.
NVFP4_HD uint32_t fp4_codes_of_eight_by_conversion(const float* v) {
#if NVFP4_NATIVE_E2M1
  uint32_t word;
  asm("{ .reg .b8 c0, c1, c2, c3;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c0, %2, %1;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c1, %4, %3;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c2, %6, %5;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c3, %8, %7;\n"
      "  mov.b32 %0, {c0, c1, c2, c3}; }"
      : "=r"(word)
      : "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "f"(v[4]), "f"(v[5]), "f"(v[6]), "f"(v[7]));
  return word;
#else
  uint32_t word = 0u;
  for (int i = 0; i < 8; ++i) word |= fp4_code_by_conversion_rule(v[i]) << (4 * i);
  return word;
#endif
}

// fp4_codes_of_eight_by_conversion, and each pair's values as FP16 (element 2p in the low half of pairs[p], 2p + 1 in
// the high half, p = 0..3): cvt.rn.f16x2.e2m1x2 of each pair's byte where NVFP4_NATIVE_E2M1 (E2M1 values are exact in
// FP16), else the same values from fp4_value.
NVFP4_HD uint32_t fp4_codes_and_values_of_eight_by_conversion(const float* v, uint32_t* pairs) {
#if NVFP4_NATIVE_E2M1
  uint32_t word;
  asm("{ .reg .b8 c0, c1, c2, c3;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c0, %6, %5;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c1, %8, %7;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c2, %10, %9;\n"
      "  cvt.rn.satfinite.e2m1x2.f32 c3, %12, %11;\n"
      "  mov.b32 %0, {c0, c1, c2, c3};\n"
      "  cvt.rn.f16x2.e2m1x2 %1, c0;\n"
      "  cvt.rn.f16x2.e2m1x2 %2, c1;\n"
      "  cvt.rn.f16x2.e2m1x2 %3, c2;\n"
      "  cvt.rn.f16x2.e2m1x2 %4, c3; }"
      : "=r"(word), "=r"(pairs[0]), "=r"(pairs[1]), "=r"(pairs[2]), "=r"(pairs[3])
      : "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "f"(v[4]), "f"(v[5]), "f"(v[6]), "f"(v[7]));
  return word;
#else
  const uint32_t word = fp4_codes_of_eight_by_conversion(v);
  for (int p = 0; p < 4; ++p) {
    const auto half_bits = [&](int i) {
      return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(fp4_value((word >> (4 * i)) & 0xFu))));
    };
    pairs[p] = half_bits(2 * p) | (half_bits(2 * p + 1) << 16);
  }
  return word;
#endif
}

// Philox4x32 with kRounds rounds; 10 rounds is curand's Philox4_32_10 (reference/philox.py).
struct PhiloxWords {
  uint32_t w[4];
};

// The high and low words of a * b: on the GPU one IMAD.WIDE.U32 (__umulhi and a * b give two instructions).
NVFP4_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

constexpr uint32_t kPhiloxMultiplier0 = 0xD2511F53u, kPhiloxMultiplier1 = 0xCD9E8D57u;

// Rounds kFirst .. kRounds - 1 of Philox4x32 on the state (c0, c1, c2, c3), with the round keys given:
// round r XORs k0[r] and k1[r].
template <int kRounds, int kFirst = 0>
NVFP4_HD PhiloxWords philox4x32_rounds(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, const uint32_t (&k0)[kRounds],
                                       const uint32_t (&k1)[kRounds]) {
#pragma unroll
  for (int round = kFirst; round < kRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxMultiplier0, c0, hi0, lo0);
    mulhilo32(kPhiloxMultiplier1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0[round], n2 = hi0 ^ c3 ^ k1[round];
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// The round keys of key (k0, k1): the Weyl sequence k + r * (0x9E3779B9, 0xBB67AE85).
template <int kRounds>
NVFP4_HD void philox_round_keys(uint32_t k0, uint32_t k1, uint32_t (&round_k0)[kRounds], uint32_t (&round_k1)[kRounds]) {
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    round_k0[round] = k0 + static_cast<uint32_t>(round) * 0x9E3779B9u;
    round_k1[round] = k1 + static_cast<uint32_t>(round) * 0xBB67AE85u;
  }
}

template <int kRounds>
NVFP4_HD PhiloxWords philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  uint32_t round_k0[kRounds], round_k1[kRounds];
  philox_round_keys<kRounds>(k0, k1, round_k0, round_k1);
  return philox4x32_rounds<kRounds>(c0, c1, c2, c3, round_k0, round_k1);
}

// One Philox4x32-7 call serves 16 consecutive columns of a row, 8 random bits each (reference/philox.py).
constexpr int kColumnsPerPhiloxCall = 16;
constexpr int kStochasticRoundingPhiloxRounds = 7;

// The seed of the stochastic rounding bits and its Philox round keys, computed once (for a kernel, on
// the host into its parameters) rather than in every call.
struct StochasticRoundingKeys {
  uint64_t seed;
  uint32_t k0[kStochasticRoundingPhiloxRounds], k1[kStochasticRoundingPhiloxRounds];
};

NVFP4_HD StochasticRoundingKeys stochastic_rounding_keys(uint64_t seed) {
  StochasticRoundingKeys keys;
  keys.seed = seed;
  philox_round_keys<kStochasticRoundingPhiloxRounds>(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                                                     keys.k0, keys.k1);
  return keys;
}

// The stochastic rounding counter of the 16 columns [16*group, 16*group+16) of global row `row` in
// `stream` is (group, row, stream, 0) (reference/philox.py). A thread's blocks share their group and
// stream and differ in the row, the counter word that enters round 0 through an XOR, not a multiply:
// rounds 0-2 are then mostly the group's, computed once per thread (PhiloxGroupPrefix, the keys that
// meet them folded in): a call skips round 0's two products and one of each of rounds 1 and 2.
// Rounds count from 0, as in philox4x32_rounds; "state r" is the state after round r.
struct PhiloxGroupPrefix {
  uint32_t row_mask;     // state 0's c0 = row ^ row_mask
  uint32_t state1_mask;  // state 1's c2 = hi(M0 * state 0's c0) ^ state1_mask
  uint32_t state2_mask;  // state 2's c0 = hi(M1 * state 1's c2) ^ state2_mask
  uint32_t state2_c2;    // state 2's c2 = state2_c2 ^ state 1's c3
  uint32_t state2_c3;    // state 2's c3
};

NVFP4_HD PhiloxGroupPrefix stochastic_rounding_group_prefix(uint64_t group, uint32_t stream,
                                                            const StochasticRoundingKeys& keys) {
  // state 0 = (hi(M1 stream) ^ row ^ k0[0], lo(M1 stream), hi(M0 group) ^ k1[0], lo(M0 group))
  uint32_t group_hi, group_lo, stream_hi, stream_lo;
  mulhilo32(kPhiloxMultiplier0, static_cast<uint32_t>(group), group_hi, group_lo);
  mulhilo32(kPhiloxMultiplier1, stream, stream_hi, stream_lo);
  // state 1's c0 = hi(M1 * state 0's c2) ^ state 0's c1 ^ k0[1] and c1 = lo(M1 * state 0's c2): the group's
  uint32_t hi, lo;
  mulhilo32(kPhiloxMultiplier1, group_hi ^ keys.k1[0], hi, lo);
  const uint32_t state1_c0 = hi ^ stream_lo ^ keys.k0[1], state1_c1 = lo;
  // state 2's c2 = hi(M0 * state 1's c0) ^ state 1's c3 ^ k1[2], c3 = lo(M0 * state 1's c0)
  mulhilo32(kPhiloxMultiplier0, state1_c0, hi, lo);
  return PhiloxGroupPrefix{stream_hi ^ keys.k0[0], group_lo ^ keys.k1[1], state1_c1 ^ keys.k0[2], hi ^ keys.k1[2], lo};
}

// The 4 Philox words serving the 16 columns of the prefix's group in global row `row`.
NVFP4_HD PhiloxWords stochastic_rounding_words(const PhiloxGroupPrefix& prefix, uint64_t row,
                                               const StochasticRoundingKeys& keys) {
  uint32_t hi, lo;
  mulhilo32(kPhiloxMultiplier0, static_cast<uint32_t>(row) ^ prefix.row_mask, hi, lo);
  const uint32_t state1_c2 = hi ^ prefix.state1_mask, state1_c3 = lo;
  mulhilo32(kPhiloxMultiplier1, state1_c2, hi, lo);
  return philox4x32_rounds<kStochasticRoundingPhiloxRounds, 3>(hi ^ prefix.state2_mask, lo, prefix.state2_c2 ^ state1_c3,
                                                                prefix.state2_c3, keys.k0, keys.k1);
}

NVFP4_HD PhiloxWords stochastic_rounding_words(uint64_t row, uint64_t group, uint32_t stream,
                                               const StochasticRoundingKeys& keys) {
  return stochastic_rounding_words(stochastic_rounding_group_prefix(group, stream, keys), row, keys);
}

// The comparison value (byte << 8) of the column at position 0..15 in its group: byte (position % 4)
// of word position / 4.
NVFP4_HD uint32_t bits_of_column(const PhiloxWords& words, uint32_t column_in_group) {
  const uint32_t word_index = column_in_group >> 2;
  const uint32_t word = word_index == 0 ? words.w[0] : (word_index == 1 ? words.w[1] : (word_index == 2 ? words.w[2] : words.w[3]));
  return ((word >> (8 * (column_in_group & 3))) & 0xFFu) << 8;
}

static __constant__ uint32_t kStochasticSubtrahendBytes = 0xFF000001u;  // stochastic_rounding_subtrahend's constant bytes

// stochastic_rounding_subtrahend(bits_of_column(words, column_in_group)); on the GPU one PRMT of the
// word and the constant bytes.
NVFP4_HD uint32_t stochastic_rounding_subtrahend_of_column(const PhiloxWords& words, uint32_t column_in_group) {
#ifdef __CUDA_ARCH__
  const uint32_t word_index = column_in_group >> 2;
  const uint32_t word = word_index == 0 ? words.w[0] : (word_index == 1 ? words.w[1] : (word_index == 2 ? words.w[2] : words.w[3]));
  // bytes: 0x01, 0x00, byte, 0xFF; the constant bytes come from constant memory, so that the
  // selector can stay an immediate (with both immediate, ptxas moves the selector into a register)
  uint32_t subtrahend;
  switch (column_in_group & 3u) {
    case 0: asm("prmt.b32 %0, %1, %2, 0x7054;" : "=r"(subtrahend) : "r"(word), "r"(kStochasticSubtrahendBytes)); break;
    case 1: asm("prmt.b32 %0, %1, %2, 0x7154;" : "=r"(subtrahend) : "r"(word), "r"(kStochasticSubtrahendBytes)); break;
    case 2: asm("prmt.b32 %0, %1, %2, 0x7254;" : "=r"(subtrahend) : "r"(word), "r"(kStochasticSubtrahendBytes)); break;
    default: asm("prmt.b32 %0, %1, %2, 0x7354;" : "=r"(subtrahend) : "r"(word), "r"(kStochasticSubtrahendBytes)); break;
  }
  return subtrahend;
#else
  return stochastic_rounding_subtrahend(bits_of_column(words, column_in_group));
#endif
}

// The comparison value of the element at global (row, column): one whole Philox call, kept out of line
// for the blocks that straddle two groups (a shard offset that is not a multiple of 16).
static __host__ __device__ __noinline__ uint32_t stochastic_rounding_bits_at(uint64_t row, uint64_t column,
                                                                            uint32_t stream, uint64_t seed) {
  const PhiloxWords words = stochastic_rounding_words(row, column / kColumnsPerPhiloxCall, stream, stochastic_rounding_keys(seed));
  return bits_of_column(words, static_cast<uint32_t>(column % kColumnsPerPhiloxCall));
}

// The RHT sign vector s of H = diag(s) . H16 / 4 (docs/numerics.md §5): bit i set where s_i = -1.
constexpr uint32_t kRhtSignMask = 0xD7E8u;  // bit i set where s_i = -1: s = 1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1

// out = t . H16 by the fast Walsh-Hadamard transform: butterflies (a, b) -> (a + b, a - b) on the pairs
// (i, i + h), i & h == 0, for h = 1, 2, 4, 8 in turn; 64 FP32 additions. Here the stages from h =
// first_half_width on (2 when the caller did the first stage itself). This order of the additions
// is the reference's (reference/rht.py hadamard_butterflies), so the rounded sums match it bit for
// bit. No sum is -0.0 when no term is (a - a and -a + a are +0 under round to nearest).
NVFP4_HD void hadamard_butterflies_from(float (&t)[kBlockSize], int first_half_width) {
#pragma unroll
  for (int h = first_half_width; h < kBlockSize; h *= 2) {
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) {
      if (i & h) continue;
      const float a = t[i], b = t[i + h];
      t[i] = a + b;
      t[i + h] = a - b;
    }
  }
}

// y = c . H for one 16-chunk of BF16 values c, H = diag(s) . H16 / 4 (reference: rht_chunks), bit for bit but
// for the sign of exact zeros, and with the odd outputs negated: out[i] = y_i for even i, -y_i for odd i.
// The terms t_i = c_i * (s_i / 4) are exact, so the first butterfly stage (t_i + t_j, t_i - t_j), j = i + 1,
// is two FMAs of c_i * (+-s_i / 4) onto t_j, only t_j computed: y_i and -(t_i - t_j) (the FMA's addend takes
// no negation next to an immediate factor). Negation commutes with rounding, and the later stages pair
// lanes of one parity, so the odd lanes just stay negated. A zero sum may come out -0.0 where the
// reference's + 0 makes it +0.0; no code or scale depends on that (a cast's scaled value v * e + 0 is
// +0.0 for both, and amaxes take |v|).
template <bool kRandomSign>
NVFP4_HD void rht_chunk_odd_negated(const float (&c)[kBlockSize], float (&out)[kBlockSize]) {
  constexpr auto quarter = [](int i) { return (kRandomSign && ((kRhtSignMask >> i) & 1u)) ? -0.25f : 0.25f; };
#pragma unroll
  for (int i = 0; i < kBlockSize; i += 2) {
    const float odd_term = c[i + 1] * quarter(i + 1);
    out[i] = fmaf(c[i], quarter(i), odd_term);
    out[i + 1] = fmaf(c[i], -quarter(i), odd_term);
  }
  hadamard_butterflies_from(out, 2);
}

// x = y . H^T for one 16-chunk, the inverse transform (reference: inverse_rht_chunks): terms
// y_j * (1/4) rounded, + 0, the butterflies, then the sign s_i of output i as 0 - sum (exact, and an
// exactly-zero sum stays +0).
template <bool kRandomSign>
NVFP4_HD void inverse_rht_chunk(const float (&y)[kBlockSize], float (&x)[kBlockSize]) {
#pragma unroll
  for (int j = 0; j < kBlockSize; ++j) x[j] = y[j] * 0.25f + 0.0f;  // two roundings (-fmad=false): y need not be BF16
  hadamard_butterflies_from(x, 1);
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) {
    if (kRandomSign && ((kRhtSignMask >> i) & 1u)) x[i] = 0.0f - x[i];
  }
}


// The smallest encode factor for which v * encode of every nonzero 16-bit value (BF16 down to 2^-133,
// FP16 down to 2^-24) is at least 2^-149, so nonzero: no product underflows to -0.0.
constexpr float kEncodeKeepingSixteenBitProductsNonzero = 1.52587890625e-05f;  // 2^-16

// e_b (always > 0) as the casts pass it to encode_block: negated where it is below
// kEncodeKeepingSixteenBitProductsNonzero, so that one unsigned compare of block_amax * encode's bits finds
// both rare cases of a 16-bit block (a negative product's sign bit puts it above every positive float).
// Idempotent.
NVFP4_HD float underflow_marked_encode(float encode) {
  const float magnitude = fabsf(encode);
  return magnitude >= kEncodeKeepingSixteenBitProductsNonzero ? magnitude : -magnitude;
}

// e_b as encode_block<kSR> takes it: marked for round to nearest, e_b itself for stochastic rounding.
template <bool kSR>
NVFP4_HD float encode_block_factor(float e_b) { return kSR ? e_b : underflow_marked_encode(e_b); }

// Packed codes of one block of 16 values that are consecutive along the quantized dimension, round
// to nearest even, or stochastic with the Philox bits of global row `sr_row`, global columns
// sr_column .. sr_column + 15 of the copy in `stream` (docs/numerics.md §7).
// block_amax: an upper bound of their |value| (NaN allowed). Round to nearest skips the saturation
// when block_amax * encode < 7 (rounding is monotonic, so every |value * encode| is below 7 too), and
// clamps to +-6 first otherwise.
// The sign bits come from the scaled values' sign bits (sign_bits_of_eight), which must then be set
// only where value * encode < 0: v * encode + 0 turns a -0.0 input into +0.0, and a product that
// underflows to -0.0 is made +0.0 by one more + 0 unless kSixteenBitValues (the values are BF16 or FP16
// numbers) and encode >= kEncodeKeepingSixteenBitProductsNonzero rule that out. encode: encode_block_factor<kSR>
// of e_b; for round to nearest as underflow_marked_encode gives it (its magnitude scales; a negative one marks
// the underflow case), for stochastic rounding e_b itself (marks cost the SR casts time).
// Round to nearest: both rare fixes share one branch, taken for 16-bit values where the bits of
// block_amax * encode are at least 7's as unsigned integers (a marked encode, a NaN, or a product of 7 or
// more): one compare; the + 0 changes no other value, and the clamp no code below 7.
// Stochastic rounding skips the clamp when block_amax * encode < 8 (magnitudes in [6, 8) give index 7
// or 8, and saturate_stochastic_codes makes 8 a 7), and otherwise clamps |scaled| to 6 in place, in
// its own rare branch, so that one copy of the encoding serves both cases (one branch for both fixes,
// as round to nearest has, costs the 1D SR casts register moves). The RHT SR cast, bound by compute,
// takes that one branch (kOneRareBranch).
// sr_row and sr_column are non-negative. sr_one_group: whether sr_column % 16 == 0, the block being
// one Philox group, whose PhiloxGroupPrefix in `stream` is sr_group; otherwise each element takes its
// own Philox call (a shard offset that is not a multiple of 16). A kernel passes a condition that is
// the same in all its threads (a constant, or one of its arguments), so that the branch is uniform.
// Round to nearest takes its codes from Blackwell's FP4 conversion where the target has it (NVFP4_NATIVE_E2M1), else
// from the emulation; kByConversion takes the conversion's codes on any target (its model on the host), which is how
// the CPU tests check the Blackwell encoding.
template <bool kSR, bool kSixteenBitValues = false, bool kOneRareBranch = false, bool kByConversion = false>
NVFP4_HD uint2 encode_block(const float (&values)[kBlockSize], float encode, float block_amax,
                            const StochasticRoundingKeys& keys, bool sr_one_group, const PhiloxGroupPrefix& sr_group,
                            uint32_t stream, uint64_t sr_row, uint64_t sr_column) {
  constexpr bool kConversion = !kSR && (kByConversion || NVFP4_NATIVE_E2M1);
  const float magnitude = kSR ? encode : fabsf(encode);
  float scaled[kBlockSize];
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) scaled[i] = fmaf(values[i], magnitude, 0.0f);
  if constexpr (!kSR) {
    if (!kSixteenBitValues || float_bits(block_amax * encode) >= float_bits(7.0f)) {
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) scaled[i] = clamp_fp4(scaled[i] + 0.0f);
    }
  } else {
    const bool may_underflow = !kSixteenBitValues || !(encode >= kEncodeKeepingSixteenBitProductsNonzero);
    const bool may_saturate = !(block_amax * encode < 8.0f);
    if (kOneRareBranch && (may_underflow || may_saturate)) {  // both fixes: each changes nothing it need not
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        const float sum = scaled[i] + 0.0f;
        scaled[i] = copysignf(fminf(fabsf(sum), kFp4Max), sum);
      }
    }
    if (!kOneRareBranch && may_underflow) {
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) scaled[i] = scaled[i] + 0.0f;
    }
    if (!kOneRareBranch && may_saturate) {  // |scaled| <= 6 keeping the sign (a NaN becomes 6 with its sign bit)
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) scaled[i] = copysignf(fminf(fabsf(scaled[i]), kFp4Max), scaled[i]);
    }
  }
  uint2 packed;
  if constexpr (kConversion) {  // the conversion's codes carry the sign bits
    packed = make_uint2(fp4_codes_of_eight_by_conversion(scaled), fp4_codes_of_eight_by_conversion(scaled + 8));
  } else if constexpr (!kSR) {
    uint32_t indices[kBlockSize];  // the index of |scaled| in the low 16 bits
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) indices[i] = fp4_index_rne_below_7_in_low_half(scaled[i]);
    packed = make_uint2(pack_eight_codes(indices), pack_eight_codes(indices + 8));
  } else {
    // the magnitude index in bits 24..27: below 8 it comes out at most 8, which saturate_stochastic_codes
    // turns into 7, as 6 gives
    uint32_t words[kBlockSize];
    if (sr_one_group) {
      const PhiloxWords bits = stochastic_rounding_words(sr_group, sr_row, keys);
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        words[i] = fp4_magnitude_stochastic_word(fabsf(scaled[i]), stochastic_rounding_subtrahend_of_column(bits, i));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        words[i] = fp4_magnitude_stochastic_word(
            fabsf(scaled[i]),
            stochastic_rounding_subtrahend(stochastic_rounding_bits_at(sr_row, sr_column + i, stream, keys.seed)));
      }
    }
    packed = make_uint2(saturate_stochastic_codes(pack_eight_top_byte_codes(words)),
                        saturate_stochastic_codes(pack_eight_top_byte_codes(words + 8)));
  }
  if constexpr (!kConversion) {
    packed.x |= sign_bits_of_eight(scaled);
    packed.y |= sign_bits_of_eight(scaled + 8);
  }
  return packed;
}

// encode_block with the stochastic rounding seed (the keys computed here).
template <bool kSR, bool kSixteenBitValues = false, bool kByConversion = false>
NVFP4_HD uint2 encode_block(const float (&values)[kBlockSize], float encode, float block_amax, uint64_t seed,
                            uint32_t stream, uint64_t sr_row, uint64_t sr_column) {
  const StochasticRoundingKeys keys = stochastic_rounding_keys(seed);
  return encode_block<kSR, kSixteenBitValues, false, kByConversion>(
      values, encode, block_amax, keys, sr_column % kColumnsPerPhiloxCall == 0,
      stochastic_rounding_group_prefix(sr_column / kColumnsPerPhiloxCall, stream, keys), stream, sr_row, sr_column);
}

// 4over6 adaptive block scaling (docs/numerics.md §12) ----------------------------------------------------------
// Each block is encoded twice, its max mapped to 4 (block scale base * 1.5) and to 6 (base), and the candidate whose
// dequantized values lie closer to the input is kept; ties keep map-to-6. Transformer Engine's reference quantizer
// (NVFP4QuantizerRef, nvfp4_use_4over6=True) defines the bytes.

constexpr float kMapToFourFactor = 1.5f;

// The global scale of one tensor (or, row-scaled, one row) under the bound B (docs/numerics.md §12.1).
struct FourOverSixScale {
  float amax;         // A
  float s_enc;        // min(6 B / A, FLT_MAX), 1 where that is 0
  float s_dec;        // 1 / S_enc
  float denominator;  // 6 B, exact
  float reciprocal;   // fp32(1 / (6 B)), for divide_by_exact_constant
};

NVFP4_HD FourOverSixScale four_over_six_scale(float amax, float e4m3_bound) {
  const float denominator = kFp4Max * e4m3_bound;
  const float s_enc = encode_scale(amax, denominator);
  const float reciprocal = denominator == 1536.0f ? 6.51041686e-04f    // fp32(1 / 1536)
                           : denominator == 2688.0f ? 3.72023811e-04f  // fp32(1 / 2688)
                                                    : 1.0f / denominator;
  return FourOverSixScale{amax, s_enc, decode_scale(s_enc), denominator, reciprocal};
}

// a / c correctly rounded, for c = 6, 1536 or 2688 and reciprocal = fp32(1 / c): one multiply and two FMAs give the
// IEEE quotient of every significand of a (tests/test_kernels_cpu_fourover6.py checks all of them for each c), as
// long as a, the quotient and the residual are normal: the callers keep the quotient in [2^-100, 2^124].
NVFP4_HD float divide_by_exact_constant(float a, float c, float reciprocal) {
  const float q = a * reciprocal;
  return fmaf(fmaf(-q, c, a), reciprocal, q);
}

// base = div(a_b, 6) * S_enc, the division first (docs/numerics.md §12.2; not the order of §2.3); the quotient by
// divide_by_exact_constant where it is normal (and for a_b = 0), else by the IEEE division.
NVFP4_HD float four_over_six_base_scale(float block_amax, float s_enc) {
  const bool in_range = block_amax == 0.0f || (block_amax >= 6.310887241768095e-30f && block_amax <= 8.507059173023462e+37f);
  const float quotient = in_range ? divide_by_exact_constant(block_amax, kFp4Max, kOneSixth) : block_amax / kFp4Max;
  return quotient * s_enc;  // 2^-97 and 2^126 above
}

// One candidate of a block (docs/numerics.md §12.3-4): its codes, encoded as the plain casts encode (round to nearest
// even with e_c = min(1 / (fp32(s_c) * S_dec), FLT_MAX)), and its error: the sum over i = 0..15, in order, of |d_i|
// (MAE) or d_i * d_i (MSE), with d_i = ((fp4value_i * s_c) * A) / (6 B) - x_i, or with kFastMath
// d_i = fp4value_i * s_c - x_i * S_enc (targets[i] holds x_i * S_enc). fp4value_i * s_c is exact in FP32 (at most 6
// significant bits): the FP16 product the fast-math error is defined with is the same number.
// block_amax: an upper bound of the |values| (the 16x16 tile's amax for 2D blocks). Any input (NaN, inf, values that
// saturate or underflow); four_over_six_candidates takes the common case a shorter way. kByConversion: as encode_block.
template <bool kMSE, bool kFastMath, bool kSixteenBitValues, bool kByConversion = false>
NVFP4_HD float four_over_six_candidate(const float (&values)[kBlockSize], const float (&targets)[kBlockSize],
                                       float block_amax, uint32_t scale, const FourOverSixScale& global,
                                       uint2& packed) {
  const float encode = encode_block_factor<false>(block_encode_factor(static_cast<uint8_t>(scale), global.s_dec));
  packed = encode_block<false, kSixteenBitValues, false, kByConversion>(values, encode, block_amax,
                                                                        StochasticRoundingKeys{}, true,
                                                                        PhiloxGroupPrefix{}, 0u, 0u, 0u);
  const float scale_value = e4m3_to_float(static_cast<uint8_t>(scale));
  const uint32_t words[2] = {packed.x, packed.y};
  float error = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) {
    const float product = fp4_value((words[i / 8] >> (4 * (i % 8))) & 0xFu) * scale_value;
    const float difference = kFastMath ? product - targets[i] : (product * global.amax) / global.denominator - values[i];
    error = error + (kMSE ? difference * difference : fabsf(difference));
  }
  return error;
}

// Both candidates of one block: index 0 maps the max to 4, index 1 to 6.
struct FourOverSixCandidates {
  uint2 packed[2];
  uint32_t scale[2];
  float error[2];
};

// The common case, in which a candidate's codes and error follow from |x_i| alone: 16-bit values (no -0.0 product
// once x + 0 has no -0.0), encode >= 2^-16 (no product underflows to zero), block_amax * encode below the limit (no
// saturation; false for NaN), and for the exact error, quotients of divide_by_exact_constant in its range: every nonzero
// product fp4value * s_c * A lies in [s_c A / 2, 6 s_c A], so s_c A in [2^-80, 2^110] (or s_c = 0) with A <= 2^113
// (A * 2^14 finite) keeps them there. Only the lower end binds: encode >= 2^-16 already means s_c A <= 6 B 2^16 and,
// for s_c > 0, A <= 6 B 2^25; with s_c = 0 both candidates are the same block and an overflowing A * 2^14 changes no
// byte. The upper bounds stay as the statement of the range.
// All but the limit depend on the scale byte and the tensor alone: four_over_six_byte folds them into its
// common_encode, and a block is in the common case where block_amax * common_encode < limit (7, or for the map-to-4
// candidate kMapToFourLimit).

// What a candidate needs of its scale byte under one tensor scale: the byte's value, and its e_b where the byte admits
// the common case (else NaN, which fails every limit). The kernels keep these per byte in shared memory.
struct FourOverSixByte {
  float value;
  float common_encode;
};

template <bool kFastMath>
NVFP4_HD FourOverSixByte four_over_six_byte(uint32_t scale, const FourOverSixScale& global) {
  const float value = e4m3_to_float(static_cast<uint8_t>(scale));
  const float encode = block_encode_factor(static_cast<uint8_t>(scale), global.s_dec);
  const float product = value * global.amax;
  const bool in_range = kFastMath || (global.amax <= 1.0384593717069655e+34f &&  // 2^113
                                      (value == 0.0f || (product >= 8.271806125530277e-25f &&
                                                         product <= 1.298074214633707e+33f)));  // 2^-80, 2^110
  return FourOverSixByte{value, encode >= kEncodeKeepingSixteenBitProductsNonzero && in_range ? encode : NAN};
}

// four_over_six_byte of every scale byte, computed (the kernels look them up in a table of these values).
template <bool kFastMath>
struct FourOverSixBytes {
  FourOverSixScale global;
  NVFP4_HD FourOverSixByte operator()(uint32_t scale) const { return four_over_six_byte<kFastMath>(scale, global); }
};

// The two FP16 values of `pair` (low half even, high half odd) times s, as FP32 (s_pair: the FP16 bits of s in both
// halves): one packed FP16 multiply, exact where each product has at most 11 significant bits and lies in FP16's range
// down to its smallest subnormal, 2^-24. kMultiply: without it, s = 1 and no multiply.
template <bool kMultiply>
NVFP4_HD void fp16_pair_products(uint32_t pair, uint32_t s_pair, float& even, float& odd) {
#ifdef __CUDA_ARCH__
  const __half2 values = *reinterpret_cast<const __half2*>(&pair);
  const float2 both = __half22float2(kMultiply ? __hmul2(values, *reinterpret_cast<const __half2*>(&s_pair)) : values);
  even = both.x;
  odd = both.y;
#else
  const auto half_value = [](uint32_t bits) { return __half2float(__ushort_as_half(static_cast<unsigned short>(bits))); };
  const float s = kMultiply ? half_value(s_pair & 0xFFFFu) : 1.0f;
  even = half_value(pair & 0xFFFFu) * s;  // exact, as the callers' products are
  odd = half_value(pair >> 16) * s;
#endif
}

// fp4value(index_even) * s and fp4value(index_odd) * s, both times 2^-14, as FP32 (indices in the low halves of their
// words, s_pair: the FP16 bits of s in both halves). An index's E2M1 bits placed in an FP16 (bits 9..11) are its
// magnitude times 2^-14, and fp16_pair_products forms both products exactly: each has at most 6 significant bits
// and is a multiple of 2^-24, FP16's smallest subnormal (E2M1 values are multiples of 1/2, E4M3 ones of 2^-9).
// kMultiply: without it, s = 1 and no multiply.
template <bool kMultiply>
NVFP4_HD void fp4_magnitude_products_scaled(uint32_t index_even, uint32_t index_odd, uint32_t s_pair, float& even,
                                            float& odd) {
  fp16_pair_products<kMultiply>(byte_permute<0x5410>(index_even, index_odd) << 9, s_pair, even, odd);
}

// The FP16 bits of an E4M3 scale value (exact) in both halves.
NVFP4_HD uint32_t half_pair_bits(float scale_value) {
  const uint32_t half = __half_as_ushort(__float2half_rn(scale_value));
  return half | (half << 16);
}

// The map-to-4 candidate's scaled magnitudes stay below this bound (about 4 * 17/16 for a normal E4M3 scale), where
// the grid's steps of 1 and 1/2 alone round them: below 4.5 the step-2 rounding adds nothing (4 and 6 are 6 and 7's
// neighbours only above 5).
constexpr float kMapToFourLimit = 4.5f;

// The index 0..7 of the FP4 magnitude nearest to 0 <= a < 4.5 (ties to the even code) in the low 16 bits: the two
// finer roundings of fp4_index_rne_below_7_in_low_half.
NVFP4_HD uint32_t fp4_index_rne_below_4_5_in_low_half(float a) {
  const uint32_t fine = float_bits(a + kRoundToHalves);
  const uint32_t middle = float_bits(a + (kRoundToOnes + 2.0f));
  return min_of_low_halves(fine, middle, middle);
}

// One candidate in the common case (see FourOverSixByte): the packed magnitudes (no sign bits) and the error.
// magnitudes[i] = |x_i|, targets[i] = |x_i| * S_enc (fast-math); kBelowFourAndAHalf: the scaled magnitudes are below
// kMapToFourLimit. kEstimate (exact error mode): the error estimated, d_i as one FMA of fp4value_i by
// fp32(s_c * fp32(A * fp32(1 / (6 B)))) less |x_i|, within four_over_six_error_slack of the exact error.
// The codes and FP4 values come from Blackwell's FP4 conversions where the target has them (NVFP4_NATIVE_E2M1; the
// scaled magnitudes are non-negative and below 7, where no clamp is needed first, as in encode_block), else from the
// emulation's indices; kByConversion takes the conversions' model on any target, which is how the CPU tests check
// the Blackwell path. Both give the same products, so the same errors: exact ones from the conversion, times 2^-14
// from the indices (the factors below undo that scaling exactly).
template <bool kMSE, bool kFastMath, bool kBelowFourAndAHalf, bool kEstimate = false, bool kByConversion = false>
NVFP4_HD float four_over_six_common_candidate(const float (&magnitudes)[kBlockSize], const float (&targets)[kBlockSize],
                                              float encode, float scale_value, const FourOverSixScale& global,
                                              uint2& packed) {
  constexpr bool kConversion = kByConversion || NVFP4_NATIVE_E2M1;
  uint32_t indices[kConversion ? 1 : kBlockSize];      // the emulation's, in the low halves
  uint32_t value_pairs[kConversion ? kBlockSize / 2 : 1];  // the conversion's FP16 values, two a word
  if constexpr (kConversion) {
    float scaled[kBlockSize];
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) scaled[i] = magnitudes[i] * encode;
    packed.x = fp4_codes_and_values_of_eight_by_conversion(scaled, value_pairs);
    packed.y = fp4_codes_and_values_of_eight_by_conversion(scaled + 8, value_pairs + 4);
  } else {
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) {
      const float scaled = magnitudes[i] * encode;
      indices[i] = kBelowFourAndAHalf ? fp4_index_rne_below_4_5_in_low_half(scaled)
                                      : fp4_index_rne_below_7_in_low_half(scaled);
    }
    packed = make_uint2(pack_eight_codes(indices), pack_eight_codes(indices + 8));
  }
  // fast-math and estimate: the FP4 values (times s = 1), then one FMA; exact: the products fp4value * s
  constexpr bool kOneFma = kFastMath || kEstimate;
  const uint32_t s_pair = half_pair_bits(kOneFma ? 1.0f : scale_value);
  constexpr float kUnscale = kConversion ? 1.0f : 16384.0f;  // 1 / the products' scale
  const float scale_scaled = scale_value * kUnscale;  // s * 2^14 (or s), exact
  const float amax_scaled = global.amax * kUnscale;   // A * 2^14 (or A), exact (A <= 2^113)
  const float estimate_factor = scale_scaled * (global.amax * global.reciprocal);  // s * A / (6 B) (* 2^14), rounded
  float error = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockSize; i += 2) {
    float products[2];  // fp4value (fast-math, estimate), fp4value * s (exact); times 2^-14 from the indices
    if constexpr (kConversion) {
      fp16_pair_products<!kOneFma>(value_pairs[i / 2], s_pair, products[0], products[1]);
    } else {
      fp4_magnitude_products_scaled<!kOneFma>(indices[i], indices[i + 1], s_pair, products[0], products[1]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // fast-math: fp4value * s - |x| * S_enc, the exact product less the target, rounded once;
      // exact: ((fp4value * s) * A) / (6 B) - |x|, with (fp4value * s * 2^-14) * (A * 2^14) the same product
      const float difference =
          kFastMath   ? fmaf(products[j], scale_scaled, -targets[i + j])
          : kEstimate ? fmaf(products[j], estimate_factor, -magnitudes[i + j])
                      : divide_by_exact_constant(products[j] * amax_scaled, global.denominator, global.reciprocal) -
                            magnitudes[i + j];
      error = error + (kMSE ? difference * difference : fabsf(difference));
    }
  }
  return error;
}

// Both candidates of a block; byte_of(scale byte) gives four_over_six_byte<kFastMath> of the byte under global
// (FourOverSixBytes, or a table of its values). A candidate's d_i has the sign of x_i (or is -x_i where the code is
// 0), so the common case takes the error on |x_i| and adds the codes' sign bits (those of x_i + 0, no -0.0) once for
// both. kEstimate (exact error mode): the common case's errors estimated (four_over_six_common_candidate), each
// within four_over_six_error_slack of the exact one; the kernels take the choice from them where
// four_over_six_settled, else from the exact errors. kByConversion: the codes from the model of Blackwell's FP4
// conversion on any target (four_over_six_common_candidate, encode_block).
template <bool kMSE, bool kFastMath, bool kSixteenBitValues, bool kEstimate = false, bool kByConversion = false,
          typename ByteOf>
NVFP4_HD FourOverSixCandidates four_over_six_candidates(const float (&values)[kBlockSize], float block_amax,
                                                        const FourOverSixScale& global, const ByteOf& byte_of) {
  static_assert(!(kEstimate && kFastMath), "fast-math errors take one FMA already");
  FourOverSixCandidates c;
  const float base = four_over_six_base_scale(block_amax, global.s_enc);
  // e4m3(clamp(base * f, +-448)): SATFINITE clamps (base >= 0, or NaN, which stays NaN)
  c.scale[0] = block_scale_e4m3_of_nonnegative(base, kMapToFourFactor);
  c.scale[1] = block_scale_e4m3_of_nonnegative(base, 1.0f);
  float targets[kBlockSize];
  if constexpr (kSixteenBitValues) {
    const FourOverSixByte bytes[2] = {byte_of(c.scale[0]), byte_of(c.scale[1])};
    if (block_amax * bytes[0].common_encode < kMapToFourLimit && block_amax * bytes[1].common_encode < 7.0f) {
      float magnitudes[kBlockSize], signed_values[kBlockSize];
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        magnitudes[i] = fabsf(values[i]);
        targets[i] = kFastMath ? magnitudes[i] * global.s_enc : 0.0f;
        signed_values[i] = values[i] + 0.0f;
      }
      const uint2 signs = make_uint2(sign_bits_of_eight(signed_values), sign_bits_of_eight(signed_values + 8));
      c.error[0] = four_over_six_common_candidate<kMSE, kFastMath, true, kEstimate, kByConversion>(
          magnitudes, targets, bytes[0].common_encode, bytes[0].value, global, c.packed[0]);
      c.error[1] = four_over_six_common_candidate<kMSE, kFastMath, false, kEstimate, kByConversion>(
          magnitudes, targets, bytes[1].common_encode, bytes[1].value, global, c.packed[1]);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        c.packed[k].x |= signs.x;
        c.packed[k].y |= signs.y;
      }
      return c;
    }
  }
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) targets[i] = kFastMath ? values[i] * global.s_enc : 0.0f;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    c.error[k] = four_over_six_candidate<kMSE, kFastMath, kSixteenBitValues, kByConversion>(
        values, targets, block_amax, c.scale[k], global, c.packed[k]);
  }
  return c;
}

template <bool kMSE, bool kFastMath, bool kSixteenBitValues, bool kEstimate = false, bool kByConversion = false>
NVFP4_HD FourOverSixCandidates four_over_six_candidates(const float (&values)[kBlockSize], float block_amax,
                                                        const FourOverSixScale& global) {
  return four_over_six_candidates<kMSE, kFastMath, kSixteenBitValues, kEstimate, kByConversion>(
      values, block_amax, global, FourOverSixBytes<kFastMath>{global});
}

// How far an estimated error (kEstimate) may lie from the exact one: `error` is the estimate, of one block or (kTile)
// the tree sum of a 16x16 tile's 16 rows, whose magnitudes are at most block_amax = a; infinite (no estimate settles)
// for a outside 2^-40 .. 2^60, where squares could leave FP32's normal range. With u = 2^-24 and, in the common case,
// t_i = fp4value_i s_c A / (6 B) <= |x_i| + |d_i|: the exact d_i rounds t_i twice (the product, the division), the
// estimate three times (1 / (6 B), A / (6 B), s_c A / (6 B)); each rounds its difference once, so they differ by at most
// 5u t_i + 2u |d_i| <= 5u |x_i| + 7u |d_i|. MAE, one block: with sum |x_i| <= 16a and both sums of 16 terms rounded
// (15u each), |estimate - exact| <= u (80a + 38 E). MSE: |d~^2 - d^2| <= (5u |x_i| + 7u |d_i|) 2 |d_i|, and
// sum |x_i| |d_i| <= 4a sqrt(E) (Cauchy-Schwarz), plus the squares' and sums' roundings: u (40a sqrt(E) + 46 E). A
// tile adds 16 rows (sum sqrt(E_r) <= 4 sqrt(E)) and its tree rounds 4 times: u (1280a + 46 E) and
// u (160a sqrt(E) + 54 E). The slack is twice those, with the estimate for E, plus 2^-34 a^2 per block for MSE
// (the estimate's own error inside the square root).
template <bool kMSE, bool kTile>
NVFP4_HD float four_over_six_error_slack(float block_amax, float error) {
  if (!(block_amax >= 9.094947017729282e-13f && block_amax <= 1.152921504606847e+18f)) return INFINITY;  // 2^-40, 2^60
  constexpr float k2u = 1.1920928955078125e-07f;  // 2^-23
  if constexpr (kMSE) {
    const float floor = block_amax * block_amax * (kTile ? 9.313225746154785e-10f : 5.820766091346741e-11f);  // 2^-30, 2^-34
    return k2u * ((kTile ? 160.0f : 40.0f) * block_amax * sqrtf(error) + (kTile ? 60.0f : 50.0f) * error) + floor;
  } else {
    return k2u * ((kTile ? 1280.0f : 80.0f) * block_amax + (kTile ? 60.0f : 40.0f) * error);
  }
}

// Whether estimated errors settle the choice: they differ by more than the sum of their slacks (false for NaN).
NVFP4_HD bool four_over_six_settled(float error_map_to_4, float error_map_to_6, float slack_4, float slack_6) {
  return fabsf(error_map_to_4 - error_map_to_6) > slack_4 + slack_6;
}

// The kept candidate's index: map-to-4 (0) only where its error is smaller; ties (and NaN) keep map-to-6 (1).
NVFP4_HD int four_over_six_choice(float error_map_to_4, float error_map_to_6) {
  return error_map_to_4 < error_map_to_6 ? 0 : 1;
}

// A 16x16 block's error from its 16 rows' (1x16 errors in row order), summed as a tree: rows (r, r + 8), then
// (r, r + 4), (r, r + 2), (r, r + 1) (docs/numerics.md §12.5). The kernels add the same pairs with warp shuffles.
NVFP4_HD float four_over_six_tile_error(const float (&row_errors)[kBlockSize]) {
  float partial[kBlockSize];
#pragma unroll
  for (int r = 0; r < kBlockSize; ++r) partial[r] = row_errors[r];
#pragma unroll
  for (int half = kBlockSize / 2; half >= 1; half /= 2) {
#pragma unroll
    for (int r = 0; r < half; ++r) partial[r] = partial[r] + partial[r + half];
  }
  return partial[0];
}

}  // namespace nvfp4
