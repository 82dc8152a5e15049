// GELU / SwiGLU of fc1's output (nvfp4_dist/reference/fused_producers.py), alone or fused with the NVFP4 cast of
// their output (fc2's input), which the fused passes never write:
// - launch_activation: the activation written in h's dtype (the unfused chain);
// - launch_activation_amaxes (pass 1): the amax of the BF16 output, per tensor (with the RHT: from the same reads
//   as the post-RHT amax, item = 16 rows x 2 columns) or per row;
// - launch_activation_cast (pass 2): producer_cast.cuh's cast with the activation as its producer.
#include <algorithm>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"
#include "producer_cast.cuh"
#include "producer_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 8;  // outputs per vector item

// 8 consecutive elements of T at `address` (16-byte aligned) as FP32.
template <typename T>
__device__ __forceinline__ void load8(const T* address, float (&out)[kVector]) {
  constexpr int kPerVector = 16 / sizeof(T);
  const uint4* source = reinterpret_cast<const uint4*>(address);
#pragma unroll
  for (int q = 0; q < kVector / kPerVector; ++q) {
    float part[kPerVector];
    unpack_vector<T>(load_streaming(source + q), part);
#pragma unroll
    for (int e = 0; e < kPerVector; ++e) out[q * kPerVector + e] = part[e];
  }
}

// The activation of outputs (row, c .. c + 7) in FP32 (before any rounding).
template <typename T, bool kSwiglu>
__device__ __forceinline__ void activation8(const T* h, int64_t cols, int64_t row, int64_t c, float (&out)[kVector]) {
  const int64_t in_cols = kSwiglu ? 2 * cols : cols;
  float first[kVector];
  load8<T>(h + row * in_cols + c, first);
  if constexpr (kSwiglu) {
    float up[kVector];
    load8<T>(h + row * in_cols + cols + c, up);
#pragma unroll
    for (int e = 0; e < kVector; ++e) out[e] = swiglu_of(first[e], up[e]);
  } else {
#pragma unroll
    for (int e = 0; e < kVector; ++e) out[e] = gelu_of(first[e]);
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* address, const float (&values)[kVector]) {
  if constexpr (sizeof(T) == 4) {
    float4* out = reinterpret_cast<float4*>(address);
    out[0] = make_float4(values[0], values[1], values[2], values[3]);
    out[1] = make_float4(values[4], values[5], values[6], values[7]);
  } else {
    alignas(16) T packed[kVector];
#pragma unroll
    for (int e = 0; e < kVector; ++e) packed[e] = from_float<T>(values[e]);
    *reinterpret_cast<uint4*>(address) = *reinterpret_cast<const uint4*>(packed);
  }
}

// The activation written in T (kWrite), or the amax of its BF16 rounding per tensor: items of 8 outputs.
template <typename T, bool kSwiglu, bool kWrite>
__global__ void __launch_bounds__(kThreads) activation_vectors_kernel(const T* __restrict__ h, int64_t rows, int64_t cols,
                                                                      T* __restrict__ out, float* __restrict__ amax) {
  __shared__ uint32_t scratch[32];
  const int64_t vectors_per_row = cols / kVector, vectors = rows * vectors_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t running = 0u;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    const int64_t row = v / vectors_per_row, c = (v % vectors_per_row) * kVector;
    float values[kVector];
    activation8<T, kSwiglu>(h, cols, row, c, values);
    if constexpr (kWrite) {
      store8<T>(out + row * cols + c, values);
    } else {
#pragma unroll
      for (int e = 0; e < kVector; ++e) running = max(running, abs_bits(rounded_to_bf16(values[e])));
    }
  }
  if constexpr (!kWrite) {
    running = block_max_bits(running, scratch);
    if (threadIdx.x == 0) atomic_max_bits(amax, running);
  }
}

// The amax of each row's BF16 output: one warp per row.
template <typename T, bool kSwiglu>
__global__ void __launch_bounds__(kThreads) activation_row_amax_kernel(const T* __restrict__ h, int64_t rows, int64_t cols,
                                                                       float* __restrict__ amax) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  uint32_t running = 0u;
  for (int64_t c = (threadIdx.x & 31) * kVector; c < cols; c += 32 * kVector) {
    float values[kVector];
    activation8<T, kSwiglu>(h, cols, row, c, values);
#pragma unroll
    for (int e = 0; e < kVector; ++e) running = max(running, abs_bits(rounded_to_bf16(values[e])));
  }
  running = __reduce_max_sync(0xFFFFFFFFu, running);
  if ((threadIdx.x & 31) == 0) amax[row] = __uint_as_float(running);
}

// Two adjacent elements of T as FP32.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* address) {
  if constexpr (sizeof(T) == 4) {
    return __ldcs(reinterpret_cast<const float2*>(address));
  } else {
    const uint32_t word = __ldcs(reinterpret_cast<const unsigned int*>(address));
    const T* halves = reinterpret_cast<const T*>(&word);
    return make_float2(to_float(halves[0]), to_float(halves[1]));
  }
}

// Two adjacent outputs (row, c), (row, c + 1) in FP32.
template <typename T, bool kSwiglu>
__device__ __forceinline__ float2 activation_pair(const T* h, int64_t cols, int64_t row, int64_t c) {
  if constexpr (kSwiglu) {
    const float2 gate = load_pair<T>(h + row * 2 * cols + c), up = load_pair<T>(h + row * 2 * cols + cols + c);
    return make_float2(swiglu_of(gate.x, up.x), swiglu_of(gate.y, up.y));
  } else {
    const float2 x = load_pair<T>(h + row * cols + c);
    return make_float2(gelu_of(x.x), gelu_of(x.y));
  }
}

// Item: two adjacent columns of one 16-row block. The amax of the BF16 output (plain) and of the BF16-rounded
// RHT of each column's 16 values (the columnwise copy's source). A 2D grid-stride loop: y over the row blocks,
// x over the column pairs.
template <typename T, bool kSwiglu, bool kRandomSign>
__global__ void __launch_bounds__(kThreads) activation_rht_amax_kernel(const T* __restrict__ h, int64_t rows, int64_t cols,
                                                                       float* __restrict__ amax_plain,
                                                                       float* __restrict__ amax_rht) {
  __shared__ uint32_t scratch[32];
  const int64_t row_blocks = rows / kBlockSize, pairs = cols / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t running_plain = 0u, running_rht = 0u;
  for (int64_t row_block = blockIdx.y; row_block < row_blocks; row_block += gridDim.y) {
    for (int64_t pair = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; pair < pairs; pair += stride) {
      float column0[kBlockSize], column1[kBlockSize];
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) {
        const float2 both = activation_pair<T, kSwiglu>(h, cols, row_block * kBlockSize + i, 2 * pair);
        column0[i] = rounded_to_bf16(both.x);
        column1[i] = rounded_to_bf16(both.y);
        running_plain = max(running_plain, max(abs_bits(column0[i]), abs_bits(column1[i])));
      }
      float transformed0[kBlockSize], transformed1[kBlockSize];
      rht_chunk_odd_negated<kRandomSign>(column0, transformed0);  // odd lanes negated: the same |.|
      rht_chunk_odd_negated<kRandomSign>(column1, transformed1);
#pragma unroll
      for (int j = 0; j < kBlockSize; ++j) {
        running_rht = max(running_rht, max(abs_bits(rounded_to_bf16(transformed0[j])), abs_bits(rounded_to_bf16(transformed1[j]))));
      }
    }
  }
  running_plain = block_max_bits(running_plain, scratch);
  running_rht = block_max_bits(running_rht, scratch);
  if (threadIdx.x == 0) {
    atomic_max_bits(amax_plain, running_plain);
    atomic_max_bits(amax_rht, running_rht);
  }
}

// The activation as the cast's producer (nothing staged).
template <typename T, bool kSwiglu>
struct ActivationProducer {
  const T* h;
  int64_t cols;

  struct Tile {};

  __device__ void stage(Tile&, int64_t, int64_t, int, int, int) const {}

  __device__ void produce8(const Tile&, int64_t m0, int64_t k0, int r, int c, float (&out)[8]) const {
    activation8<T, kSwiglu>(h, cols, m0 + r, k0 + c, out);
  }
};

// GELU as the tile cast's producer (16-bit h): the copied tile of h replaced in place by its GELU. (SwiGLU's cast
// takes the 64 x 128 kernel: the tile cast would read the up half outside its copy pipeline, which measured slower.)
template <typename T>
struct GeluTileProducer {
  static constexpr bool kTransforms = true;
  struct Staged {};

  __device__ int64_t row_stride(int64_t cols) const { return cols; }

  __device__ void stage(Staged&, int64_t, int64_t, int, int, int) const {}

  __device__ void transform(uint8_t* tile, const Staged&, int64_t, int64_t, int rows_in_tile, int cols_in_tile,
                            int tid) const {
    using Chunks = producer::TileChunks;
    const int chunk = tid % Chunks::Layout::kChunksPerRow, first_row = tid / Chunks::Layout::kChunksPerRow;
    if (chunk * 8 >= cols_in_tile) return;
    uint4 raw[Chunks::kCount];
#pragma unroll
    for (int u = 0; u < Chunks::kCount; ++u) {
      raw[u] = *reinterpret_cast<const uint4*>(tile + Chunks::Layout::chunk_offset(first_row + u * Chunks::kRowStep, chunk));
    }
#pragma unroll
    for (int u = 0; u < Chunks::kCount; ++u) {
      const int r = first_row + u * Chunks::kRowStep;
      if (r >= rows_in_tile) continue;  // the zeros outside h stay
      float values[8];
      unpack_vector<T>(raw[u], values);
#pragma unroll
      for (int e = 0; e < 8; ++e) values[e] = gelu_of(values[e]);
      *reinterpret_cast<uint4*>(tile + Chunks::Layout::chunk_offset(r, chunk)) = producer::packed_bf16(values);
    }
  }
};

template <typename T, bool kSwiglu>
cudaError_t launch_activation_cast_of(const ActivationArgs& args, const ProducerCastArgs& cast, cudaStream_t stream) {
  const T* h = static_cast<const T*>(args.h);
  if constexpr (sizeof(T) == 2 && !kSwiglu) {
    return producer::launch_produced_tile_cast(h, GeluTileProducer<T>{}, cast, stream);
  } else {
    return producer::launch_produce_and_cast(ActivationProducer<T, kSwiglu>{h, args.cols}, cast, stream);
  }
}

int64_t grid_for(int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads,
                                                static_cast<int64_t>(device_multiprocessors()) * 8));
}

bool valid(const ActivationArgs& args) { return args.cols > 0 && args.cols % kBlockSize == 0 && args.rows >= 0; }

template <typename T, bool kSwiglu>
cudaError_t launch_amaxes(const ActivationArgs& args, float* amax_rowwise, bool row_scaled, float* amax_rht,
                          bool rht_random_sign, cudaStream_t stream) {
  const T* h = static_cast<const T*>(args.h);
  if (row_scaled) {
    const int64_t grid = (args.rows + kThreads / 32 - 1) / (kThreads / 32);
    activation_row_amax_kernel<T, kSwiglu><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(h, args.rows, args.cols,
                                                                                                 amax_rowwise);
  } else if (amax_rht == nullptr) {
    activation_vectors_kernel<T, kSwiglu, false><<<static_cast<unsigned>(grid_for(args.rows * args.cols / kVector)), kThreads, 0,
                                                    stream>>>(h, args.rows, args.cols, nullptr, amax_rowwise);
  } else {  // the plain amax from the RHT amax's reads
    const int64_t row_blocks = args.rows / kBlockSize, pairs = args.cols / 2;
    const int64_t ctas = grid_for(row_blocks * pairs);
    const int64_t grid_x = std::min<int64_t>((pairs + kThreads - 1) / kThreads, ctas);
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(std::min<int64_t>({row_blocks, ctas / grid_x, 65535})));
    if (rht_random_sign) {
      activation_rht_amax_kernel<T, kSwiglu, true><<<grid, kThreads, 0, stream>>>(h, args.rows, args.cols, amax_rowwise,
                                                                                 amax_rht);
    } else {
      activation_rht_amax_kernel<T, kSwiglu, false><<<grid, kThreads, 0, stream>>>(h, args.rows, args.cols, amax_rowwise,
                                                                                  amax_rht);
    }
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_activation(const ActivationArgs& args, void* out, cudaStream_t stream) {
  if (!valid(args)) return cudaErrorInvalidValue;
  if (args.rows == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(grid_for(args.rows * args.cols / kVector));
  const bool swiglu = args.activation == Activation::kSwiglu;
  NVFP4_DISPATCH_INPUT_TYPE(
      args.type, T,
      if (swiglu) {
        activation_vectors_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(args.h), args.rows,
                                                                                args.cols, static_cast<T*>(out), nullptr);
      } else {
        activation_vectors_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(args.h), args.rows,
                                                                                 args.cols, static_cast<T*>(out), nullptr);
      });
  return cudaGetLastError();
}

cudaError_t launch_activation_amaxes(const ActivationArgs& args, float* amax_rowwise, bool row_scaled, float* amax_rht,
                                     bool rht_random_sign, cudaStream_t stream) {
  if (!valid(args) || amax_rowwise == nullptr || (amax_rht != nullptr && args.rows % kBlockSize != 0)) {
    return cudaErrorInvalidValue;
  }
  if (row_scaled && amax_rht != nullptr) return cudaErrorInvalidValue;  // row-scaled copies have no columnwise copy
  if (!row_scaled) {
    const cudaError_t status = cudaMemsetAsync(amax_rowwise, 0, sizeof(float), stream);
    if (status != cudaSuccess) return status;
  }
  if (amax_rht != nullptr) {
    const cudaError_t status = cudaMemsetAsync(amax_rht, 0, sizeof(float), stream);
    if (status != cudaSuccess) return status;
  }
  if (args.rows == 0) return cudaSuccess;
  const bool swiglu = args.activation == Activation::kSwiglu;
  NVFP4_DISPATCH_INPUT_TYPE(args.type, T,
                            return swiglu ? launch_amaxes<T, true>(args, amax_rowwise, row_scaled, amax_rht, rht_random_sign, stream)
                                          : launch_amaxes<T, false>(args, amax_rowwise, row_scaled, amax_rht, rht_random_sign, stream));
  return cudaSuccess;
}

cudaError_t launch_activation_cast(const ActivationArgs& args, const ProducerCastArgs& cast, cudaStream_t stream) {
  if (!valid(args) || cast.rows != args.rows || cast.cols != args.cols) return cudaErrorInvalidValue;
  const bool swiglu = args.activation == Activation::kSwiglu;
  NVFP4_DISPATCH_INPUT_TYPE(args.type, T,
                            return swiglu ? launch_activation_cast_of<T, true>(args, cast, stream)
                                          : launch_activation_cast_of<T, false>(args, cast, stream));
  return cudaSuccess;
}

}  // namespace nvfp4
