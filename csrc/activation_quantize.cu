// GELU / SwiGLU of fc1's output (nvfp4_dist/reference/fused_producers.py), alone or fused with the NVFP4 cast of
// their output (fc2's input), which the fused passes never write:
// - launch_activation: the activation written in h's dtype (the unfused chain);
// - launch_activation_amaxes (pass 1): the amax of the BF16 output, per tensor (with the RHT: from the same reads
//   as the post-RHT amax, item = 16 rows x 2 columns) or per row;
// - launch_activation_cast (pass 2): producer_cast.cuh's cast with the activation as its producer;
// - launch_activation_table: the table of GELU or SiLU values (producer_numerics.cuh) by which the kernels
//   activate BF16 inputs (ActivationArgs::table; null: the formulas), copied into shared memory per CTA.
#include <algorithm>
#include <type_traits>

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

template <bool kSwiglu>
constexpr int kTableBytes = kSwiglu ? kSiluTableBytes : kGeluTableBytes;

// GELU of the BF16 pairs in `words` (two BF16 values a word), rounded to BF16, in place, from the GELU table in
// shared memory: the common path for every word, then, if any word asks, the exact path for all of them (one branch
// per call, rarely taken).
template <int kWords>
__device__ __forceinline__ void gelu_words_by_table(uint32_t (&words)[kWords], const uint32_t* table) {
  uint32_t redo = 0u, common[kWords];
#pragma unroll
  for (int w = 0; w < kWords; ++w) common[w] = gelu_bf16_pair_common(words[w], table, redo);
  if (gelu_pair_redo(redo)) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) words[w] = gelu_bf16_pair_exact(words[w], table);
  } else {
#pragma unroll
    for (int w = 0; w < kWords; ++w) words[w] = common[w];
  }
}

// SiLU of the BF16 pairs in `words` (low half first), FP32, into `out`, from the SiLU table in shared memory: the
// common path for every word, then, if any word asks, silu_by_table for all of them.
template <int kWords>
__device__ __forceinline__ void silu_words_by_table(const uint32_t (&words)[kWords], const float* table,
                                                    float (&out)[2 * kWords]) {
  uint32_t redo = 0u;
#pragma unroll
  for (int w = 0; w < kWords; ++w) silu_pair_common(words[w], table, out[2 * w], out[2 * w + 1], redo);
  if (silu_pair_redo(redo)) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      const float2 gate = bf16_pair_to_float2(words[w]);
      out[2 * w] = silu_by_table(gate.x, table);
      out[2 * w + 1] = silu_by_table(gate.y, table);
    }
  }
}

// SwiGLU of 2 kWords outputs from the BF16 pairs of gate and up, from the SiLU table: silu(gate) * up in FP32.
template <int kWords>
__device__ __forceinline__ void swiglu_words_by_table(const uint32_t (&gate)[kWords], const uint32_t (&up)[kWords],
                                                      const float* table, float (&out)[2 * kWords]) {
  silu_words_by_table(gate, table, out);
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    const float2 factor = bf16_pair_to_float2(up[w]);
    out[2 * w] = out[2 * w] * factor.x;
    out[2 * w + 1] = out[2 * w + 1] * factor.y;
  }
}

// The activation of one output from fc1's values by the formulas, or (kLookup, BF16 h) of pairs of outputs from words
// of h by the activation's table in shared memory (gelu_words_by_table: GELU already rounded to BF16, as every caller
// rounds it; swiglu_words_by_table).
template <typename T, bool kSwiglu, bool kLookup>
struct Activate {
  static_assert(!kLookup || std::is_same_v<T, __nv_bfloat16>, "the tables take BF16 inputs");
  const void* table;  // kLookup: shared memory

  __device__ __forceinline__ float operator()(float x) const {  // GELU
    static_assert(!kLookup, "by table: gelu_words_by_table");
    return gelu_of(x);
  }
  __device__ __forceinline__ float operator()(float gate, float up) const {  // SwiGLU
    static_assert(!kLookup, "by table: swiglu_words_by_table");
    return swiglu_of(gate, up);
  }
  // GELU of the pairs in words, in place, or SwiGLU of (gate, up) pairs into out
  template <int kWords>
  __device__ __forceinline__ void gelu_words(uint32_t (&words)[kWords]) const {
    gelu_words_by_table(words, static_cast<const uint32_t*>(table));
  }
  template <int kWords>
  __device__ __forceinline__ void swiglu_words(const uint32_t (&gate)[kWords], const uint32_t (&up)[kWords],
                                               float (&out)[2 * kWords]) const {
    swiglu_words_by_table(gate, up, static_cast<const float*>(table), out);
  }
};

// The activation's table (kTableBytes<kSwiglu> at `global`) copied into `shared` by the CTA's threads; the caller's
// barrier follows.
template <bool kSwiglu>
__device__ __forceinline__ void copy_table(uint8_t* shared, const void* global) {
  const uint4* source = static_cast<const uint4*>(global);
  for (int i = threadIdx.x; i < kTableBytes<kSwiglu> / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(shared)[i] = __ldg(source + i);
  }
}

// Shared memory for the table of a kernel that looks the activation up (16 bytes otherwise).
template <bool kSwiglu, bool kLookup>
struct SharedTable {
  __align__(16) uint8_t bytes[kLookup ? kTableBytes<kSwiglu> : 16];
};

// The activation of a grid-stride kernel: with kLookup, its table copied into `shared` first (a barrier: collective).
template <typename T, bool kSwiglu, bool kLookup>
__device__ __forceinline__ Activate<T, kSwiglu, kLookup> activation_with_table(SharedTable<kSwiglu, kLookup>& shared,
                                                                               const void* table) {
  if constexpr (kLookup) {
    copy_table<kSwiglu>(shared.bytes, table);
    __syncthreads();
  }
  return Activate<T, kSwiglu, kLookup>{shared.bytes};
}

// The activation of outputs (row, c .. c + 7) in FP32 (before any rounding).
template <typename T, bool kSwiglu, bool kLookup>
__device__ __forceinline__ void activation8(const Activate<T, kSwiglu, kLookup>& act, const T* h, int64_t cols,
                                            int64_t row, int64_t c, float (&out)[kVector]) {
  const int64_t in_cols = kSwiglu ? 2 * cols : cols;
  if constexpr (kLookup) {
    const uint4 raw = load_streaming(reinterpret_cast<const uint4*>(h + row * in_cols + c));
    uint32_t words[kVector / 2] = {raw.x, raw.y, raw.z, raw.w};
    if constexpr (kSwiglu) {
      const uint4 raw_up = load_streaming(reinterpret_cast<const uint4*>(h + row * in_cols + cols + c));
      const uint32_t up[kVector / 2] = {raw_up.x, raw_up.y, raw_up.z, raw_up.w};
      act.swiglu_words(words, up, out);
    } else {
      act.gelu_words(words);
#pragma unroll
      for (int w = 0; w < kVector / 2; ++w) {
        const float2 both = bf16_pair_to_float2(words[w]);
        out[2 * w] = both.x;
        out[2 * w + 1] = both.y;
      }
    }
  } else if constexpr (kSwiglu) {
    float first[kVector], up[kVector];
    load8<T>(h + row * in_cols + c, first);
    load8<T>(h + row * in_cols + cols + c, up);
#pragma unroll
    for (int e = 0; e < kVector; ++e) out[e] = act(first[e], up[e]);
  } else {
    float first[kVector];
    load8<T>(h + row * in_cols + c, first);
#pragma unroll
    for (int e = 0; e < kVector; ++e) out[e] = act(first[e]);
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
template <typename T, bool kSwiglu, bool kWrite, bool kLookup>
__global__ void __launch_bounds__(kThreads) activation_vectors_kernel(const T* __restrict__ h, int64_t rows, int64_t cols,
                                                                      T* __restrict__ out, float* __restrict__ amax,
                                                                      const void* __restrict__ table) {
  __shared__ uint32_t scratch[32];
  __shared__ SharedTable<kSwiglu, kLookup> shared_table;
  const auto act = activation_with_table<T>(shared_table, table);
  const int64_t vectors_per_row = cols / kVector, vectors = rows * vectors_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t running = 0u;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    const int64_t row = v / vectors_per_row, c = (v % vectors_per_row) * kVector;
    float values[kVector];
    activation8<T, kSwiglu>(act, h, cols, row, c, values);
    if constexpr (kWrite) {
      store8<T>(out + row * cols + c, values);
    } else {
#pragma unroll
      for (int e = 0; e < kVector; ++e) running = max(running, abs_bits(values[e]));
    }
  }
  if constexpr (!kWrite) {
    running = block_max_bits(running, scratch);
    if (threadIdx.x == 0) atomic_max_bits(amax, rounded_bf16_bits(running));
  }
}

// The amax of each row's BF16 output: a warp per row, a grid-stride loop over the rows.
template <typename T, bool kSwiglu, bool kLookup>
__global__ void __launch_bounds__(kThreads) activation_row_amax_kernel(const T* __restrict__ h, int64_t rows, int64_t cols,
                                                                       float* __restrict__ amax,
                                                                       const void* __restrict__ table) {
  __shared__ SharedTable<kSwiglu, kLookup> shared_table;
  const auto act = activation_with_table<T>(shared_table, table);
  constexpr int kWarps = kThreads / 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    uint32_t running = 0u;
    for (int64_t c = (threadIdx.x & 31) * kVector; c < cols; c += 32 * kVector) {
      float values[kVector];
      activation8<T, kSwiglu>(act, h, cols, row, c, values);
#pragma unroll
      for (int e = 0; e < kVector; ++e) running = max(running, abs_bits(values[e]));
    }
    running = __reduce_max_sync(0xFFFFFFFFu, running);
    if ((threadIdx.x & 31) == 0) amax[row] = __uint_as_float(rounded_bf16_bits(running));
  }
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

// Item: two adjacent columns of one 16-row block. The amax of the BF16 output (plain) and of the BF16-rounded
// RHT of each column's 16 values (the columnwise copy's source; its largest magnitude rounded once,
// rounded_bf16_bits). A 2D grid-stride loop: y over the row blocks, x over the column pairs.
template <typename T, bool kSwiglu, bool kRandomSign, bool kLookup>
__global__ void __launch_bounds__(kThreads) activation_rht_amax_kernel(const T* __restrict__ h, int64_t rows, int64_t cols,
                                                                       float* __restrict__ amax_plain,
                                                                       float* __restrict__ amax_rht,
                                                                       const void* __restrict__ table) {
  __shared__ uint32_t scratch[32];
  __shared__ SharedTable<kSwiglu, kLookup> shared_table;
  const auto act = activation_with_table<T>(shared_table, table);
  const int64_t row_blocks = rows / kBlockSize, pairs = cols / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t running_plain = 0u, running_rht = 0u;
  uint32_t running_halves = 0u;  // GELU by table: the largest BF16 magnitude bits of the low and the high halves
  for (int64_t row_block = blockIdx.y; row_block < row_blocks; row_block += gridDim.y) {
    for (int64_t pair = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; pair < pairs; pair += stride) {
      float column0[kBlockSize], column1[kBlockSize];
      if constexpr (kLookup) {  // a word of h (two BF16 values) a row, looked up two at once
        const int64_t in_cols = kSwiglu ? 2 * cols : cols;
        uint32_t words[kBlockSize], ups[kSwiglu ? kBlockSize : 1];  // every load in flight before the arithmetic
#pragma unroll
        for (int i = 0; i < kBlockSize; ++i) {
          const T* const address = h + (row_block * kBlockSize + i) * in_cols + 2 * pair;
          words[i] = __ldcs(reinterpret_cast<const unsigned int*>(address));
          if constexpr (kSwiglu) ups[i] = __ldcs(reinterpret_cast<const unsigned int*>(address + cols));
        }
        if constexpr (kSwiglu) {  // 4 rows at a time: their words die before the next 4 rows' are looked up
#pragma unroll
          for (int i0 = 0; i0 < kBlockSize; i0 += 4) {
            const uint32_t gate4[4] = {words[i0], words[i0 + 1], words[i0 + 2], words[i0 + 3]};
            const uint32_t up4[4] = {ups[i0], ups[i0 + 1], ups[i0 + 2], ups[i0 + 3]};
            float produced[8];
            act.swiglu_words(gate4, up4, produced);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              column0[i0 + i] = rounded_to_bf16(produced[2 * i]);
              column1[i0 + i] = rounded_to_bf16(produced[2 * i + 1]);
              running_plain = max(running_plain, max(abs_bits(column0[i0 + i]), abs_bits(column1[i0 + i])));
            }
          }
        } else {
          act.gelu_words(words);
#pragma unroll
          for (int i = 0; i < kBlockSize; ++i) {
            const float2 both = bf16_pair_to_float2(words[i]);
            column0[i] = both.x;
            column1[i] = both.y;
            running_halves = max_u16x2(running_halves, words[i] & 0x7FFF7FFFu);
          }
        }
      } else {
        float2 inputs[kBlockSize], ups[kSwiglu ? kBlockSize : 1];  // every load in flight before the arithmetic
#pragma unroll
        for (int i = 0; i < kBlockSize; ++i) {
          const int64_t row = row_block * kBlockSize + i;
          inputs[i] = load_pair<T>(h + row * (kSwiglu ? 2 * cols : cols) + 2 * pair);
          if constexpr (kSwiglu) ups[i] = load_pair<T>(h + row * 2 * cols + cols + 2 * pair);
        }
#pragma unroll
        for (int i = 0; i < kBlockSize; ++i) {
          if constexpr (kSwiglu) {
            column0[i] = rounded_to_bf16(act(inputs[i].x, ups[i].x));
            column1[i] = rounded_to_bf16(act(inputs[i].y, ups[i].y));
          } else {
            column0[i] = rounded_to_bf16(act(inputs[i].x));
            column1[i] = rounded_to_bf16(act(inputs[i].y));
          }
          running_plain = max(running_plain, max(abs_bits(column0[i]), abs_bits(column1[i])));
        }
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
  running_plain = max(running_plain, max(running_halves << 16, running_halves & 0xFFFF0000u));
  running_plain = block_max_bits(running_plain, scratch);
  running_rht = block_max_bits(running_rht, scratch);
  if (threadIdx.x == 0) {
    atomic_max_bits(amax_plain, running_plain);
    atomic_max_bits(amax_rht, rounded_bf16_bits(running_rht));
  }
}

// The activation as the cast's producer: the table, when it looks the activation up, staged once per CTA. SwiGLU
// of 16-bit h takes the kernel's copy pipeline: each thread's gate and up vectors of the next tile copied into a
// source slot (vector v's gate at 16 v, its up kGateBytes further) while the current tile is cast.
template <typename T, bool kSwiglu, bool kLookup>
struct ActivationProducer {
  const T* h;
  int64_t cols;
  const void* table;  // kLookup: global memory

  using Tile = SharedTable<kSwiglu, kLookup>;
  static constexpr bool kCopied = kSwiglu && sizeof(T) == 2;
  static constexpr int kGateBytes = producer::kCastTileRows * producer::kCastRowBytes;
  static constexpr int kSourceBytes = kCopied ? 2 * kGateBytes : 0;

  __device__ void prepare(Tile& tile, int) const {
    if constexpr (kLookup) copy_table<kSwiglu>(tile.bytes, table);
  }

  __device__ void stage(Tile&, int64_t, int64_t, int, int, int) const {}

  __device__ void copy_source(uint8_t* slot, int64_t m0, int64_t k0, int rows_in_tile, int cols_in_tile, int tid) const {
    if constexpr (kCopied) {
#pragma unroll
      for (int u = 0; u < producer::kCastVectorsPerThread; ++u) {
        const producer::CastVector vector(tid, u);
        if (vector.row < rows_in_tile && vector.chunk * 8 < cols_in_tile) {
          const T* gate = h + (m0 + vector.row) * 2 * cols + k0 + vector.chunk * 8;
          producer::cp_async_16(slot + 16 * vector.index(), gate);
          producer::cp_async_16(slot + kGateBytes + 16 * vector.index(), gate + cols);
        }
      }
    }
  }

  __device__ void produce8(const Tile& tile, const uint8_t* slot, int64_t m0, int64_t k0, int r, int c,
                           float (&out)[8]) const {
    const Activate<T, kSwiglu, kLookup> act{tile.bytes};
    if constexpr (kCopied) {
      const int offset = 16 * producer::CastVector::index_of(r, c / 8);
      const uint4 gate_raw = *reinterpret_cast<const uint4*>(slot + offset);
      const uint4 up_raw = *reinterpret_cast<const uint4*>(slot + kGateBytes + offset);
      if constexpr (kLookup) {
        const uint32_t gate[4] = {gate_raw.x, gate_raw.y, gate_raw.z, gate_raw.w};
        const uint32_t up[4] = {up_raw.x, up_raw.y, up_raw.z, up_raw.w};
        act.swiglu_words(gate, up, out);
      } else {
        float gate[8], up[8];
        unpack_vector<T>(gate_raw, gate);
        unpack_vector<T>(up_raw, up);
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = act(gate[e], up[e]);
      }
    } else {
      activation8<T, kSwiglu>(act, h, cols, m0 + r, k0 + c, out);
    }
  }
};

// GELU as the tile cast's producer (16-bit h): the copied tile of h replaced in place by its GELU, looked up in
// the table staged with each tile when kLookup. (SwiGLU's cast takes the 64 x 128 kernel: the tile cast would
// read the up half outside its copy pipeline, which measured slower.)
template <typename T, bool kLookup>
struct GeluTileProducer {
  static constexpr bool kTransforms = true;
  using Staged = SharedTable<false, kLookup>;
  const void* table;  // kLookup: global memory

  __device__ int64_t row_stride(int64_t cols) const { return cols; }

  __device__ void stage(Staged& staged, int64_t, int64_t, int, int, int) const {
    if constexpr (kLookup) copy_table<false>(staged.bytes, table);
  }

  __device__ void transform(uint8_t* tile, const Staged& staged, int64_t, int64_t, int rows_in_tile, int cols_in_tile,
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
      uint4 produced;
      if constexpr (kLookup) {  // on the BF16 bits, two a word
        uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
        gelu_words_by_table(words, reinterpret_cast<const uint32_t*>(staged.bytes));
        produced = make_uint4(words[0], words[1], words[2], words[3]);
      } else {
        float values[8];
        unpack_vector<T>(raw[u], values);
#pragma unroll
        for (int e = 0; e < 8; ++e) values[e] = gelu_of(values[e]);
        produced = producer::packed_bf16(values);
      }
      *reinterpret_cast<uint4*>(tile + Chunks::Layout::chunk_offset(r, chunk)) = produced;
    }
  }
};

template <typename T, bool kSwiglu, bool kLookup>
cudaError_t launch_activation_cast_of(const ActivationArgs& args, const ProducerCastArgs& cast, cudaStream_t stream) {
  const T* h = static_cast<const T*>(args.h);
  if constexpr (sizeof(T) == 2 && !kSwiglu) {
    return producer::launch_produced_tile_cast(h, GeluTileProducer<T, kLookup>{args.table}, cast, stream);
  } else {
    return producer::launch_produce_and_cast(ActivationProducer<T, kSwiglu, kLookup>{h, args.cols, args.table}, cast,
                                             stream);
  }
}

// fn(std::integral_constant<bool, kLookup>) for the activation's inputs T: the kernels look the activation up for
// BF16 inputs given a table.
template <typename T, typename Fn>
cudaError_t with_lookup(const ActivationArgs& args, Fn&& fn) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (args.table != nullptr) return fn(std::true_type{});
  }
  return fn(std::false_type{});
}

// Word i of the GELU table, or entry i of the SiLU one (FP32, zeros in the padding to 16 bytes).
__global__ void __launch_bounds__(kThreads) activation_table_kernel(bool swiglu, void* table) {
  const int i = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (swiglu) {
    if (i < kSiluTableBytes / 4) static_cast<float*>(table)[i] = i < silu_table().entries() ? silu_table_entry(i) : 0.0f;
  } else if (i < kGeluWindow) {
    static_cast<uint32_t*>(table)[i] = gelu_table_word(i);
  }
}

int64_t grid_for(int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads,
                                                static_cast<int64_t>(device_multiprocessors()) * 8));
}

bool valid(const ActivationArgs& args) { return args.cols > 0 && args.cols % kBlockSize == 0 && args.rows >= 0; }

template <typename T, bool kSwiglu, bool kLookup>
cudaError_t launch_amaxes(const ActivationArgs& args, float* amax_rowwise, bool row_scaled, float* amax_rht,
                          bool rht_random_sign, cudaStream_t stream) {
  const T* h = static_cast<const T*>(args.h);
  if (row_scaled) {
    const int64_t grid = grid_for(args.rows * 32);  // a warp per row
    activation_row_amax_kernel<T, kSwiglu, kLookup><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        h, args.rows, args.cols, amax_rowwise, args.table);
  } else if (amax_rht == nullptr) {
    activation_vectors_kernel<T, kSwiglu, false, kLookup>
        <<<static_cast<unsigned>(grid_for(args.rows * args.cols / kVector)), kThreads, 0, stream>>>(
            h, args.rows, args.cols, nullptr, amax_rowwise, args.table);
  } else {  // the plain amax from the RHT amax's reads
    const int64_t row_blocks = args.rows / kBlockSize, pairs = args.cols / 2;
    const int64_t ctas = grid_for(row_blocks * pairs);
    const int64_t grid_x = std::min<int64_t>((pairs + kThreads - 1) / kThreads, ctas);
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(std::min<int64_t>({row_blocks, ctas / grid_x, 65535})));
    if (rht_random_sign) {
      activation_rht_amax_kernel<T, kSwiglu, true, kLookup><<<grid, kThreads, 0, stream>>>(h, args.rows, args.cols,
                                                                                          amax_rowwise, amax_rht, args.table);
    } else {
      activation_rht_amax_kernel<T, kSwiglu, false, kLookup><<<grid, kThreads, 0, stream>>>(h, args.rows, args.cols,
                                                                                           amax_rowwise, amax_rht, args.table);
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
      return with_lookup<T>(args, [&](auto lookup) {
        constexpr bool kLookup = decltype(lookup)::value;
        const T* h = static_cast<const T*>(args.h);
        if (swiglu) {
          activation_vectors_kernel<T, true, true, kLookup><<<grid, kThreads, 0, stream>>>(
              h, args.rows, args.cols, static_cast<T*>(out), nullptr, args.table);
        } else {
          activation_vectors_kernel<T, false, true, kLookup><<<grid, kThreads, 0, stream>>>(
              h, args.rows, args.cols, static_cast<T*>(out), nullptr, args.table);
        }
        return cudaGetLastError();
      }));
  return cudaSuccess;
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
  NVFP4_DISPATCH_INPUT_TYPE(args.type, T, return with_lookup<T>(args, [&](auto lookup) {
    constexpr bool kLookup = decltype(lookup)::value;
    return swiglu ? launch_amaxes<T, true, kLookup>(args, amax_rowwise, row_scaled, amax_rht, rht_random_sign, stream)
                  : launch_amaxes<T, false, kLookup>(args, amax_rowwise, row_scaled, amax_rht, rht_random_sign, stream);
  }));
  return cudaSuccess;
}

cudaError_t launch_activation_cast(const ActivationArgs& args, const ProducerCastArgs& cast, cudaStream_t stream) {
  if (!valid(args) || cast.rows != args.rows || cast.cols != args.cols) return cudaErrorInvalidValue;
  const bool swiglu = args.activation == Activation::kSwiglu;
  NVFP4_DISPATCH_INPUT_TYPE(args.type, T, return with_lookup<T>(args, [&](auto lookup) {
    constexpr bool kLookup = decltype(lookup)::value;
    return swiglu ? launch_activation_cast_of<T, true, kLookup>(args, cast, stream)
                  : launch_activation_cast_of<T, false, kLookup>(args, cast, stream);
  }));
  return cudaSuccess;
}

int activation_table_bytes(Activation activation) {
  return activation == Activation::kSwiglu ? kSiluTableBytes : kGeluTableBytes;
}

cudaError_t launch_activation_table(Activation activation, void* table, cudaStream_t stream) {
  if (table == nullptr || reinterpret_cast<uintptr_t>(table) % kActivationTableAlignment != 0) return cudaErrorInvalidValue;
  const bool swiglu = activation == Activation::kSwiglu;
  const int slots = swiglu ? kSiluTableBytes / 4 : kGeluWindow;
  activation_table_kernel<<<(slots + kThreads - 1) / kThreads, kThreads, 0, stream>>>(swiglu, table);
  return cudaGetLastError();
}

}  // namespace nvfp4
