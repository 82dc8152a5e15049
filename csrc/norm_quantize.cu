// LayerNorm / RMSNorm (nvfp4_dist/reference/fused_producers.py), alone or fused with the NVFP4 cast of their output.
//
// Row pass (launch_norm_rows): a CTA takes bands of 16 rows, the rows of a band two (or one) at a time, the whole
// CTA on each row: thread t holds blocks t + 256 k of the row in registers; the row's sums follow the reference's
// halving tree (thread_share_of_row_sum, then block_halving_sums); LayerNorm's variance is taken from the centred
// values in registers. It writes mean and rstd, and on request the norm's output and the amax of its BF16 rounding
// (per tensor, or per row). For the RHT columnwise copy it writes the statistics alone, and a second kernel takes
// both amaxes (plain and after the RHT) from them: item = 2 columns of a 16-row block, as csrc/amax.cu takes them
// from a written output, with the 16 normalized values of each column formed in registers.
// Cast pass (launch_norm_cast): producer_cast.cuh's cast with the norm as its producer, from the statistics.
// The norm's output is never written by the fused passes.
#include <algorithm>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"
#include "producer_cast.cuh"
#include "producer_numerics.cuh"

namespace nvfp4 {
namespace {

using producer::block_halving_sums;

constexpr int kNormThreads = 256;
constexpr int kBandRows = 16;
constexpr int kMaxBlocksPerThread = 4;  // rows up to 256 * 4 * 16 = 16384 wide

struct RowPassArgs {
  const void* x;
  int64_t rows, cols;
  const float* weight;
  const float* bias;
  float eps;
  float* mean;
  float* rstd;
  float* sum_of_squares;
  void* y;
  InputType y_type;
  float* amax_rowwise;
  bool row_scaled;
};

// The 16 elements of block `block` of a row of T as FP32.
template <typename T>
__device__ __forceinline__ void load_block(const T* row, int64_t block, float (&values)[kBlockSize]) {
  constexpr int kPerVector = 16 / sizeof(T);
  const uint4* source = reinterpret_cast<const uint4*>(row + block * kBlockSize);
#pragma unroll
  for (int q = 0; q < kBlockSize / kPerVector; ++q) {
    float part[kPerVector];
    unpack_vector<T>(__ldg(source + q), part);
#pragma unroll
    for (int e = 0; e < kPerVector; ++e) values[q * kPerVector + e] = part[e];
  }
}

// 16 consecutive floats (64-byte aligned).
__device__ __forceinline__ void load_floats16(const float* address, float (&values)[kBlockSize]) {
  const float4* source = reinterpret_cast<const float4*>(address);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 part = __ldg(source + q);
    values[4 * q] = part.x;
    values[4 * q + 1] = part.y;
    values[4 * q + 2] = part.z;
    values[4 * q + 3] = part.w;
  }
}

// Two adjacent elements of T as FP32.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* address) {
  if constexpr (sizeof(T) == 4) {
    return __ldg(reinterpret_cast<const float2*>(address));
  } else {
    const uint32_t word = __ldg(reinterpret_cast<const unsigned int*>(address));
    const T* halves = reinterpret_cast<const T*>(&word);
    return make_float2(to_float(halves[0]), to_float(halves[1]));
  }
}

// 16 values of one block of the output, converted to `type` and stored (a runtime type: the norm's output dtype).
__device__ __forceinline__ void store_block(void* y, InputType type, int64_t offset, const float (&values)[kBlockSize]) {
  if (type == InputType::kFloat32) {
    float4* out = reinterpret_cast<float4*>(static_cast<float*>(y) + offset);
#pragma unroll
    for (int q = 0; q < 4; ++q) out[q] = make_float4(values[4 * q], values[4 * q + 1], values[4 * q + 2], values[4 * q + 3]);
    return;
  }
  uint32_t words[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (type == InputType::kBFloat16) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(values[2 * i], values[2 * i + 1]);
      words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    } else {
      const __half2 pair = __floats2half2_rn(values[2 * i], values[2 * i + 1]);
      words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
  }
  uint4* out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(y) + offset);
  out[0] = make_uint4(words[0], words[1], words[2], words[3]);
  out[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

template <bool kLayerNorm>
__device__ __forceinline__ float norm_of(float value, float mean, float rstd, float weight, float bias) {
  if constexpr (kLayerNorm) {
    return layer_norm_of_centred(value - mean, rstd, weight, bias);
  } else {
    return rms_norm_of(value, rstd, weight);
  }
}

// kRows rows of a band at a time (their loads in flight together); kBlocks: blocks of a row per thread; kOutput:
// the norm's output is formed (written, or its amax taken), else only the statistics. The register caps keep
// 3 (LayerNorm's output) or 4 CTAs of one- and two-block rows per multiprocessor.
template <typename T, bool kLayerNorm, int kBlocks, int kRows, bool kOutput>
__global__ void __launch_bounds__(kNormThreads, kBlocks * kRows <= 2 ? (kOutput && kLayerNorm ? 3 : 4) : 2)
    norm_rows_kernel(const RowPassArgs args) {
  __shared__ float scratch[2][kRows][kNormThreads];  // block_halving_sums' two buffers, taken in turn
  __shared__ uint32_t max_scratch[32];
  const int tid = threadIdx.x;
  const int64_t cols = args.cols, blocks_per_row = cols / kBlockSize;
  const float width = static_cast<float>(cols);
  const T* x = static_cast<const T*>(args.x);
  const int64_t bands = (args.rows + kBandRows - 1) / kBandRows;
  uint32_t tensor_amax = 0u;  // bits of the largest |output| (non-negative floats: unsigned order)
  int sums_buffer = 0;

  for (int64_t band = blockIdx.x; band < bands; band += gridDim.x) {
    const int64_t first_row = band * kBandRows;
    for (int r0 = 0; r0 < kBandRows && first_row + r0 < args.rows; r0 += kRows) {
      float v[kRows][kBlocks][kBlockSize];
      // the rows' blocks (zeros for blocks past the row's end and rows past the tensor's)
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = first_row + r0 + r;
#pragma unroll
        for (int k = 0; k < kBlocks; ++k) {
          const int64_t block = row_block_of_thread(tid, k, kNormThreads);
          if (row < args.rows && block < blocks_per_row) {
            load_block<T>(x + row * cols, block, v[r][k]);
          } else {
#pragma unroll
            for (int i = 0; i < kBlockSize; ++i) v[r][k][i] = 0.0f;
          }
        }
      }
      float mean[kRows], sum_of_squares[kRows], rstd[kRows];
      if constexpr (kLayerNorm) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float block_sums[kBlocks];
#pragma unroll
          for (int k = 0; k < kBlocks; ++k) block_sums[k] = halving_sum16(v[r][k]);
          mean[r] = thread_share_of_row_sum<kBlocks>(block_sums);
        }
        block_halving_sums<kNormThreads, kRows>(mean, scratch[sums_buffer]);
        sums_buffer ^= 1;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          mean[r] = mean_of_row(mean[r], width);
#pragma unroll
          for (int k = 0; k < kBlocks; ++k) {
            if (row_block_of_thread(tid, k, kNormThreads) < blocks_per_row) {  // absent blocks stay zero (padding)
#pragma unroll
              for (int i = 0; i < kBlockSize; ++i) v[r][k][i] = v[r][k][i] - mean[r];
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float block_sums[kBlocks];
#pragma unroll
        for (int k = 0; k < kBlocks; ++k) {
          float squares[kBlockSize];
#pragma unroll
          for (int i = 0; i < kBlockSize; ++i) squares[i] = v[r][k][i] * v[r][k][i];
          block_sums[k] = halving_sum16(squares);
        }
        sum_of_squares[r] = thread_share_of_row_sum<kBlocks>(block_sums);
      }
      block_halving_sums<kNormThreads, kRows>(sum_of_squares, scratch[sums_buffer]);
      sums_buffer ^= 1;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        rstd[r] = rstd_of_row(sum_of_squares[r], width, args.eps);
        const int64_t row = first_row + r0 + r;
        if (tid == 0 && row < args.rows) {
          if (args.sum_of_squares != nullptr) args.sum_of_squares[row] = sum_of_squares[r];
          args.rstd[row] = rstd[r];
          if (kLayerNorm) args.mean[row] = mean[r];
        }
      }
      if (!kOutput) continue;
      // the output's blocks: each block's weight and bias loaded once for the kRows rows; the largest |output|
      // kept unrounded (rounding to BF16 is monotone: the largest rounded value is the largest value rounded)
      uint32_t row_amax[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) row_amax[r] = 0u;
#pragma unroll
      for (int k = 0; k < kBlocks; ++k) {
        const int64_t block = row_block_of_thread(tid, k, kNormThreads);
        if (block >= blocks_per_row) continue;
        float weight[kBlockSize], bias[kBlockSize];
        load_floats16(args.weight + block * kBlockSize, weight);
        if (kLayerNorm) load_floats16(args.bias + block * kBlockSize, bias);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int64_t row = first_row + r0 + r;
          if (row >= args.rows) continue;
          float out[kBlockSize];
#pragma unroll
          for (int i = 0; i < kBlockSize; ++i) {
            // v holds x - mean for LayerNorm
            out[i] = kLayerNorm ? layer_norm_of_centred(v[r][k][i], rstd[r], weight[i], bias[i])
                                : rms_norm_of(v[r][k][i], rstd[r], weight[i]);
            row_amax[r] = max(row_amax[r], abs_bits(out[i]));
          }
          if (args.y != nullptr) store_block(args.y, args.y_type, row * cols + block * kBlockSize, out);
        }
      }
      if (args.amax_rowwise == nullptr) continue;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = first_row + r0 + r;
        if (args.row_scaled) {
          const uint32_t largest = rounded_bf16_bits(block_max_bits(row_amax[r], max_scratch));
          if (tid == 0 && row < args.rows) args.amax_rowwise[row] = __uint_as_float(largest);
        } else {
          tensor_amax = max(tensor_amax, row_amax[r]);
        }
      }
    }
  }
  if (args.amax_rowwise != nullptr && !args.row_scaled) {
    tensor_amax = block_max_bits(tensor_amax, max_scratch);
    if (tid == 0) atomic_max_bits(args.amax_rowwise, rounded_bf16_bits(tensor_amax));
  }
}

template <typename T, bool kLayerNorm, int kBlocks>
cudaError_t launch_rows(const RowPassArgs& args, cudaStream_t stream) {
  // two rows at a time (their loads in flight together, one round of block-wide sums for both) where their blocks
  // fit the registers (two blocks of 16 per thread and row at most); RMSNorm, one block-wide sum a row, takes rows
  // of two blocks a thread one at a time: fewer registers, more CTAs per multiprocessor
  constexpr int kRows = kBlocks * (sizeof(T) == 4 ? 2 : 1) <= 2 && (kLayerNorm || kBlocks == 1) ? 2 : 1;
  const int64_t bands = (args.rows + kBandRows - 1) / kBandRows;
  const int64_t grid = std::min<int64_t>(bands, static_cast<int64_t>(device_multiprocessors()) * 8);
  const unsigned ctas = static_cast<unsigned>(std::max<int64_t>(grid, 1));
  if (args.y != nullptr || args.amax_rowwise != nullptr) {
    norm_rows_kernel<T, kLayerNorm, kBlocks, kRows, true><<<ctas, kNormThreads, 0, stream>>>(args);
  } else {
    norm_rows_kernel<T, kLayerNorm, kBlocks, kRows, false><<<ctas, kNormThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

template <typename T, bool kLayerNorm>
cudaError_t launch_rows_for_width(const RowPassArgs& args, cudaStream_t stream) {
  const int64_t blocks_per_thread = (args.cols / kBlockSize + kNormThreads - 1) / kNormThreads;
  if (blocks_per_thread <= 1) return launch_rows<T, kLayerNorm, 1>(args, stream);
  if (blocks_per_thread <= 2) return launch_rows<T, kLayerNorm, 2>(args, stream);
  if (blocks_per_thread <= 4) return launch_rows<T, kLayerNorm, 4>(args, stream);
  return cudaErrorInvalidValue;
}

// The amaxes of the norm's BF16 output (plain, and of the RHT'd columnwise source), from the row statistics: item
// = 2 adjacent columns of one 16-row block, their 16 normalized values each rounded to BF16, through the RHT, as
// reference/rht.py forms the columnwise copy's source. The transform's outputs are not rounded one by one: their
// largest magnitude is rounded once (rounded_bf16_bits). A 2D grid-stride loop: y over the row blocks, x over the
// column pairs (consecutive lanes, consecutive pairs: coalesced rows).
template <typename T, bool kLayerNorm, bool kRandomSign>
__global__ void __launch_bounds__(kNormThreads) norm_rht_amax_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                                                     const float* __restrict__ weight,
                                                                     const float* __restrict__ bias,
                                                                     const float* __restrict__ mean,
                                                                     const float* __restrict__ rstd,
                                                                     float* __restrict__ amax_plain,
                                                                     float* __restrict__ amax_rht) {
  __shared__ uint32_t scratch[32];
  const int64_t row_blocks = rows / kBlockSize, pairs = cols / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t running_plain = 0u, running_rht = 0u;
  for (int64_t row_block = blockIdx.y; row_block < row_blocks; row_block += gridDim.y) {
    const int64_t first_row = row_block * kBlockSize;
    float row_mean[kBlockSize], row_rstd[kBlockSize];
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) {
      row_mean[i] = kLayerNorm ? __ldg(mean + first_row + i) : 0.0f;
      row_rstd[i] = __ldg(rstd + first_row + i);
    }
    for (int64_t pair = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; pair < pairs; pair += stride) {
      const int64_t col = 2 * pair;
      const float w0 = __ldg(weight + col), w1 = __ldg(weight + col + 1);
      const float b0 = kLayerNorm ? __ldg(bias + col) : 0.0f, b1 = kLayerNorm ? __ldg(bias + col + 1) : 0.0f;
      float2 both[kBlockSize];
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) both[i] = load_pair<T>(x + (first_row + i) * cols + col);
      float column0[kBlockSize], column1[kBlockSize];
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        column0[i] = rounded_to_bf16(norm_of<kLayerNorm>(both[i].x, row_mean[i], row_rstd[i], w0, b0));
        column1[i] = rounded_to_bf16(norm_of<kLayerNorm>(both[i].y, row_mean[i], row_rstd[i], w1, b1));
        running_plain = max(running_plain, max(abs_bits(column0[i]), abs_bits(column1[i])));
      }
      float transformed0[kBlockSize], transformed1[kBlockSize];
      rht_chunk_odd_negated<kRandomSign>(column0, transformed0);  // odd lanes negated: the same |.|
      rht_chunk_odd_negated<kRandomSign>(column1, transformed1);
#pragma unroll
      for (int j = 0; j < kBlockSize; ++j) {
        running_rht = max(running_rht, max(abs_bits(transformed0[j]), abs_bits(transformed1[j])));
      }
    }
  }
  running_plain = block_max_bits(running_plain, scratch);
  running_rht = block_max_bits(running_rht, scratch);
  if (threadIdx.x == 0) {
    if (amax_plain != nullptr) atomic_max_bits(amax_plain, running_plain);
    atomic_max_bits(amax_rht, rounded_bf16_bits(running_rht));
  }
}

template <typename T, bool kLayerNorm>
cudaError_t launch_rht_amax(const RowPassArgs& args, float* amax_plain, float* amax_rht, bool rht_random_sign,
                            cudaStream_t stream) {
  const int64_t row_blocks = args.rows / kBlockSize, pairs = args.cols / 2;
  // x: enough CTAs for one pass over a row block's pairs, y: the rest of 8 CTAs per multiprocessor
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>((row_blocks * pairs + kNormThreads - 1) / kNormThreads,
                                                              static_cast<int64_t>(device_multiprocessors()) * 8));
  const int64_t grid_x = std::min<int64_t>((pairs + kNormThreads - 1) / kNormThreads, ctas);
  const dim3 grid(static_cast<unsigned>(grid_x),
                  static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>({row_blocks, ctas / grid_x, 65535}))));
  const T* x = static_cast<const T*>(args.x);
  if (rht_random_sign) {
    norm_rht_amax_kernel<T, kLayerNorm, true><<<grid, kNormThreads, 0, stream>>>(
        x, args.rows, args.cols, args.weight, args.bias, args.mean, args.rstd, amax_plain, amax_rht);
  } else {
    norm_rht_amax_kernel<T, kLayerNorm, false><<<grid, kNormThreads, 0, stream>>>(
        x, args.rows, args.cols, args.weight, args.bias, args.mean, args.rstd, amax_plain, amax_rht);
  }
  return cudaGetLastError();
}

// With the RHT columnwise copy, the rows kernel takes the statistics alone (and the output, when asked), and the
// RHT kernel both amaxes: the normalized values are formed once, where the transform needs them. (One kernel that
// re-read each band of 16 rows for the amaxes right after its statistics gained little: the passes are bound
// mostly by their arithmetic and latencies, not by the second read of x.)
template <typename T, bool kLayerNorm>
cudaError_t launch_row_pass(const RowPassArgs& args, float* amax_rht, bool rht_random_sign, cudaStream_t stream) {
  if (amax_rht == nullptr) return launch_rows_for_width<T, kLayerNorm>(args, stream);
  RowPassArgs statistics = args;
  statistics.amax_rowwise = nullptr;
  const cudaError_t status = launch_rows_for_width<T, kLayerNorm>(statistics, stream);
  if (status != cudaSuccess) return status;
  return launch_rht_amax<T, kLayerNorm>(args, args.amax_rowwise, amax_rht, rht_random_sign, stream);
}

// The norm as the cast's producer: the tile's rows' statistics and columns' weight and bias staged in shared memory.
template <typename T, bool kLayerNorm>
struct NormProducer {
  const T* x;
  int64_t cols;
  const float* weight;
  const float* bias;
  const float* mean;
  const float* rstd;

  struct Tile {
    float mean[producer::kCastTileRows], rstd[producer::kCastTileRows];
    __align__(16) float weight[producer::kCastTileCols];
    __align__(16) float bias[producer::kCastTileCols];
  };

  static constexpr int kSourceBytes = 0;  // produce8 loads x itself

  __device__ void prepare(Tile&, int) const {}

  __device__ void copy_source(uint8_t*, int64_t, int64_t, int, int, int) const {}

  __device__ void stage(Tile& tile, int64_t m0, int64_t k0, int rows_in_tile, int cols_in_tile, int tid) const {
    if (tid < rows_in_tile) {
      tile.rstd[tid] = rstd[m0 + tid];
      tile.mean[tid] = kLayerNorm ? mean[m0 + tid] : 0.0f;
    }
    if (tid < cols_in_tile) {
      tile.weight[tid] = weight[k0 + tid];
      tile.bias[tid] = kLayerNorm ? bias[k0 + tid] : 0.0f;
    }
  }

  __device__ void produce8(const Tile& tile, const uint8_t*, int64_t m0, int64_t k0, int r, int c,
                           float (&out)[8]) const {
    constexpr int kPerVector = 16 / sizeof(T);
    const uint4* source = reinterpret_cast<const uint4*>(x + (m0 + r) * cols + k0 + c);
    float values[8];
#pragma unroll
    for (int q = 0; q < 8 / kPerVector; ++q) {
      float part[kPerVector];
      unpack_vector<T>(load_streaming(source + q), part);
#pragma unroll
      for (int e = 0; e < kPerVector; ++e) values[q * kPerVector + e] = part[e];
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = norm_of<kLayerNorm>(values[e], tile.mean[r], tile.rstd[r], tile.weight[c + e], tile.bias[c + e]);
  }
};

// The norm as the tile cast's producer (16-bit x): the copied tile of x normalized in place, from the statistics
// of its rows and the weight and bias of its columns, staged while the tile's copy is in flight.
template <typename T, bool kLayerNorm>
struct NormTileProducer {
  static constexpr bool kTransforms = true;
  const float* weight;
  const float* bias;
  const float* mean;
  const float* rstd;

  struct Staged {
    float mean[tile_cast::kTileRows], rstd[tile_cast::kTileRows];
    __align__(16) float weight[tile_cast::kTileCols];
    __align__(16) float bias[tile_cast::kTileCols];
  };

  __device__ int64_t row_stride(int64_t cols) const { return cols; }

  __device__ void stage(Staged& staged, int64_t m0, int64_t k0, int rows_in_tile, int cols_in_tile, int tid) const {
    static_assert(tile_cast::kThreads == 2 * tile_cast::kTileRows && tile_cast::kTileRows == tile_cast::kTileCols,
                  "a thread per row statistic and per column parameter");
    const int index = tid % tile_cast::kTileRows;
    if (tid < tile_cast::kTileRows) {
      if (index < rows_in_tile) {
        staged.rstd[index] = __ldg(rstd + m0 + index);
        staged.mean[index] = kLayerNorm ? __ldg(mean + m0 + index) : 0.0f;
      }
    } else if (index < cols_in_tile) {
      staged.weight[index] = __ldg(weight + k0 + index);
      staged.bias[index] = kLayerNorm ? __ldg(bias + k0 + index) : 0.0f;
    }
  }

  __device__ void transform(uint8_t* tile, const Staged& staged, int64_t, int64_t, int rows_in_tile, int cols_in_tile,
                            int tid) const {
    using Chunks = producer::TileChunks;
    const int chunk = tid % Chunks::Layout::kChunksPerRow, first_row = tid / Chunks::Layout::kChunksPerRow;
    const int c = chunk * 8;
    if (c >= cols_in_tile) return;
    uint4 raw[Chunks::kCount];
#pragma unroll
    for (int u = 0; u < Chunks::kCount; ++u) {
      raw[u] = *reinterpret_cast<const uint4*>(tile + Chunks::Layout::chunk_offset(first_row + u * Chunks::kRowStep, chunk));
    }
    float w[8], b[8];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float4 w4 = *reinterpret_cast<const float4*>(staged.weight + c + 4 * q);
      const float4 b4 = *reinterpret_cast<const float4*>(staged.bias + c + 4 * q);
      w[4 * q] = w4.x, w[4 * q + 1] = w4.y, w[4 * q + 2] = w4.z, w[4 * q + 3] = w4.w;
      b[4 * q] = b4.x, b[4 * q + 1] = b4.y, b[4 * q + 2] = b4.z, b[4 * q + 3] = b4.w;
    }
#pragma unroll
    for (int u = 0; u < Chunks::kCount; ++u) {
      const int r = first_row + u * Chunks::kRowStep;
      if (r >= rows_in_tile) continue;  // the zeros outside x stay
      float values[8];
      unpack_vector<T>(raw[u], values);
#pragma unroll
      for (int e = 0; e < 8; ++e) values[e] = norm_of<kLayerNorm>(values[e], staged.mean[r], staged.rstd[r], w[e], b[e]);
      *reinterpret_cast<uint4*>(tile + Chunks::Layout::chunk_offset(r, chunk)) = producer::packed_bf16(values);
    }
  }
};

template <typename T, bool kLayerNorm>
cudaError_t launch_norm_cast_of(const NormArgs& norm, const ProducerCastArgs& cast, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    return producer::launch_produced_tile_cast(
        norm.x, NormTileProducer<T, kLayerNorm>{norm.weight, norm.bias, norm.mean, norm.rstd}, cast, stream);
  } else {
    return producer::launch_produce_and_cast(
        NormProducer<T, kLayerNorm>{static_cast<const T*>(norm.x), norm.cols, norm.weight, norm.bias, norm.mean,
                                    norm.rstd},
        cast, stream);
  }
}

}  // namespace

cudaError_t launch_norm_rows(const NormArgs& norm, void* y, InputType y_type, float* amax_rowwise, bool row_scaled,
                             float* amax_rht, bool rht_random_sign, cudaStream_t stream) {
  if (norm.cols <= 0 || norm.cols % kBlockSize != 0 || norm.cols > kNormThreads * kMaxBlocksPerThread * kBlockSize) {
    return cudaErrorInvalidValue;
  }
  if (amax_rht != nullptr && (norm.rows % kBandRows != 0 || row_scaled || y != nullptr)) return cudaErrorInvalidValue;
  if (norm.rows == 0) return cudaSuccess;
  if (amax_rowwise != nullptr && !row_scaled) {
    const cudaError_t status = cudaMemsetAsync(amax_rowwise, 0, sizeof(float), stream);
    if (status != cudaSuccess) return status;
  }
  if (amax_rht != nullptr) {
    const cudaError_t status = cudaMemsetAsync(amax_rht, 0, sizeof(float), stream);
    if (status != cudaSuccess) return status;
  }
  const RowPassArgs args{norm.x,    norm.rows, norm.cols, norm.weight,  norm.bias,  norm.eps, norm.mean,
                         norm.rstd, norm.sum_of_squares,  y, y_type, amax_rowwise, row_scaled};
  const bool layer_norm = norm.normalization == Normalization::kLayerNorm;
  NVFP4_DISPATCH_INPUT_TYPE(norm.type, T,
                            return layer_norm ? launch_row_pass<T, true>(args, amax_rht, rht_random_sign, stream)
                                              : launch_row_pass<T, false>(args, amax_rht, rht_random_sign, stream));
  return cudaSuccess;
}

cudaError_t launch_norm_cast(const NormArgs& norm, const ProducerCastArgs& cast, cudaStream_t stream) {
  if (norm.cols % kBlockSize != 0 || cast.rows != norm.rows || cast.cols != norm.cols) return cudaErrorInvalidValue;
  const bool layer_norm = norm.normalization == Normalization::kLayerNorm;
  NVFP4_DISPATCH_INPUT_TYPE(norm.type, T,
                            return layer_norm ? launch_norm_cast_of<T, true>(norm, cast, stream)
                                              : launch_norm_cast_of<T, false>(norm, cast, stream));
  return cudaSuccess;
}

}  // namespace nvfp4
