// The numerics of the fused producers (nvfp4_dist/reference/fused_producers.py), element by element: the
// fixed-order row sums and the norm of a value, exp / erfc and the activations, BF16 rounding. Each function is
// __host__ __device__, so a host build checks it against the reference bit for bit (tests/test_fused_kernels_cpu.py).
// All arithmetic is FP32 in the reference's order; compile without fast-math and with -fmad=false.
#pragma once

#include "nvfp4_numerics.cuh"

namespace nvfp4 {

// --- the fixed-order row sum: a halving tree over each 16-block, then over the blocks -------------------------

// (v[i] + v[i + 8]), then (i, i + 4), (i, i + 2), (i, i + 1): the halving tree of one block.
NVFP4_HD float halving_sum16(const float (&v)[kBlockSize]) {
  float t[kBlockSize / 2];
#pragma unroll
  for (int i = 0; i < 8; ++i) t[i] = v[i] + v[i + 8];
#pragma unroll
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
#pragma unroll
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}

// The halving tree of kCount (a power of two) values, in place; returns the sum.
template <int kCount>
NVFP4_HD float halving_sum(float (&t)[kCount]) {
  static_assert((kCount & (kCount - 1)) == 0, "a power of two");
#pragma unroll
  for (int n = kCount / 2; n >= 1; n /= 2) {
#pragma unroll
    for (int i = 0; i < n; ++i) t[i] = t[i] + t[i + n];
  }
  return t[0];
}

// The row's block that thread `thread` of `threads` holds as its k-th (the row pass's split of a row, also
// host-compiled by the CPU harness).
NVFP4_HD int64_t row_block_of_thread(int thread, int k, int threads) {
  return thread + static_cast<int64_t>(k) * threads;
}

// A thread's share of a row's sum when thread t of kThreads holds blocks t + k * kThreads (k < kBlocks, a power of
// two; absent blocks zero): the tree's levels of stride kThreads and above, which pair a thread's own blocks.
// The levels below (kThreads / 2 .. 1) pair threads.
template <int kBlocks>
NVFP4_HD float thread_share_of_row_sum(const float (&block_sums)[kBlocks]) {
  float t[kBlocks];
#pragma unroll
  for (int k = 0; k < kBlocks; ++k) t[k] = block_sums[k];
  return halving_sum<kBlocks>(t);
}

// --- norm statistics and the norm of one value -----------------------------------------------------------------

// (row_sum + 0) / cols: the + 0 makes a zero sum +0 (a row of -0 sums to -0 only where the tree had no padding).
NVFP4_HD float mean_of_row(float row_sum, float cols) { return (row_sum + 0.0f) / cols; }

// rstd = 1 / sqrt(sum / cols + eps): the sum of (x - mean)^2 (LayerNorm) or of x^2 (RMSNorm). Correctly
// rounded division and square root (no fast-math).
NVFP4_HD float rstd_of_row(float sum_of_squares, float cols, float eps) {
  return 1.0f / sqrtf(sum_of_squares / cols + eps);
}

// LayerNorm of x - mean (the centred value, as the variance took it): (centred * rstd) * w + b.
NVFP4_HD float layer_norm_of_centred(float centred, float rstd, float weight, float bias) {
  return (centred * rstd) * weight + bias;
}

// RMSNorm: (x * rstd) * w.
NVFP4_HD float rms_norm_of(float x, float rstd, float weight) { return (x * rstd) * weight; }

// RNE to BF16, back in FP32 (a NaN stays a NaN).
NVFP4_HD float rounded_to_bf16(float v) {
#ifdef __CUDA_ARCH__
  return __bfloat162float(__float2bfloat16_rn(v));
#else
  uint32_t u = float_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bits_float((u | 0x00400000u) & 0xFFFF0000u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bits_float(u & 0xFFFF0000u);
#endif
}

// The bits of a non-negative float's BF16 rounding. Rounding is monotone, so the largest |BF16 value| of a set is
// the largest |value| rounded once: the amax passes round the maximum, not every element.
NVFP4_HD uint32_t rounded_bf16_bits(uint32_t bits) { return float_bits(rounded_to_bf16(bits_float(bits))); }

// --- exp, erfc and the activations ---------------------------------------------------------------------------

// exp: n = rint(x * log2(e)); r = (x - n * LN2_HI) - n * LN2_LO (LN2_HI has 14 significant bits: n * LN2_HI is
// exact); p(r) by Horner's rule on 1/k!; e^x = (p * 2^floor(n/2)) * 2^(n - floor(n/2)) (one rounding, also into
// the subnormals).
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e400p-1f;
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
constexpr float kExpMax = 0x1.62e42ep+6f;   // above: +inf
constexpr float kExpMin = -0x1.9fe368p+6f;  // below: 0
constexpr float kFrac1Sqrt2 = 0x1.6a09e6p-1f;

// 2^k for an integer-valued k in [-126, 127], from the exponent bits.
NVFP4_HD float power_of_two(float k) { return bits_float(static_cast<uint32_t>(static_cast<int>(k) + 127) << 23); }

NVFP4_HD float fixed_order_exp(float x) {
  constexpr float kPoly[8] = {1.0f, 1.0f, 0.5f, 0x1.555556p-3f, 0x1.555556p-5f, 0x1.111112p-7f, 0x1.6c16c2p-10f,
                              0x1.a01a02p-13f};
  if (x != x) return x;
  const float clamped = fminf(fmaxf(x, kExpMin), kExpMax);
  const float n = rintf(clamped * kLog2e);
  const float r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  float p = kPoly[7];
#pragma unroll
  for (int i = 6; i >= 0; --i) p = kPoly[i] + r * p;
  const float half = floorf(n * 0.5f);
  const float y = (p * power_of_two(half)) * power_of_two(n - half);
  return x > kExpMax ? bits_float(0x7F800000u) : (x < kExpMin ? 0.0f : y);
}

// erfc(z) = t * exp((c0 - |z|^2) + t * (c1 + t * (... + t * c9))), t = 1 / (1 + |z| / 2); 2 - that for z < 0
// (Numerical Recipes' erfcc, its coefficients rounded to FP32).
NVFP4_HD float fixed_order_erfc(float z) {
  constexpr float kPoly[10] = {-0x1.43f89cp+0f, 0x1.00018ep+0f, 0x1.7f11f6p-2f, 0x1.8c6d92p-4f, -0x1.7d8498p-3f,
                               0x1.1d8f98p-2f,  -0x1.229cbap+0f, 0x1.7d0f60p+0f, -0x1.a4f124p-1f, 0x1.5df28ap-3f};
  const float a = fabsf(z);
  const float t = 1.0f / (1.0f + 0.5f * a);
  float q = kPoly[9];
#pragma unroll
  for (int i = 8; i >= 1; --i) q = kPoly[i] + t * q;
  const float r = t * fixed_order_exp((kPoly[0] - a * a) + t * q);
  return z < 0.0f ? 2.0f - r : r;
}

NVFP4_HD float silu_of(float x) { return x / (1.0f + fixed_order_exp(-x)); }

// The exact (erf) GELU: (0.5 * x) * erfc(-x / sqrt(2)).
NVFP4_HD float gelu_of(float x) { return (0.5f * x) * fixed_order_erfc(x * -kFrac1Sqrt2); }

NVFP4_HD float swiglu_of(float gate, float up) { return silu_of(gate) * up; }

// --- the activations of BF16 inputs by lookup --------------------------------------------------------------------
// A BF16 input takes 2^16 values, so the kernels look its activation up instead of evaluating exp and erfc (about
// 100 instructions an element, which made the activation's passes bound by arithmetic): GELU's value rounded to BF16
// (all that the kernels keep of it) and SiLU's FP32 value (SwiGLU multiplies it by up before rounding). A table
// holds the formula's values for the BF16 magnitudes first..last of both signs; the values outside (rare in
// activations) follow rules that hold for every BF16 value they cover (tests/test_fused_kernels_cpu.py checks all
// 2^16, a NaN matching any NaN): below first, x * 0.5 (GELU's then rounded to BF16); above last (infinities and
// NaNs too), x for x > 0, else x * 0.
struct ActivationTable {
  uint32_t first, last;  // the BF16 magnitude bits held, for each sign

  NVFP4_HD constexpr int per_sign() const { return static_cast<int>(last - first + 1); }
  NVFP4_HD constexpr int entries() const { return 2 * per_sign(); }
};
// (functions: device code reads them by value)
NVFP4_HD constexpr ActivationTable gelu_table() { return {0x3B4Bu, 0x434Au}; }  // |x| 0.0031 .. 202
NVFP4_HD constexpr ActivationTable silu_table() { return {0x33C1u, 0x43C0u}; }  // |x| 9.0e-8 .. 384
// GELU's table is one 32-bit word per magnitude: GELU of +x (BF16 bits) in its low half, of -x in its high half,
// 2048 magnitudes from first. SiLU's holds FP32 values, the 4096 positive magnitudes first. Both windows are powers
// of two, so that the kernels look up both BF16 values of a word of h by word arithmetic (gelu_bf16_pair_common,
// silu_pair_common). The kernels copy the tables in 16-byte words.
constexpr int kGeluWindow = 2048, kSiluWindow = 4096;
static_assert(gelu_table().per_sign() == kGeluWindow, "the GELU table is a window of 2048 magnitudes");
static_assert(silu_table().per_sign() == kSiluWindow, "the SiLU table is a window of 4096 magnitudes");
constexpr int kGeluTableBytes = kGeluWindow * 4;
constexpr int kSiluTableBytes = 2 * kSiluWindow * 4;

// Whether the table holds the BF16 value with bits p (low 16 bits), and its entry there in SiLU's layout: positives
// first, then negatives. Both on unsigned offsets (the magnitude's offset wraps around below first).
NVFP4_HD bool activation_table_holds(uint32_t p, ActivationTable table) {
  return (p & 0x7FFFu) - table.first < static_cast<uint32_t>(table.per_sign());
}
NVFP4_HD uint32_t activation_table_slot(uint32_t p, ActivationTable table) {
  return (p & 0x7FFFu) - table.first + ((p >> 15) & 1u) * static_cast<uint32_t>(table.per_sign());
}

// The BF16 value (as FP32) whose activation entry `index` holds.
NVFP4_HD float activation_table_input(int index, ActivationTable table) {
  const uint32_t sign = index < table.per_sign() ? 0u : 0x8000u;
  return bits_float((sign | (table.first + static_cast<uint32_t>(index % table.per_sign()))) << 16);
}

// GELU of x rounded to BF16, as BF16 bits.
NVFP4_HD uint32_t gelu_bf16_bits_of(float x) { return float_bits(rounded_to_bf16(gelu_of(x))) >> 16; }

// Word `index` of the GELU table, and entry `index` of the SiLU table.
NVFP4_HD uint32_t gelu_table_word(int index) {
  return gelu_bf16_bits_of(activation_table_input(index, gelu_table())) |
         (gelu_bf16_bits_of(activation_table_input(index + kGeluWindow, gelu_table())) << 16);
}
NVFP4_HD float silu_table_entry(int index) { return silu_of(activation_table_input(index, silu_table())); }

// The activation of a BF16 x outside its table, by the rules: below first x * 0.5; above, x for x > 0, else x * 0
// (-0 for finite x; NaN for -inf and NaN, as the formulas give).
NVFP4_HD float activation_outside_table(float x, ActivationTable table) {
  const uint32_t magnitude = (float_bits(x) >> 16) & 0x7FFFu;
  return magnitude < table.first ? x * 0.5f : (x > 0.0f ? x : x * 0.0f);
}

// The BF16 bits of GELU of the BF16 bits p (low 16 bits), rounded to BF16, from the GELU table: any input.
NVFP4_HD uint32_t gelu_bf16_bits_by_table(uint32_t p, const uint32_t* table) {
  const uint32_t slot = (p & 0x7FFFu) - gelu_table().first;
  if (slot < static_cast<uint32_t>(kGeluWindow)) return (table[slot] >> ((p >> 11) & 16u)) & 0xFFFFu;  // sign: the half
  return float_bits(rounded_to_bf16(activation_outside_table(bits_float(p << 16), gelu_table()))) >> 16;
}

// GELU of both BF16 values of the word w (low and high half), rounded to BF16, by word arithmetic on both halves at
// once, for the magnitudes m that activations take: those in the table's window, and those in [0x0100, first), where
// GELU's BF16 value is x * 0.5, x's exponent less one (the bits less 0x80; no borrow crosses the halves). Other
// halves (zeros and subnormals, magnitudes above the window, infinities, NaNs) set bit 15 or 31 of `redo`, and the
// caller redoes such a word with gelu_bf16_pair_exact. Per half, v = m + 0x4000 - first is 0x4000 + the slot in the
// window, below 0x4000 under it (no carry crosses the halves: m < 0x8000).
NVFP4_HD uint32_t gelu_bf16_pair_common(uint32_t w, const uint32_t* table, uint32_t& redo) {
  constexpr uint32_t kWindowOffset = (0x4000u - gelu_table().first) * 0x10001u;
  const uint32_t m = w & 0x7FFF7FFFu;
  const uint32_t v = m + kWindowOffset;
  redo |= (v + 0x38003800u) | ~(m + 0x7F007F00u);  // bit 15 of a half: v >= 0x4800 (above), or m < 0x0100
  const uint32_t low = table[v & 0x7FFu], high = table[(v >> 16) & 0x7FFu];
  const uint32_t negative = byte_permute<0xBB99u>(w, 0u);  // per half: 0xFFFF where x < 0
  const uint32_t looked_up =
      (byte_permute<0x5410u>(low, high) & ~negative) | (byte_permute<0x7632u>(low, high) & negative);
  const uint32_t in_window = byte_permute<0xBB99u>(v << 1, 0u);  // per half: 0xFFFF where v >= 0x4000
  return (looked_up & in_window) | ((w - 0x00800080u) & ~in_window);
}

// Whether a word's (or several words', OR-ed) redo bits ask for gelu_bf16_pair_exact.
NVFP4_HD bool gelu_pair_redo(uint32_t redo) { return (redo & 0x80008000u) != 0u; }

NVFP4_HD uint32_t gelu_bf16_pair_exact(uint32_t w, const uint32_t* table) {
  return gelu_bf16_bits_by_table(w & 0xFFFFu, table) | (gelu_bf16_bits_by_table(w >> 16, table) << 16);
}

// GELU of both BF16 values of w, rounded to BF16: any input.
NVFP4_HD uint32_t gelu_bf16_pair_by_table(uint32_t w, const uint32_t* table) {
  uint32_t redo = 0u;
  const uint32_t common = gelu_bf16_pair_common(w, table, redo);
  return gelu_pair_redo(redo) ? gelu_bf16_pair_exact(w, table) : common;
}

// SiLU of a BF16 x: silu_of(x), from the SiLU table.
NVFP4_HD float silu_by_table(float x, const float* table) {
  const uint32_t p = float_bits(x) >> 16;
  return activation_table_holds(p, silu_table()) ? table[activation_table_slot(p, silu_table())]
                                                 : activation_outside_table(x, silu_table());
}

// SiLU of both BF16 values of the word w (low and high half, FP32) by word arithmetic, for magnitudes in the table's
// window; any other half (zeros, magnitudes below 9e-8 or above 384, infinities, NaNs; rare in activations) sets
// bits of `redo` in 0xF000F000, and the caller redoes the word with silu_by_table. Per half, v = m + 0x4000 - first
// is 0x4000 + the slot in the window (no carry crosses the halves: m < 0x8000); the sign bit picks the half of the
// table.
NVFP4_HD void silu_pair_common(uint32_t w, const float* table, float& low, float& high, uint32_t& redo) {
  constexpr uint32_t kWindowOffset = (0x4000u - silu_table().first) * 0x10001u;
  const uint32_t v = (w & 0x7FFF7FFFu) + kWindowOffset;
  redo |= v ^ 0x40004000u;
  low = table[(v & 0xFFFu) | ((w >> 3) & 0x1000u)];
  high = table[((v >> 16) & 0xFFFu) | ((w >> 19) & 0x1000u)];
}

// Whether a word's (or several words', OR-ed) redo bits ask for silu_by_table.
NVFP4_HD bool silu_pair_redo(uint32_t redo) { return (redo & 0xF000F000u) != 0u; }

}  // namespace nvfp4
