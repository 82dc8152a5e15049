// The 4over6 cast (docs/numerics.md §12): each 1x16 (or 16x16) block is encoded with its max mapped to 4 and to 6,
// and the candidate with the smaller error (MAE or MSE, exact or fast-math) is written, with its E4M3 scale; the
// global scale uses the bound B (256 or 448). Both copies come from one 64 x 64 tile of x in shared memory (FP32):
// the rowwise copy from its rows, the columnwise copy (of x^T) from its columns. A 16x16 block's error sums its 16
// rows' (or, for the columnwise copy, its 16 columns') errors as a tree of warp shuffles, in the order of
// docs/numerics.md §12.5, so each copy makes its own choice, as the reference quantizes x^T on its own.
// Row-scaled (docs/numerics.md §6): the rowwise copy with one amax per row. No RHT and no stochastic rounding.
// The per-element numerics are csrc/nvfp4_numerics.cuh's four_over_six_* functions (host-tested against the reference):
// blocks of 16-bit values that neither saturate nor underflow (nearly all) take their common case, the error on |x|
// with packed FP16 products and no IEEE division; every other block the general one. The cast is bound by arithmetic
// (two candidates per block and copy), not by memory.
#include <cstdint>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kTile = 64;                 // a CTA's tile: 64 x 64 elements of x
constexpr int kThreads = 256;
constexpr int kTileStride = kTile + 1;    // floats per shared-memory row: conflict-free rows and columns
constexpr int kBlocksPerTileRow = kTile / kBlockSize;
static_assert(kThreads == kTile * kBlocksPerTileRow, "one rowwise and one columnwise block per thread");

// The tile at (m0, k0) as FP32, zeros outside x (cols % 16 == 0: a 16-byte chunk lies wholly inside or outside).
template <typename T>
__device__ __forceinline__ void load_tile(float (*tile)[kTileStride], const QuantizeArgs& args, int64_t m0, int64_t k0,
                                          int tid) {
  constexpr int kChunkElements = 16 / sizeof(T);
  constexpr int kChunksPerRow = kTile / kChunkElements;
  constexpr int kChunksPerThread = kTile * kChunksPerRow / kThreads;
  const T* x = static_cast<const T*>(args.x);
#pragma unroll
  for (int u = 0; u < kChunksPerThread; ++u) {
    const int q = tid + u * kThreads;
    const int row = q / kChunksPerRow, column = (q % kChunksPerRow) * kChunkElements;
    const int64_t m = m0 + row, k = k0 + column;
    float values[kChunkElements] = {};
    if (m < args.rows && k < args.cols) unpack_vector<T>(load_streaming(x + m * args.cols + k), values);
#pragma unroll
    for (int e = 0; e < kChunkElements; ++e) tile[row][column + e] = values[e];
  }
}

// The maximum over lanes 16j .. 16j + 15 of non-negative values (the 16 rows, or columns, of one 16x16 block).
__device__ __forceinline__ float max_across_16_lanes(float v) {
  uint32_t bits = __float_as_uint(v);
#pragma unroll
  for (int half = 8; half >= 1; half /= 2) bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, half));
  return __uint_as_float(bits);
}

// The sum of lanes 16j .. 16j + 15's errors as four_over_six_tile_error adds them: lanes (r, r + 8), then (r, r + 4),
// (r, r + 2), (r, r + 1). Each lane ends with the same sum (a + b == b + a), so every level's pairs hold the tree's
// partial sums.
__device__ __forceinline__ float tile_error_across_16_lanes(float error) {
#pragma unroll
  for (int half = 8; half >= 1; half /= 2) error = error + __shfl_xor_sync(0xFFFFFFFFu, error, half);
  return error;
}

// One block (16 values along the quantized dimension): both candidates, the choice, and the kept one's codes and
// scale at data / scale when `inside`. Every lane of the warp takes part (the 16x16 sums shuffle).
// encode_of: e_b of a scale byte under global's S_dec (a shared-memory table, or BlockEncodeFactor).
template <typename T, bool k2D, bool kMSE, bool kFastMath, typename EncodeOf>
__device__ __forceinline__ void encode_4over6_block(const float (&values)[kBlockSize], const FourOverSixScale& global,
                                                    const EncodeOf& encode_of, bool inside, uint8_t* data,
                                                    uint8_t* scale) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) amax = fmaxf(amax, fabsf(values[i]));
  if constexpr (k2D) amax = max_across_16_lanes(amax);
  const FourOverSixCandidates c =
      four_over_six_candidates<kMSE, kFastMath, sizeof(T) == 2>(values, amax, global, encode_of);
  float error4 = c.error[0], error6 = c.error[1];
  if constexpr (k2D) {
    error4 = tile_error_across_16_lanes(error4);
    error6 = tile_error_across_16_lanes(error6);
  }
  const bool map_to_4 = four_over_six_choice(error4, error6) == 0;
  if (inside) {
    *reinterpret_cast<uint2*>(data) = map_to_4 ? c.packed[0] : c.packed[1];
    *scale = static_cast<uint8_t>(map_to_4 ? c.scale[0] : c.scale[1]);
  }
}

// One CTA per 64 x 64 tile, row-major over the tiles. Thread t encodes the rowwise block (row t % 64, 16-column block
// t / 64) and the columnwise block (column t % 64, 16-row block t / 64): lanes 16j .. 16j + 15 hold the 16 rows (or
// columns) of one 16x16 block, and read the shared tile without bank conflicts.
// e_b of each scale byte a non-negative block amax gives (0x00..0x7F) under one tensor scale, in shared memory.
struct EncodeTable {
  const float* encode;
  __device__ float operator()(uint32_t scale) const { return encode[scale]; }
};
constexpr int kPositiveScales = 128;
static_assert(kThreads == 2 * kPositiveScales, "one thread per scale byte of each copy fills the e_b tables");

template <typename T, bool k2D, bool kMSE, bool kFastMath>
__global__ void __launch_bounds__(kThreads) quantize_4over6_kernel(const QuantizeArgs args, int64_t column_tiles) {
  __shared__ float tile[kTile][kTileStride];
  __shared__ float encode_of_scale[2][kPositiveScales];  // rowwise (tensor-scaled), columnwise
  const int tid = threadIdx.x;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) / column_tiles * kTile;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) % column_tiles * kTile;
  const float bound = static_cast<float>(args.e4m3_bound);
  const bool rowwise_tensor_scaled = args.rowwise_data != nullptr && !args.row_scaled;
  const FourOverSixScale rowwise_global = four_over_six_scale(rowwise_tensor_scaled ? args.amax_rowwise[0] : 1.0f, bound);
  const FourOverSixScale columnwise_global =
      four_over_six_scale(args.columnwise_data != nullptr ? args.amax_columnwise[0] : 1.0f, bound);
  {
    const int copy = tid / kPositiveScales;
    encode_of_scale[copy][tid % kPositiveScales] =
        block_encode_factor(static_cast<uint8_t>(tid % kPositiveScales),
                            copy == 0 ? rowwise_global.s_dec : columnwise_global.s_dec);
  }
  load_tile<T>(tile, args, m0, k0, tid);
  __syncthreads();
  const int lane_index = tid % kTile, block = tid / kTile;

  if (args.rowwise_data != nullptr) {
    const int64_t m = m0 + lane_index, k = k0 + block * kBlockSize;
    const bool inside = m < args.rows && k < args.cols;
    float values[kBlockSize];
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) values[i] = tile[lane_index][block * kBlockSize + i];
    uint8_t* const data = args.rowwise_data + m * (args.cols / 2) + k / 2;
    uint8_t* const scale = args.rowwise_scale + m * (args.cols / kBlockSize) + k / kBlockSize;
    if (args.row_scaled) {  // 1D blocks only: S_enc per row
      const FourOverSixScale global = four_over_six_scale(m < args.rows ? args.amax_rowwise[m] : 0.0f, bound);
      encode_4over6_block<T, false, kMSE, kFastMath>(values, global, BlockEncodeFactor{global.s_dec}, inside, data,
                                                     scale);
    } else {
      encode_4over6_block<T, k2D, kMSE, kFastMath>(values, rowwise_global, EncodeTable{encode_of_scale[0]}, inside,
                                                   data, scale);
    }
  }
  if (args.columnwise_data != nullptr) {  // rows % 16 == 0
    const int64_t k = k0 + lane_index, m = m0 + block * kBlockSize;
    const bool inside = m < args.rows && k < args.cols;
    float values[kBlockSize];
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) values[i] = tile[block * kBlockSize + i][lane_index];
    encode_4over6_block<T, k2D, kMSE, kFastMath>(values, columnwise_global, EncodeTable{encode_of_scale[1]}, inside,
                                                 args.columnwise_data + k * (args.rows / 2) + m / 2,
                                                 args.columnwise_scale + k * (args.rows / kBlockSize) + m / kBlockSize);
  }
}

template <typename T, bool k2D, bool kMSE>
cudaError_t launch_with_error(const QuantizeArgs& args, cudaStream_t stream) {
  const int64_t column_tiles = (args.cols + kTile - 1) / kTile;
  const int64_t tiles = (args.rows + kTile - 1) / kTile * column_tiles;
  if (tiles == 0) return cudaSuccess;
  if (tiles > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned int>(tiles));
  if (args.four_over_six_fast_math) {
    quantize_4over6_kernel<T, k2D, kMSE, true><<<grid, kThreads, 0, stream>>>(args, column_tiles);
  } else {
    quantize_4over6_kernel<T, k2D, kMSE, false><<<grid, kThreads, 0, stream>>>(args, column_tiles);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_type(const QuantizeArgs& args, cudaStream_t stream) {
  if (args.block_2d) {
    return args.four_over_six_mse ? launch_with_error<T, true, true>(args, stream)
                                  : launch_with_error<T, true, false>(args, stream);
  }
  return args.four_over_six_mse ? launch_with_error<T, false, true>(args, stream)
                                : launch_with_error<T, false, false>(args, stream);
}

}  // namespace

cudaError_t launch_quantize_4over6(const QuantizeArgs& args, cudaStream_t stream) {
  const bool columnwise = args.columnwise_data != nullptr;
  if (args.cols % kBlockSize != 0 || ((columnwise || args.block_2d) && args.rows % kBlockSize != 0) || args.rht ||
      args.stochastic_rounding || (args.row_scaled && (columnwise || args.block_2d)) ||
      (args.e4m3_bound != 448 && args.e4m3_bound != 256)) {
    return cudaErrorInvalidValue;
  }
  NVFP4_DISPATCH_INPUT_TYPE(args.type, T, return launch_for_type<T>(args, stream));
  return cudaSuccess;
}

}  // namespace nvfp4
