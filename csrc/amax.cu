// Amax reductions (docs/numerics.md §2.1, 5 and 6): per tensor, per row, and after the RHT of the columnwise copy.
#include <algorithm>
#include <cstdint>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kAmaxThreads = 256;
constexpr int kLoadsInFlight = 4;
constexpr int kRowsPerAmaxBlock = kAmaxThreads / 32;  // one warp per row

template <typename T>
__device__ __forceinline__ uint32_t vector_amax_bits(const uint4& vec) {
  float values[16 / sizeof(T)];
  unpack_vector<T>(vec, values);
  uint32_t running = 0;
#pragma unroll
  for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) running = max(running, abs_bits(values[i]));
  return running;
}

template <typename T>
__global__ void __launch_bounds__(kAmaxThreads) amax_tensor_kernel(const uint4* __restrict__ x, int64_t vectors,
                                                                   float* __restrict__ amax) {
  __shared__ uint32_t scratch[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t running = 0;
  for (; i + (kLoadsInFlight - 1) * stride < vectors; i += kLoadsInFlight * stride) {
    uint4 loaded[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) loaded[u] = load_streaming(x + i + u * stride);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) running = max(running, vector_amax_bits<T>(loaded[u]));
  }
  for (; i < vectors; i += stride) running = max(running, vector_amax_bits<T>(load_streaming(x + i)));
  running = block_max_bits(running, scratch);
  if (threadIdx.x == 0) atomic_max_bits(amax, running);
}

template <typename T>
__global__ void __launch_bounds__(kAmaxThreads) amax_rows_kernel(const uint4* __restrict__ x, int64_t rows,
                                                                 int64_t vectors_per_row, float* __restrict__ amax) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerAmaxBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const uint4* row_start = x + row * vectors_per_row;
  uint32_t running = 0;
  for (int64_t i = threadIdx.x & 31; i < vectors_per_row; i += 32) {
    running = max(running, vector_amax_bits<T>(load_streaming(row_start + i)));
  }
  running = __reduce_max_sync(0xFFFFFFFFu, running);
  if ((threadIdx.x & 31) == 0) amax[row] = __uint_as_float(running);
}

// One item: two adjacent columns (a BF16 pair) of one 16-row block. Its columnwise source is the
// RHT of each column's 16-chunk, rounded to BF16 (reference/rht.py), whose amax is wanted; the
// plain amax comes with it. Running maxima as bits of non-negative floats.
template <bool kRandomSign>
__device__ __forceinline__ void accumulate_rht_pair_amax(const uint32_t* source, int64_t pairs_per_row,
                                                         uint32_t& running_plain, uint32_t& running_rht) {
  uint32_t words[kBlockSize];
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) words[i] = __ldcs(source + i * pairs_per_row);
  float column0[kBlockSize], column1[kBlockSize];
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) {
    column0[i] = __uint_as_float(words[i] << 16);
    column1[i] = __uint_as_float(words[i] & 0xFFFF0000u);
    running_plain = max(running_plain, max(abs_bits(column0[i]), abs_bits(column1[i])));
  }
  float transformed0[kBlockSize], transformed1[kBlockSize];
  rht_chunk_odd_negated<kRandomSign>(column0, transformed0);  // the odd lanes negated: their |.| is the same
  rht_chunk_odd_negated<kRandomSign>(column1, transformed1);
#pragma unroll
  for (int j = 0; j < kBlockSize; ++j) {
    running_rht = max(running_rht, max(abs_bits(round_to_bf16(transformed0[j])), abs_bits(round_to_bf16(transformed1[j]))));
  }
}

// A 2D grid-stride loop: y over the 16-row blocks, x over the column pairs (no division per item).
template <bool kRandomSign>
__global__ void __launch_bounds__(kAmaxThreads) amax_rht_kernel(const uint32_t* __restrict__ x, int64_t row_blocks,
                                                                int64_t pairs_per_row, float* __restrict__ amax_plain,
                                                                float* __restrict__ amax_rht) {
  __shared__ uint32_t scratch[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t running_plain = 0, running_rht = 0;
  for (int64_t row_block = blockIdx.y; row_block < row_blocks; row_block += gridDim.y) {
    const uint32_t* block_start = x + row_block * kBlockSize * pairs_per_row;
    for (int64_t pair = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; pair < pairs_per_row; pair += stride) {
      accumulate_rht_pair_amax<kRandomSign>(block_start + pair, pairs_per_row, running_plain, running_rht);
    }
  }
  running_plain = block_max_bits(running_plain, scratch);
  running_rht = block_max_bits(running_rht, scratch);
  if (threadIdx.x == 0) {
    if (amax_plain != nullptr) atomic_max_bits(amax_plain, running_plain);
    atomic_max_bits(amax_rht, running_rht);
  }
}

// One amax per column of x (per row of x^T, docs/numerics.md §6b), after the RHT of each 16-row chunk of the column
// (rounded to BF16) with kRHT: a thread takes a column pair (lanes consecutive pairs: coalesced rows) over the
// CTA's rows (a multiple of 16 with kRHT), and maxes its two results into amax atomically (amax zeroed first).
template <typename T, bool kRHT, bool kRandomSign>
__global__ void __launch_bounds__(kAmaxThreads) amax_columns_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                                                    int64_t rows_per_cta, float* __restrict__ amax) {
  const int64_t column = (static_cast<int64_t>(blockIdx.x) * kAmaxThreads + threadIdx.x) * 2;
  if (column >= cols) return;
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * rows_per_cta;
  const int64_t end_row = first_row + rows_per_cta < rows ? first_row + rows_per_cta : rows;
  uint32_t running[2] = {0u, 0u};
  if constexpr (kRHT) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x) + column / 2;
    for (int64_t row = first_row; row < end_row; row += kBlockSize) {
      float chunk[2][kBlockSize];
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        const float2 both = bf16_pair_to_float2(__ldcs(pairs + (row + i) * (cols / 2)));
        chunk[0][i] = both.x;
        chunk[1][i] = both.y;
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float transformed[kBlockSize];  // odd elements negated: the same |.|
        rht_chunk_odd_negated<kRandomSign>(chunk[j], transformed);
#pragma unroll
        for (int i = 0; i < kBlockSize; ++i) running[j] = max(running[j], abs_bits(round_to_bf16(transformed[i])));
      }
    }
  } else {
    for (int64_t row = first_row; row < end_row; ++row) {
      const T* pair = x + row * cols + column;
      running[0] = max(running[0], abs_bits(to_float(pair[0])));
      running[1] = max(running[1], abs_bits(to_float(pair[1])));
    }
  }
  atomic_max_bits(amax + column, running[0]);
  atomic_max_bits(amax + column + 1, running[1]);
}

// Per 16-row chunk (a grid-stride loop over the chunks, a CTA per chunk at a time): accumulate_rht_pair_amax over
// the chunk's column pairs, one plain and one post-RHT amax per chunk, written (no atomics, no zeroing).
template <bool kRandomSign>
__global__ void __launch_bounds__(kAmaxThreads) amax_rht_chunks_kernel(const uint32_t* __restrict__ x, int64_t chunks,
                                                                       int64_t pairs_per_row,
                                                                       float* __restrict__ amax_plain,
                                                                       float* __restrict__ amax_rht) {
  __shared__ uint32_t scratch[32];
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const uint32_t* chunk_start = x + chunk * kBlockSize * pairs_per_row;
    uint32_t running_plain = 0, running_rht = 0;
    for (int64_t pair = threadIdx.x; pair < pairs_per_row; pair += kAmaxThreads) {
      accumulate_rht_pair_amax<kRandomSign>(chunk_start + pair, pairs_per_row, running_plain, running_rht);
    }
    running_plain = block_max_bits(running_plain, scratch);
    running_rht = block_max_bits(running_rht, scratch);
    if (threadIdx.x == 0) {
      if (amax_plain != nullptr) amax_plain[chunk] = __uint_as_float(running_plain);
      amax_rht[chunk] = __uint_as_float(running_rht);
    }
  }
}

// One CTA per segment: the maxima of its entries (bits of non-negative floats or NaN: unsigned order, NaN wins),
// then the segment's rows and chunks of the expanded outputs.
__global__ void __launch_bounds__(kAmaxThreads) segment_amaxes_kernel(
    const float* __restrict__ plain, const float* __restrict__ columnwise, int64_t granule,
    const int64_t* __restrict__ offsets, float* __restrict__ segment_plain, float* __restrict__ segment_columnwise,
    float* __restrict__ rows_out, float* __restrict__ chunks_out) {
  __shared__ uint32_t scratch[32];
  const int64_t segment = blockIdx.x;
  const int64_t first_row = offsets[segment], end_row = offsets[segment + 1];
  const int64_t begin = first_row / granule, end = end_row / granule;
  const uint32_t* plain_bits = reinterpret_cast<const uint32_t*>(plain);
  const uint32_t* columnwise_bits = reinterpret_cast<const uint32_t*>(columnwise);
  uint32_t running_plain = 0, running_columnwise = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kAmaxThreads) {
    running_plain = max(running_plain, plain_bits[i]);
    if (columnwise != nullptr) running_columnwise = max(running_columnwise, columnwise_bits[i]);
  }
  running_plain = block_max_bits(running_plain, scratch);
  running_columnwise = columnwise != nullptr ? block_max_bits(running_columnwise, scratch) : running_plain;
  const float amax_plain = __uint_as_float(running_plain), amax_columnwise = __uint_as_float(running_columnwise);
  if (threadIdx.x == 0) {
    segment_plain[segment] = amax_plain;
    segment_columnwise[segment] = amax_columnwise;
  }
  if (rows_out != nullptr) {
    for (int64_t row = first_row + threadIdx.x; row < end_row; row += kAmaxThreads) rows_out[row] = amax_plain;
  }
  if (chunks_out != nullptr) {
    for (int64_t chunk = first_row / kBlockSize + threadIdx.x; chunk < end_row / kBlockSize; chunk += kAmaxThreads) {
      chunks_out[chunk] = amax_columnwise;
    }
  }
}

int64_t grid_for(int64_t work_per_thread_units) {
  const int64_t wanted = (work_per_thread_units + kAmaxThreads - 1) / kAmaxThreads;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, static_cast<int64_t>(device_multiprocessors()) * 8));
}

int64_t element_size(InputType type) { return type == InputType::kFloat32 ? 4 : 2; }

}  // namespace

cudaError_t launch_amax_tensor(const void* x, InputType type, int64_t rows, int64_t cols, float* amax,
                               cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(amax, 0, sizeof(float), stream);
  if (status != cudaSuccess) return status;
  const int64_t vectors = rows * cols * element_size(type) / 16;
  if (vectors == 0) return cudaSuccess;
  const int64_t grid = grid_for(vectors / kLoadsInFlight);
  NVFP4_DISPATCH_INPUT_TYPE(type, T, amax_tensor_kernel<T><<<grid, kAmaxThreads, 0, stream>>>(
                                         static_cast<const uint4*>(x), vectors, amax));
  return cudaGetLastError();
}

cudaError_t launch_amax_rows(const void* x, InputType type, int64_t rows, int64_t cols, float* amax,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t vectors_per_row = cols * element_size(type) / 16;
  const int64_t grid = (rows + kRowsPerAmaxBlock - 1) / kRowsPerAmaxBlock;
  NVFP4_DISPATCH_INPUT_TYPE(type, T, amax_rows_kernel<T><<<grid, kAmaxThreads, 0, stream>>>(
                                         static_cast<const uint4*>(x), rows, vectors_per_row, amax));
  return cudaGetLastError();
}

cudaError_t launch_amax_rht(const void* x, int64_t rows, int64_t cols, bool random_sign, float* amax_plain,
                            float* amax_rht, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(amax_rht, 0, sizeof(float), stream);
  if (status == cudaSuccess && amax_plain != nullptr) status = cudaMemsetAsync(amax_plain, 0, sizeof(float), stream);
  if (status != cudaSuccess) return status;
  const int64_t row_blocks = rows / kBlockSize, pairs_per_row = cols / 2;
  if (row_blocks * pairs_per_row == 0) return cudaSuccess;
  // x: enough CTAs for one pass over a row block's pairs, y: the rest of grid_for's 8 per multiprocessor
  const int64_t ctas = grid_for(row_blocks * pairs_per_row);
  const int64_t grid_x = std::min<int64_t>((pairs_per_row + kAmaxThreads - 1) / kAmaxThreads, ctas);
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(std::min<int64_t>({row_blocks, ctas / grid_x, 65535})));
  const uint32_t* words = static_cast<const uint32_t*>(x);
  if (random_sign) {
    amax_rht_kernel<true><<<grid, kAmaxThreads, 0, stream>>>(words, row_blocks, pairs_per_row, amax_plain, amax_rht);
  } else {
    amax_rht_kernel<false><<<grid, kAmaxThreads, 0, stream>>>(words, row_blocks, pairs_per_row, amax_plain, amax_rht);
  }
  return cudaGetLastError();
}

cudaError_t launch_amax_columns(const void* x, InputType type, int64_t rows, int64_t cols, bool rht, bool random_sign,
                                float* amax, cudaStream_t stream) {
  if (cols % 2 != 0 || (rht && (type != InputType::kBFloat16 || rows % kBlockSize != 0))) return cudaErrorInvalidValue;
  cudaError_t status = cudaMemsetAsync(amax, 0, cols * sizeof(float), stream);
  if (status != cudaSuccess || rows == 0 || cols == 0) return status;
  // x: one thread per column pair; y: enough row ranges (multiples of 16 rows) for 8 CTAs per multiprocessor
  const int64_t column_ctas = (cols / 2 + kAmaxThreads - 1) / kAmaxThreads;
  const int64_t row_ranges = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(device_multiprocessors()) * 8 / column_ctas, rows / kBlockSize, 65535}));
  const int64_t rows_per_cta = (rows / row_ranges + kBlockSize - 1) / kBlockSize * kBlockSize;
  const dim3 grid(static_cast<unsigned>(column_ctas), static_cast<unsigned>((rows + rows_per_cta - 1) / rows_per_cta));
  if (rht) {
    const auto* bf16 = static_cast<const __nv_bfloat16*>(x);
    if (random_sign) {
      amax_columns_kernel<__nv_bfloat16, true, true><<<grid, kAmaxThreads, 0, stream>>>(bf16, rows, cols, rows_per_cta, amax);
    } else {
      amax_columns_kernel<__nv_bfloat16, true, false><<<grid, kAmaxThreads, 0, stream>>>(bf16, rows, cols, rows_per_cta, amax);
    }
    return cudaGetLastError();
  }
  NVFP4_DISPATCH_INPUT_TYPE(type, T, amax_columns_kernel<T, false, false><<<grid, kAmaxThreads, 0, stream>>>(
                                         static_cast<const T*>(x), rows, cols, rows_per_cta, amax));
  return cudaGetLastError();
}

cudaError_t launch_amax_rht_chunks(const void* x, int64_t rows, int64_t cols, bool random_sign, float* amax_plain,
                                   float* amax_rht, cudaStream_t stream) {
  if (rows % kBlockSize != 0 || cols % 2 != 0) return cudaErrorInvalidValue;
  const int64_t chunks = rows / kBlockSize, pairs_per_row = cols / 2;
  if (chunks == 0) return cudaSuccess;
  if (pairs_per_row == 0) {
    if (amax_plain != nullptr) {
      const cudaError_t status = cudaMemsetAsync(amax_plain, 0, chunks * sizeof(float), stream);
      if (status != cudaSuccess) return status;
    }
    return cudaMemsetAsync(amax_rht, 0, chunks * sizeof(float), stream);
  }
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(chunks, 65535));
  const uint32_t* words = static_cast<const uint32_t*>(x);
  if (random_sign) {
    amax_rht_chunks_kernel<true><<<grid, kAmaxThreads, 0, stream>>>(words, chunks, pairs_per_row, amax_plain, amax_rht);
  } else {
    amax_rht_chunks_kernel<false><<<grid, kAmaxThreads, 0, stream>>>(words, chunks, pairs_per_row, amax_plain, amax_rht);
  }
  return cudaGetLastError();
}

cudaError_t launch_segment_amaxes(const float* plain, const float* columnwise, int64_t granule, const int64_t* offsets,
                                  int64_t segments, float* segment_plain, float* segment_columnwise, float* rows_out,
                                  float* chunks_out, cudaStream_t stream) {
  if (granule != 1 && granule != kBlockSize) return cudaErrorInvalidValue;
  if (segments == 0) return cudaSuccess;
  if (segments > INT32_MAX) return cudaErrorInvalidValue;
  segment_amaxes_kernel<<<static_cast<unsigned>(segments), kAmaxThreads, 0, stream>>>(
      plain, columnwise, granule, offsets, segment_plain, segment_columnwise, rows_out, chunks_out);
  return cudaGetLastError();
}

}  // namespace nvfp4
