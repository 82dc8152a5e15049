// Launchers of the NVFP4 kernels: raw pointers and a stream, no torch types.
// Each returns the CUDA error of its launch (cudaSuccess when all went well).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace nvfp4 {

enum class InputType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// amax.cu ------------------------------------------------------------------------------------------
// max |x| over rows x cols (contiguous, 16-byte aligned) into amax[0].
cudaError_t launch_amax_tensor(const void* x, InputType type, int64_t rows, int64_t cols, float* amax,
                               cudaStream_t stream);
// max |x| of each row into amax[rows].
cudaError_t launch_amax_rows(const void* x, InputType type, int64_t rows, int64_t cols, float* amax,
                             cudaStream_t stream);
// BF16 x [rows, cols] (rows % 16 == 0): amax of x into amax_plain[0] (may be null) and amax of the
// RHT'd, BF16-rounded columnwise source into amax_rht[0].
cudaError_t launch_amax_rht(const void* x, int64_t rows, int64_t cols, bool random_sign, float* amax_plain,
                            float* amax_rht, cudaStream_t stream);

// One amax per column of x [rows, cols] into amax[cols] (per row of x^T, docs/numerics.md §6b); with rht, of the
// RHT'd, BF16-rounded columnwise source (BF16 x, rows % 16 == 0). cols even.
cudaError_t launch_amax_columns(const void* x, InputType type, int64_t rows, int64_t cols, bool rht, bool random_sign,
                                float* amax, cudaStream_t stream);

// quantize.cu -------------------------------------------------------------------------------------
struct QuantizeArgs {
  const void* x;                 // [rows, cols] contiguous, 16-byte aligned
  InputType type;
  int64_t rows, cols;
  const float* amax_rowwise;     // (1,), or (rows,) when row_scaled
  const float* amax_columnwise;  // (1,), or (cols,) when row_scaled: one per row of x^T (docs/numerics.md §6b)
  uint8_t* rowwise_data;         // [rows, cols/2] or null (no rowwise copy)
  uint8_t* rowwise_scale;        // [rows, cols/16]
  uint8_t* columnwise_data;      // [cols, rows/2] or null (no columnwise copy)
  uint8_t* columnwise_scale;     // [cols, rows/16]
  bool row_scaled;
  bool block_2d;
  bool rht;                      // columnwise copy of x^T . H (BF16 input only)
  bool rht_random_sign;
  bool stochastic_rounding;
  uint64_t sr_seed;
  const int64_t* sr_seed_device; // or null: the seed read on the device (drawn there; a CUDA graph redraws it each replay)
  int64_t sr_row_offset;
  bool four_over_six;            // 4over6 block scaling (docs/numerics.md §12): no RHT, no SR, row_scaled rowwise only
  int e4m3_bound;                // B of S_enc = 6 B / amax: 448, or 256 (4over6 only)
  bool four_over_six_mse;        // the candidates' error: MSE, else MAE
  bool four_over_six_fast_math;  // that error in the scaled domain (docs/numerics.md §12.4)
  // Segmented casts (x's rows split into segments, each quantized as a tensor of its own: grouped_quantize.py).
  // Either may be set (not with row_scaled or four_over_six), and then replaces that copy's tensor amax, whose
  // pointer is null: the rowwise copy's row r takes amax_rowwise_rows[r], the columnwise blocks of x's 16-row
  // chunk c take amax_columnwise_chunks[c], with the arithmetic of a tensor amax of that value.
  const float* amax_rowwise_rows;      // (rows,) or null
  const float* amax_columnwise_chunks; // (rows / 16,) or null
};
cudaError_t launch_quantize(const QuantizeArgs& args, cudaStream_t stream);
// amax.cu, for the segmented casts ---------------------------------------------------------------------------
// BF16 x [rows, cols] (rows % 16 == 0): per 16-row chunk c, the amax of x into amax_plain[c] (may be null) and of
// the RHT'd, BF16-rounded columnwise source into amax_rht[c] (launch_amax_rht's values, chunk by chunk).
cudaError_t launch_amax_rht_chunks(const void* x, int64_t rows, int64_t cols, bool random_sign, float* amax_plain,
                                   float* amax_rht, cudaStream_t stream);
// Segment e covers entries [offsets[e] / granule, offsets[e + 1] / granule) of plain and columnwise (per-row
// amaxes: granule 1; per-chunk: 16); offsets: int64 [segments + 1] on the device, non-decreasing, multiples of
// granule. segment_plain[e] / segment_columnwise[e]: the maximum of its entries of plain / columnwise (columnwise
// null: of plain), NaN winning as in the amax kernels, 0 for an empty segment; rows_out (may be null) gets
// segment_plain[e] at rows [offsets[e], offsets[e + 1]), chunks_out (may be null; offsets multiples of 16)
// segment_columnwise[e] at chunks [offsets[e] / 16, offsets[e + 1] / 16).
cudaError_t launch_segment_amaxes(const float* plain, const float* columnwise, int64_t granule, const int64_t* offsets,
                                  int64_t segments, float* segment_plain, float* segment_columnwise, float* rows_out,
                                  float* chunks_out, cudaStream_t stream);
// nonfinite_record.cu: the NaN/Inf record of one check (nvfp4_dist/finite_check.py). Value j is the maximum of
// values[j][0 .. counts[j]); when one is not finite and record (pinned host memory, count values and a flag) holds
// none yet, the record takes them all and its flag and *any_record are set to 1.
constexpr int kMaxCheckedValues = 32;
struct CheckedValues {
  const float* values[kMaxCheckedValues];
  int64_t counts[kMaxCheckedValues];
  int count;
};
cudaError_t launch_record_check(const CheckedValues& check, float* record, float* any_record, cudaStream_t stream);
// quantize_4over6.cu: the cast of args.four_over_six (launch_quantize calls it).
cudaError_t launch_quantize_4over6(const QuantizeArgs& args, cudaStream_t stream);

// norm_quantize.cu, activation_quantize.cu: the fused producers (nvfp4_dist/reference/fused_producers.py) -------
// The cast of a produced tensor [rows, cols]: the rowwise copy (data null: none) and the columnwise copy (data
// null: none; rows % 16 == 0), of the producer's output rounded to BF16, never written.
struct ProducerCastArgs {
  int64_t rows, cols;
  const float* amax_rowwise;     // (1,), or (rows,) when row_scaled
  const float* amax_columnwise;  // (1,)
  uint8_t* rowwise_data;         // [rows, cols/2]
  uint8_t* rowwise_scale;        // [rows, cols/16]
  uint8_t* columnwise_data;      // [cols, rows/2]
  uint8_t* columnwise_scale;     // [cols, rows/16]
  bool row_scaled;
  bool rht;                      // columnwise copy of x^T . H
  bool rht_random_sign;
};

enum class Normalization : int { kLayerNorm = 0, kRMSNorm = 1 };
struct NormArgs {
  const void* x;                 // [rows, cols] contiguous, 16-byte aligned; cols % 16 == 0 and at most 16384
  InputType type;
  int64_t rows, cols;
  const float* weight;           // [cols]
  const float* bias;             // [cols] (LayerNorm) or null (RMSNorm)
  Normalization normalization;
  float eps;
  float* mean;                   // [rows] (LayerNorm; null for RMSNorm): written by the row pass, read by the cast
  float* rstd;                   // [rows]
  float* sum_of_squares;         // [rows] or null: the row pass's sums of squares before rstd (a test's view)
};
// The norm's row pass: mean and rstd of each row; its output y [rows, cols] of y_type (may be null); the amax of
// its BF16 rounding into amax_rowwise ((1,), or (rows,) when row_scaled; may be null); the amax of the RHT'd,
// BF16-rounded columnwise source into amax_rht ((1,); may be null; rows % 16 == 0).
cudaError_t launch_norm_rows(const NormArgs& norm, void* y, InputType y_type, float* amax_rowwise, bool row_scaled,
                             float* amax_rht, bool rht_random_sign, cudaStream_t stream);
// The cast of the norm's output from the row pass's mean and rstd.
cudaError_t launch_norm_cast(const NormArgs& norm, const ProducerCastArgs& cast, cudaStream_t stream);

enum class Activation : int { kGelu = 0, kSwiglu = 1 };
struct ActivationArgs {
  const void* h;                 // fc1's output [rows, cols] (GELU) or [rows, 2 cols] (SwiGLU: [gate | up]),
  InputType type;                //   contiguous, 16-byte aligned
  int64_t rows, cols;            // of the activation's output; cols % 16 == 0
  Activation activation;
  const void* table;             // BF16 h: the activation's table (launch_activation_table), or null: the formulas
};
// The activation's table (activation_table_bytes of it, kActivationTableAlignment-aligned), by which the kernels
// activate BF16 inputs (csrc/producer_numerics.cuh).
constexpr int kActivationTableAlignment = 16;
int activation_table_bytes(Activation activation);
cudaError_t launch_activation_table(Activation activation, void* table, cudaStream_t stream);
// The activation into out [rows, cols] of h's type.
cudaError_t launch_activation(const ActivationArgs& args, void* out, cudaStream_t stream);
// The amax of the activation's BF16 output into amax_rowwise ((1,), or (rows,) when row_scaled), and of its RHT'd
// columnwise source into amax_rht ((1,); may be null; rows % 16 == 0).
cudaError_t launch_activation_amaxes(const ActivationArgs& args, float* amax_rowwise, bool row_scaled, float* amax_rht,
                                     bool rht_random_sign, cudaStream_t stream);
cudaError_t launch_activation_cast(const ActivationArgs& args, const ProducerCastArgs& cast, cudaStream_t stream);

// dequantize.cu -----------------------------------------------------------------------------------
// Rowwise copy [rows, cols/2] codes + [rows, cols/16] scales -> out [rows, cols] of out_type (all
// contiguous). amax null: out = fp4 value * block scale * factor, without the global scale. e4m3_bound: B of the
// global scale, S_dec = amax / (6 B) (448; 256 for some 4over6 tensors).
cudaError_t launch_dequantize_rowwise(const uint8_t* data, const uint8_t* scale, const float* amax, bool per_row_amax,
                                      int e4m3_bound, float factor, int64_t rows, int64_t cols, void* out,
                                      InputType out_type, cudaStream_t stream);
// Columnwise copy of x [rows, cols]: codes [cols, rows/2], scales [cols, rows/16] -> out [rows, cols],
// undoing the RHT when rht is set. per_row_amax: amax[cols], one per row of x^T.
cudaError_t launch_dequantize_columnwise(const uint8_t* data, const uint8_t* scale, const float* amax,
                                         bool per_row_amax, int e4m3_bound, int64_t rows, int64_t cols, bool rht,
                                         bool rht_random_sign, void* out, InputType out_type, cudaStream_t stream);

// gemm_epilogue.cu --------------------------------------------------------------------------------
// out[r, c] (+)= acc[r, c] * (S_dec(a_amax) * S_dec(b_amax)) (+ bias[c]) in FP32, rounded once to out_type.
// a_amax: one value, or one per row when a_per_row; b_amax: one value, or one per column when b_per_column (B's
// rows: the columnwise copy of a row-scaled activation, docs/numerics.md §6b); S_dec = amax / (6 B) with each
// operand's bound B (448, or 256 for some 4over6 tensors); bias (bias_type) may be null; row strides in elements.
cudaError_t launch_gemm_epilogue(const float* acc, int64_t acc_stride, const float* a_amax, bool a_per_row,
                                 const float* b_amax, bool b_per_column, int a_e4m3_bound, int b_e4m3_bound,
                                 const void* bias, InputType bias_type, bool accumulate, int64_t rows, int64_t cols,
                                 void* out, InputType out_type, int64_t out_stride, cudaStream_t stream);

// cublaslt_gemm.cu --------------------------------------------------------------------------------
// out[M, N] (row stride out_stride) = S_dec(a_amax) * S_dec(b_amax) * A[M, K] . B[N, K]^T (+ bias[N]) (S_dec with
// each operand's bound B, as launch_gemm_epilogue), or
// out += that when accumulate (then no bias); A, B BF16 with row strides lda, ldb; bias of out_type; one
// rounding to out_type by cuBLASLt. scalars: 2 floats of device memory, which it fills (alpha, beta) first; a_amax
// nullptr: they already hold them (launch_gemm_scalars). cudaErrorNotSupported: cuBLASLt has no algorithm for
// this problem (no GEMM was launched).
cudaError_t launch_cublaslt_gemm(const void* a, int64_t lda, const void* b, int64_t ldb, int64_t m, int64_t n,
                                 int64_t k, const float* a_amax, const float* b_amax, int a_e4m3_bound,
                                 int b_e4m3_bound, const void* bias, InputType bias_type, bool accumulate, void* out,
                                 InputType out_type, int64_t out_stride, float* scalars, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream);
// The (alpha, beta) pairs of `count` such GEMMs (operand amaxes a_amax[i], b_amax[i]) into scalars[2 * count], in
// one launch per 64 GEMMs: a grouped stage's scalars, for launch_cublaslt_gemm with a_amax nullptr.
cudaError_t launch_gemm_scalars(const float* const* a_amax, const float* const* b_amax, int64_t count,
                                int a_e4m3_bound, int b_e4m3_bound, bool accumulate, float* scalars,
                                cudaStream_t stream);

// swizzle.cu --------------------------------------------------------------------------------------
// [rows, cols] scale bytes -> flat 128x4-swizzled [padded_rows * padded_cols], zero padded (docs/numerics.md §8).
cudaError_t launch_swizzle_scales(const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* out,
                                  cudaStream_t stream);

// swap_first_dims.cu ------------------------------------------------------------------------------
// Bytes [world_size * rows, row_bytes] viewed as (W, rows, row_bytes) -> (rows, W, row_bytes).
cudaError_t launch_swap_first_dims(const uint8_t* in, int64_t world_size, int64_t rows, int64_t row_bytes,
                                   uint8_t* out, cudaStream_t stream);

// transpose_codes.cu ------------------------------------------------------------------------------
// Packed FP4 codes [rows, cols/2] -> the codes of the transpose, packed, [cols, rows/2] (rows and cols even).
cudaError_t launch_transpose_codes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, cudaStream_t stream);

// peer_gather.cu ----------------------------------------------------------------------------------
constexpr int kMaxPeers = 8, kMaxPeerPieces = 8, kMaxPeerAmaxes = 8;
// One tensor gathered from every rank: W shards of [rows, row_bytes], read through peer pointers.
struct PeerPiece {
  const uint8_t* src[kMaxPeers];  // rank r's shard (device pointers valid in this process)
  uint8_t* dst;                   // [W * rows, row_bytes]
  int64_t rows, row_bytes;
  bool interleave;                // false: row i of rank r -> r * rows + i; true: -> i * W + r (swap_first_dims)
  int vector_bytes;               // set by the launcher from the alignments
};
struct PeerGatherArgs {
  PeerPiece pieces[kMaxPeerPieces];
  int count, world_size;
};
// A barrier over the ranks' symmetric-memory signal pads (uint32 slots [channel * W + source]).
struct PeerBarrier {
  uint32_t* signal_pads[kMaxPeers];
  int channel, rank, world_size;
  int* blocks_done;               // peer_publish: a zeroed device counter, left zeroed
};
// This rank's pieces (world_size 1) into its symmetric buffer, then the barrier.
cudaError_t launch_peer_publish(PeerGatherArgs args, const PeerBarrier& barrier, cudaStream_t stream);
// Every rank's pieces (after a publish) into the outputs.
cudaError_t launch_peer_gather(PeerGatherArgs args, int rank, cudaStream_t stream);
// values[i] = max over ranks r of rank r's values[i] (NaN wins), i < count, through slots[r] (count
// floats in rank r's symmetric buffer, not used by a peer's previous call), with the barrier between.
struct PeerAmaxArgs {
  float* values[kMaxPeerAmaxes];
  float* slots[kMaxPeers];
  int count;
};
cudaError_t launch_peer_amax_all_reduce(const PeerAmaxArgs& args, const PeerBarrier& barrier, cudaStream_t stream);
// The barrier alone (one block): every rank's earlier work on its stream is visible to its peers after it.
cudaError_t launch_peer_barrier(const PeerBarrier& barrier, cudaStream_t stream);

}  // namespace nvfp4
