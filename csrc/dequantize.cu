// Dequantization (docs/numerics.md §2.6): x' = fp4value(q) * fp32(s_b) * S_dec, for both copies; the
// columnwise copy is written back in the original [rows, cols] layout, undoing the RHT if on.
// Without an amax the rowwise kernel writes fp4value(q) * fp32(s_b) * factor instead: the exact block
// values (times a power of two) that the Hopper GEMM's dequantize path feeds to cuBLAS.
#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void decode_block(uint2 packed, uint8_t scale, float s_dec, float (&values)[kBlockSize]) {
  const float scale_value = e4m3_to_float(scale);
  const uint32_t words[2] = {packed.x, packed.y};
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) values[i] = (fp4_value((words[i / 8] >> (4 * (i % 8))) & 0xFu) * scale_value) * s_dec;
}

// One thread per 16-element block of the rowwise copy.
template <typename OutT>
__global__ void __launch_bounds__(kThreads) dequantize_rowwise_kernel(const uint8_t* __restrict__ data,
                                                                      const uint8_t* __restrict__ scale,
                                                                      const float* __restrict__ amax, bool per_row_amax,
                                                                      float numerator, float factor, int64_t rows,
                                                                      int64_t cols, OutT* __restrict__ out) {
  const int64_t blocks_per_row = cols / kBlockSize;
  const int64_t block = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (block >= rows * blocks_per_row) return;
  const int64_t row = block / blocks_per_row;
  const float s_dec = amax == nullptr ? factor : decode_scale(encode_scale(amax[per_row_amax ? row : 0], numerator));
  float values[kBlockSize];
  decode_block(*reinterpret_cast<const uint2*>(data + block * (kBlockSize / 2)), scale[block], s_dec, values);
  alignas(16) OutT converted[kBlockSize];
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) converted[i] = from_float<OutT>(values[i]);
  uint4* destination = reinterpret_cast<uint4*>(out + block * kBlockSize);  // 16-byte aligned: 16 elements
  const uint4* source = reinterpret_cast<const uint4*>(converted);
#pragma unroll
  for (int v = 0; v < static_cast<int>(sizeof(converted) / 16); ++v) destination[v] = source[v];
}

// One thread per (column k of x, 16-row block): lanes take consecutive k so the writes of each
// output row are coalesced. per_row_amax: one amax per row of x^T (per column k, docs/numerics.md §6b).
template <typename OutT, bool kRHT, bool kRandomSign>
__global__ void __launch_bounds__(kThreads) dequantize_columnwise_kernel(const uint8_t* __restrict__ data,
                                                                         const uint8_t* __restrict__ scale,
                                                                         const float* __restrict__ amax,
                                                                         bool per_row_amax, float numerator,
                                                                         int64_t rows, int64_t cols,
                                                                         OutT* __restrict__ out) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row_blocks = rows / kBlockSize;
  if (item >= row_blocks * cols) return;
  const int64_t column = item % cols, row_block = item / cols;
  const float s_dec = decode_scale(encode_scale(amax[per_row_amax ? column : 0], numerator));
  float values[kBlockSize];
  decode_block(*reinterpret_cast<const uint2*>(data + column * (rows / 2) + row_block * (kBlockSize / 2)),
               scale[column * row_blocks + row_block], s_dec, values);
  if constexpr (kRHT) {
    float restored[kBlockSize];
    inverse_rht_chunk<kRandomSign>(values, restored);
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) values[i] = restored[i];
  }
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) out[(row_block * kBlockSize + i) * cols + column] = from_float<OutT>(values[i]);
}

unsigned int grid_for(int64_t items) { return static_cast<unsigned int>((items + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t launch_dequantize_rowwise(const uint8_t* data, const uint8_t* scale, const float* amax, bool per_row_amax,
                                      int e4m3_bound, float factor, int64_t rows, int64_t cols, void* out,
                                      InputType out_type, cudaStream_t stream) {
  if (cols % kBlockSize != 0) return cudaErrorInvalidValue;
  const int64_t blocks = rows * (cols / kBlockSize);
  if (blocks == 0) return cudaSuccess;
  NVFP4_DISPATCH_INPUT_TYPE(out_type, T, dequantize_rowwise_kernel<T><<<grid_for(blocks), kThreads, 0, stream>>>(
                                             data, scale, amax, per_row_amax, kFp4Max * e4m3_bound, factor, rows, cols,
                                             static_cast<T*>(out)));
  return cudaGetLastError();
}

cudaError_t launch_dequantize_columnwise(const uint8_t* data, const uint8_t* scale, const float* amax,
                                         bool per_row_amax, int e4m3_bound, int64_t rows, int64_t cols, bool rht,
                                         bool rht_random_sign, void* out, InputType out_type, cudaStream_t stream) {
  if (rows % kBlockSize != 0) return cudaErrorInvalidValue;
  const int64_t items = (rows / kBlockSize) * cols;
  if (items == 0) return cudaSuccess;
  const unsigned int grid = grid_for(items);
  const float numerator = kFp4Max * e4m3_bound;
  NVFP4_DISPATCH_INPUT_TYPE(out_type, T, {
    T* typed_out = static_cast<T*>(out);
    if (!rht) {
      dequantize_columnwise_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(data, scale, amax, per_row_amax, numerator,
                                                                              rows, cols, typed_out);
    } else if (rht_random_sign) {
      dequantize_columnwise_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(data, scale, amax, per_row_amax, numerator,
                                                                              rows, cols, typed_out);
    } else {
      dequantize_columnwise_kernel<T, true, false><<<grid, kThreads, 0, stream>>>(data, scale, amax, per_row_amax, numerator,
                                                                              rows, cols, typed_out);
    }
  });
  return cudaGetLastError();
}

}  // namespace nvfp4
