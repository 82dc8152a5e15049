// The NVFP4 cast of a produced tensor (a norm's or an activation's output, docs/numerics.md §2-6) straight from the
// producer's input, the produced values rounded to BF16 in shared memory (never in global memory); the same bytes
// as nvfp4_dist.ops.quantize of the BF16 output.
// - norms and GELU of 16-bit inputs: quantize_tile.cuh's tile cast (the unfused cast's kernel, csrc/quantize.cu)
//   copies the input's 128 x 128 tile and a TileProducer forms the produced tile from it in place
//   (launch_produced_tile_cast).
// - SwiGLU and FP32 inputs: one pass over a 64 x 128 tile (the tiles in TileOrder's bands) forms the produced values
//   in registers and writes the rowwise copy and the columnwise copy (after the RHT when on) with their E4M3 scales
//   (launch_produce_and_cast). A Producer gives, for one tile:
//     struct Tile;                                                           // its staged data, in shared memory
//     static constexpr int kSourceBytes;                                     // see copy_source; 0: none
//     void prepare(Tile&, int tid) const;                                    // once per CTA, before its tiles
//     void stage(Tile&, int64_t m0, int64_t k0, int rows_in_tile, int cols_in_tile, int tid) const;
//     void copy_source(uint8_t* slot, int64_t m0, int64_t k0, int rows_in_tile, int cols_in_tile, int tid) const;
//     void produce8(const Tile&, const uint8_t* slot, int64_t m0, int64_t k0, int r, int c, float (&out)[8]) const;
//   produce8: the FP32 values (before the rounding to BF16) of row m0 + r, columns k0 + c .. k0 + c + 7, for the
//   vectors (r, c / 8) = CastVector(tid, u) of thread tid. copy_source (kSourceBytes > 0): cp.async of the input
//   those vectors of thread tid need into `slot` (kSourceBytes of shared memory), which produce8 then reads: the
//   kernel copies the CTA's next tile's input while it casts the current one (two slots).
// The element numerics are csrc/nvfp4_numerics.cuh's in both.
#pragma once

#include <algorithm>
#include <cstdint>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"
#include "producer_numerics.cuh"
#include "quantize_tile.cuh"

namespace nvfp4 {
namespace producer {

// Whether a cast of `cast`'s copies is well formed: cols % 16 == 0, rows % 16 == 0 for a columnwise copy, no
// columnwise copy of row-scaled amaxes (docs/numerics.md §6).
inline bool valid_cast(const ProducerCastArgs& cast) {
  const bool columnwise = cast.columnwise_data != nullptr;
  return cast.cols % kBlockSize == 0 && !(columnwise && cast.rows % kBlockSize != 0) && !(cast.row_scaled && columnwise);
}

constexpr int kCastThreads = 256;
constexpr int kCastTileRows = 64, kCastTileCols = 128;
constexpr int kCastRowBytes = kCastTileCols * 2;        // the tile holds BF16
constexpr int kCastChunksPerRow = kCastRowBytes / 16;   // 16-byte chunks of 8 values
constexpr int kCastVectorsPerThread = kCastTileRows * kCastChunksPerRow / kCastThreads;
constexpr int kCastRowBlocks = kCastTileRows / kBlockSize;
constexpr int kCastRowwiseRowStep = kCastThreads / (kCastTileCols / kBlockSize);  // 8 threads per tile row
constexpr int kCastRowwiseItemsPerThread = kCastTileRows / kCastRowwiseRowStep;
constexpr int kEncodeTablesBytes = 2 * tile_cast::kPositiveScales * sizeof(float);  // e_b per scale byte, both copies
static_assert(kCastThreads / 32 * 8 * 2 == kCastTileCols, "columnwise items: a warp takes 8 column pairs x 4 row blocks");
static_assert(kCastRowBlocks == 4, "columnwise items: 4 row blocks per tile");

// Vector u of thread tid in a tile (8 columns of one row): (row, 16-byte chunk of the row), a warp's 32 vectors
// consecutive chunks of two rows.
struct CastVector {
  int row, chunk;
  __device__ CastVector(int tid, int u)
      : row((tid + u * kCastThreads) / kCastChunksPerRow), chunk((tid + u * kCastThreads) % kCastChunksPerRow) {}
  __device__ static int index_of(int row, int chunk) { return row * kCastChunksPerRow + chunk; }
  __device__ int index() const { return index_of(row, chunk); }
};

__device__ __forceinline__ void cp_async_16(uint8_t* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global) : "memory");
}

// Shared-memory position of 16-byte chunk `chunk` of tile row `row`: the chunk index XOR-swizzled by
// (row mod 8) ^ 2 * (the row's 16-row block mod 4). Free of bank conflicts for the tile's stores (a warp stores 2
// rows x 16 chunks), the rowwise reads (4 rows x 8 blocks per warp) and the columnwise reads (a warp reads row i
// of 4 row blocks, 8 column pairs each: 8 distinct chunk positions mod 8).
__device__ __forceinline__ int tile_chunk_offset(int row, int chunk) {
  const int key = (row & 7) ^ (((row >> 4) & 3) << 1);
  return row * kCastRowBytes + ((chunk ^ key) << 4);
}

// e_b (encode_block's factor) of scale byte `scale` under the tensor scale s_enc.
__device__ __forceinline__ float encode_of_scale_byte(uint32_t scale, float s_enc) {
  return encode_block_factor<false>(block_encode_factor(static_cast<uint8_t>(scale), decode_scale(s_enc)));
}

// Packed codes of one 16-value block (BF16 numbers as FP32) with the scale for `s_enc` (docs/numerics.md §2.3-2.5),
// round to nearest: e_b computed (row-scaled copies), or looked up in `encode_of_scale` (0x00..0x7F, for s_enc).
__device__ __forceinline__ uint2 encode_bf16_block(const float (&values)[kBlockSize], float block_amax, float s_enc,
                                                   uint32_t& scale) {
  scale = block_scale_e4m3_of_nonnegative(block_amax, s_enc * kOneSixth);
  return encode_block<false, true>(values, encode_of_scale_byte(scale, s_enc), block_amax, StochasticRoundingKeys{},
                                   true, PhiloxGroupPrefix{}, 0u, 0u, 0u);
}
__device__ __forceinline__ uint2 encode_bf16_block(const float (&values)[kBlockSize], float block_amax, float s_enc,
                                                   const float* encode_of_scale, uint32_t& scale) {
  scale = block_scale_e4m3_of_nonnegative(block_amax, s_enc * kOneSixth);
  return encode_block<false, true>(values, encode_of_scale[scale], block_amax, StochasticRoundingKeys{}, true,
                                   PhiloxGroupPrefix{}, 0u, 0u, 0u);
}

__device__ __forceinline__ float bf16_amax(const float (&values)[kBlockSize]) {
  uint32_t running = 0u;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) running = max(running, abs_bits(values[i]));
  return __uint_as_float(running);
}

// A grid-stride loop over the tiles in `order`; kRHT: the columnwise copy of x^T . H (docs/numerics.md §5).
template <typename Producer, bool kRHT, bool kRandomSign>
__global__ void __launch_bounds__(kCastThreads) produce_and_cast_kernel(const Producer producer, const ProducerCastArgs args,
                                                                        const TileOrder order) {
  __shared__ __align__(128) uint8_t tile[kCastTileRows * kCastRowBytes];
  __shared__ typename Producer::Tile staged;
  // the launch's dynamic bytes (dynamic_shared_bytes): the e_b tables, then (kSourceBytes > 0) two source slots
  extern __shared__ __align__(128) uint8_t dynamic_shared[];
  float(*const encode_of_scale)[tile_cast::kPositiveScales] =
      reinterpret_cast<float(*)[tile_cast::kPositiveScales]>(dynamic_shared);
  uint8_t* const source_slots = dynamic_shared + kEncodeTablesBytes;
  constexpr int kSourceBytes = Producer::kSourceBytes;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t tiles = (args.rows + kCastTileRows - 1) / kCastTileRows * ((args.cols + kCastTileCols - 1) / kCastTileCols);
  struct Extent {
    int64_t m0, k0;
    int rows_in_tile, cols_in_tile;
  };
  const auto extent_of = [&](int64_t tile_index) {
    const int2 row_and_column = order.row_and_column(static_cast<int>(tile_index));
    const int64_t m0 = int64_t{row_and_column.x} * kCastTileRows, k0 = int64_t{row_and_column.y} * kCastTileCols;
    return Extent{m0, k0, args.rows - m0 < kCastTileRows ? static_cast<int>(args.rows - m0) : kCastTileRows,
                  args.cols - k0 < kCastTileCols ? static_cast<int>(args.cols - k0) : kCastTileCols};
  };
  const auto copy_source_of = [&](int64_t tile_index, uint8_t* slot) {  // one cp.async group, empty past the end
    if (tile_index < tiles) {
      const Extent next = extent_of(tile_index);
      producer.copy_source(slot, next.m0, next.k0, next.rows_in_tile, next.cols_in_tile, tid);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  if constexpr (kSourceBytes > 0) copy_source_of(blockIdx.x, source_slots);
  producer.prepare(staged, tid);
  // the codes leave L2 first (streaming stores of whole sectors); the scale bytes stay (l2_keep_policy) until the
  // tiles after complete their sectors, sparing DRAM the read-modify-writes of partial sectors
  const uint64_t keep_in_l2 = l2_keep_policy();
  // the tensor scales, and e_b of each scale byte under them (rowwise and columnwise), once per CTA: the first
  // tile's barrier publishes the tables
  const bool rowwise_tensor_scaled = args.rowwise_data != nullptr && !args.row_scaled;
  const float rowwise_s_enc = rowwise_tensor_scaled ? encode_scale(args.amax_rowwise[0]) : 0.0f;
  const float columnwise_s_enc = args.columnwise_data != nullptr ? encode_scale(args.amax_columnwise[0]) : 0.0f;
  static_assert(kCastThreads == 2 * tile_cast::kPositiveScales, "a thread per scale byte of each copy");
  {
    const int copy = tid / tile_cast::kPositiveScales;
    encode_of_scale[copy][tid % tile_cast::kPositiveScales] =
        encode_of_scale_byte(tid % tile_cast::kPositiveScales, copy == 0 ? rowwise_s_enc : columnwise_s_enc);
  }
  // no barrier at the end of an iteration: the next one's writes to staged and tile follow barriers that every
  // thread reaches only after its reads of this one (and a thread reads only the source it copied itself)
  for (int64_t tile_index = blockIdx.x, slot = 0; tile_index < tiles; tile_index += gridDim.x, slot ^= 1) {
    const auto [m0, k0, rows_in_tile, cols_in_tile] = extent_of(tile_index);
    producer.stage(staged, m0, k0, rows_in_tile, cols_in_tile, tid);
    const uint8_t* const source = source_slots + slot * kSourceBytes;
    if constexpr (kSourceBytes > 0) {
      copy_source_of(tile_index + gridDim.x, source_slots + (slot ^ 1) * kSourceBytes);  // the next tile's, in flight
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    }
    __syncthreads();

    // 1. The produced tile, rounded to BF16, in shared memory (zeros outside the tensor).
#pragma unroll
    for (int u = 0; u < kCastVectorsPerThread; ++u) {
      const CastVector vector(tid, u);
      const int r = vector.row, chunk = vector.chunk;
      uint4 packed = make_uint4(0u, 0u, 0u, 0u);
      if (r < rows_in_tile && chunk * 8 < cols_in_tile) {
        float values[8];
        producer.produce8(staged, source, m0, k0, r, chunk * 8, values);
        uint32_t words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(values[2 * i], values[2 * i + 1]);
          words[i] = *reinterpret_cast<const uint32_t*>(&pair);
        }
        packed = make_uint4(words[0], words[1], words[2], words[3]);
      }
      *reinterpret_cast<uint4*>(tile + tile_chunk_offset(r, chunk)) = packed;
    }
    __syncthreads();

    // 2. Rowwise copy: item (row, 16-column block); 8 consecutive threads write 64 bytes of a row.
    if (args.rowwise_data != nullptr) {
      const int block = tid & 7;
#pragma unroll
      for (int u = 0; u < kCastRowwiseItemsPerThread; ++u) {
        const int r = (tid >> 3) + u * kCastRowwiseRowStep;
        if (r >= rows_in_tile || block * kBlockSize >= cols_in_tile) continue;
        float values[kBlockSize];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const uint4 raw = *reinterpret_cast<const uint4*>(tile + tile_chunk_offset(r, 2 * block + q));
          float part[8];
          unpack_vector<__nv_bfloat16>(raw, part);
#pragma unroll
          for (int e = 0; e < 8; ++e) values[8 * q + e] = part[e];
        }
        uint32_t scale;
        const uint2 packed =
            rowwise_tensor_scaled
                ? encode_bf16_block(values, bf16_amax(values), rowwise_s_enc, encode_of_scale[0], scale)
                : encode_bf16_block(values, bf16_amax(values), encode_scale(args.amax_rowwise[m0 + r]), scale);
        const int64_t row = m0 + r;
        __stcs(reinterpret_cast<uint2*>(args.rowwise_data + row * (args.cols / 2) + k0 / 2 + block * (kBlockSize / 2)),
               packed);
        store_byte(args.rowwise_scale + row * (args.cols / kBlockSize) + k0 / kBlockSize + block, scale, keep_in_l2);
      }
    }

    // 3. Columnwise copy of x^T (after the RHT when on): lane = (row block lane % 4, column pair lane / 4 of the
    //    warp's 8); a warp writes 32 contiguous bytes (4 row blocks) of each of its 16 columns.
    if (args.columnwise_data != nullptr) {
      const int row_block = lane & 3, pair = warp * 8 + (lane >> 2), column = 2 * pair;
      if (row_block * kBlockSize < rows_in_tile && column < cols_in_tile) {
        float columns[2][kBlockSize];
#pragma unroll
        for (int i = 0; i < kBlockSize; ++i) {
          const int r = row_block * kBlockSize + i;
          const uint32_t word =
              *reinterpret_cast<const uint32_t*>(tile + tile_chunk_offset(r, pair >> 2) + (pair & 3) * 4);
          const float2 both = bf16_pair_to_float2(word);
          columns[0][i] = both.x;
          columns[1][i] = both.y;
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if constexpr (kRHT) {
            float transformed[kBlockSize];  // odd elements negated
            rht_chunk_odd_negated<kRandomSign>(columns[j], transformed);
#pragma unroll
            for (int i = 0; i < kBlockSize; ++i) {
              const float rounded = rounded_to_bf16(transformed[i]);
              columns[j][i] = (i & 1) ? -rounded : rounded;
            }
          }
          uint32_t scale;
          const uint2 packed =
              encode_bf16_block(columns[j], bf16_amax(columns[j]), columnwise_s_enc, encode_of_scale[1], scale);
          const int64_t col = k0 + column + j;
          __stcs(reinterpret_cast<uint2*>(args.columnwise_data + col * (args.rows / 2) + m0 / 2 +
                                          row_block * (kBlockSize / 2)),
                 packed);
          store_byte(args.columnwise_scale + col * (args.rows / kBlockSize) + m0 / kBlockSize + row_block, scale,
                     keep_in_l2);
        }
      }
    }
  }
}

// The dynamic shared memory of produce_and_cast_kernel<Producer, ...>: its e_b tables and two source slots.
template <typename Producer>
constexpr int dynamic_shared_bytes() { return kEncodeTablesBytes + 2 * Producer::kSourceBytes; }

// The kernel allowed its dynamic shared memory (over 48 KiB with its static arrays), on the current device.
template <typename Producer, bool kRHT, bool kRandomSign>
cudaError_t allow_dynamic_shared() {
  return cudaFuncSetAttribute(produce_and_cast_kernel<Producer, kRHT, kRandomSign>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_shared_bytes<Producer>());
}

// CTAs of produce_and_cast_kernel<Producer, kRHT, kRandomSign> for `tiles` tiles: as many as fit on the device at
// once (its dynamic shared memory allowed), at most one per tile.
template <typename Producer, bool kRHT, bool kRandomSign>
unsigned produce_and_cast_grid(int64_t tiles) {
  static const int resident = std::max(1, ctas_per_multiprocessor(produce_and_cast_kernel<Producer, kRHT, kRandomSign>,
                                                                   kCastThreads, dynamic_shared_bytes<Producer>(), 1));
  const int64_t ctas = static_cast<int64_t>(device_multiprocessors()) * resident;
  return static_cast<unsigned>(tiles < ctas ? tiles : ctas);
}

// Tiles in bands of 16 tile rows, column-major within a band (TileOrder): the tiles in flight write whole 32-byte
// sectors of each column's columnwise scales and 512 contiguous bytes of its codes. Row-major tiles of a wide output
// wrote 4 bytes of every column's scales at a time, and took longer per tile the more rows the output had.
template <typename Producer>
cudaError_t launch_produce_and_cast(const Producer& producer, const ProducerCastArgs& args, cudaStream_t stream) {
  if (!valid_cast(args)) return cudaErrorInvalidValue;
  const bool columnwise = args.columnwise_data != nullptr;
  const int64_t tile_rows = (args.rows + kCastTileRows - 1) / kCastTileRows;
  const int64_t column_tiles = (args.cols + kCastTileCols - 1) / kCastTileCols;
  const int64_t tiles = tile_rows * column_tiles;
  if (tiles == 0) return cudaSuccess;
  if (tiles > INT32_MAX) return cudaErrorInvalidValue;
  const TileOrder order(tile_rows, column_tiles, 4);
  const cudaError_t allowed = args.rht && columnwise
                                  ? (args.rht_random_sign ? allow_dynamic_shared<Producer, true, true>()
                                                          : allow_dynamic_shared<Producer, true, false>())
                                  : allow_dynamic_shared<Producer, false, false>();
  if (allowed != cudaSuccess) return allowed;
  if (args.rht && columnwise) {
    if (args.rht_random_sign) {
      produce_and_cast_kernel<Producer, true, true>
          <<<produce_and_cast_grid<Producer, true, true>(tiles), kCastThreads, dynamic_shared_bytes<Producer>(), stream>>>(producer, args, order);
    } else {
      produce_and_cast_kernel<Producer, true, false>
          <<<produce_and_cast_grid<Producer, true, false>(tiles), kCastThreads, dynamic_shared_bytes<Producer>(), stream>>>(producer, args, order);
    }
  } else {
    produce_and_cast_kernel<Producer, false, false>
        <<<produce_and_cast_grid<Producer, false, false>(tiles), kCastThreads, dynamic_shared_bytes<Producer>(), stream>>>(producer, args, order);
  }
  return cudaGetLastError();
}

// The tile cast of the BF16 tile `producer` makes from the 16-bit tensor at `source` (its rows
// producer.row_stride(cols) elements apart).
template <typename TileProducer>
cudaError_t launch_produced_tile_cast(const void* source, const TileProducer& producer, const ProducerCastArgs& cast,
                                      cudaStream_t stream) {
  if (!valid_cast(cast)) return cudaErrorInvalidValue;
  QuantizeArgs args{};
  args.x = source;
  args.type = InputType::kBFloat16;
  args.rows = cast.rows;
  args.cols = cast.cols;
  args.amax_rowwise = cast.rowwise_data != nullptr ? cast.amax_rowwise : nullptr;
  args.amax_columnwise = cast.columnwise_data != nullptr ? cast.amax_columnwise : nullptr;
  args.rowwise_data = cast.rowwise_data;
  args.rowwise_scale = cast.rowwise_scale;
  args.columnwise_data = cast.columnwise_data;
  args.columnwise_scale = cast.columnwise_scale;
  args.row_scaled = cast.row_scaled;
  args.rht = cast.rht;
  args.rht_random_sign = cast.rht_random_sign;
  args.e4m3_bound = 448;
  using tile_cast::launch_tiles;
  if (cast.rht && cast.columnwise_data != nullptr) {
    return cast.rht_random_sign ? launch_tiles<__nv_bfloat16, false, true, true, false>(args, stream, producer)
                                : launch_tiles<__nv_bfloat16, false, true, false, false>(args, stream, producer);
  }
  return launch_tiles<__nv_bfloat16, false, false, false, false>(args, stream, producer);
}

// The chunks of a 128 x 128 tile (16-bit, TileLayout's layout) a thread forms in a TileProducer's transform: chunk
// (8 columns) tid % 16 of rows tid / 16 + 16 u.
struct TileChunks {
  using Layout = tile_cast::TileLayout<__nv_bfloat16>;
  static constexpr int kRowStep = tile_cast::kThreads / Layout::kChunksPerRow;
  static constexpr int kCount = tile_cast::kTileRows / kRowStep;
  static_assert(Layout::kChunkElements == 8, "8 values a chunk");
};

// 8 FP32 values rounded to BF16, packed.
__device__ __forceinline__ uint4 packed_bf16(const float (&values)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(values[2 * i], values[2 * i + 1]);
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Block-wide halving tree of kCount values per thread (the same tree for each), kThreads threads; every thread gets
// the sums. Thread t = 32 w + l: the levels of stride kThreads / 2 .. 32 pair warps w and w + kWarps / 2 .. w + 1 at
// lane l, so after one barrier each thread reads its lane's value of every warp and adds those levels in registers,
// then levels 16 .. 1 by shuffles (xor: each lane ends with the tree's sum, a + b == b + a). One barrier a call:
// scratch is one of two buffers the caller alternates, so a call's writes cannot overtake the last call's reads
// (every thread read that buffer before the barrier of the call in between).
template <int kThreads, int kCount>
__device__ __forceinline__ void block_halving_sums(float (&values)[kCount], float (*scratch)[kThreads]) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < kCount; ++c) scratch[c][threadIdx.x] = values[c];
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kCount; ++c) {
    float by_warp[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) by_warp[w] = scratch[c][32 * w + lane];
    float v = halving_sum<kWarps>(by_warp);
#pragma unroll
    for (int stride = 16; stride >= 1; stride /= 2) v = v + __shfl_xor_sync(0xFFFFFFFFu, v, stride);
    values[c] = v;
  }
}

}  // namespace producer
}  // namespace nvfp4
