// The 4over6 cast (docs/numerics.md §12): each 1x16 (or 16x16) block is encoded with its max mapped to 4 and to 6,
// and the candidate with the smaller error (MAE or MSE, exact or fast-math) is written, with its E4M3 scale; the
// global scale uses the bound B (256 or 448). Both copies come from one 64 x 64 tile of x in shared memory:
// the rowwise copy from its rows, the columnwise copy (of x^T) from its columns. A 16x16 block's error sums its 16
// rows' (or, for the columnwise copy, its 16 columns') errors as a tree of warp shuffles, in the order of
// docs/numerics.md §12.5, so each copy makes its own choice, as the reference quantizes x^T on its own.
// Row-scaled (docs/numerics.md §6): the rowwise copy with one amax per row. No RHT and no stochastic rounding.
// The per-element numerics are csrc/nvfp4_numerics.cuh's four_over_six_* functions (host-tested against the reference):
// blocks of 16-bit values that neither saturate nor underflow (nearly all) take their common case, the error on |x|
// with packed FP16 products and no IEEE division; every other block the general one. The cast is bound by arithmetic
// (two candidates per block and copy), not by memory; its outputs are staged per tile in shared memory and leave in
// whole lines (StagedCopy), which spares L2 the four partial writes per line that direct stores made.
#include <algorithm>
#include <cstdint>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kTile = 64;                 // a tile: 64 x 64 elements of x
constexpr int kThreads = 256;
constexpr int kBlocksPerTileRow = kTile / kBlockSize;
static_assert(kThreads == kTile * kBlocksPerTileRow, "one rowwise and one columnwise block per thread");
// Consecutive tiles (row-major over the tiles of x) per CTA: the per-CTA setup (global scales, byte tables) is paid
// once for them, and each tile's copy into shared memory overlaps the previous tile's encoding. Up to this many, as
// long as the grid keeps kMinWaves waves of the CTAs the multiprocessors hold at once (resident_ctas).
constexpr int kMaxTilesPerCta = 8;
// CTAs each multiprocessor holds at once, at most: __launch_bounds__ caps the registers at 80 a thread to fit them.
// Unbounded (about 100 a thread) only 2 fit, too few warps to keep the schedulers issuing in this arithmetic-bound
// loop. Shared memory may allow fewer (resident_ctas).
constexpr int kCtasPerMultiprocessor = 3;
constexpr int kMinWaves = 4;

// A tile of x as it is in memory (T), in shared memory, each row padded by 16 bytes: the rowwise reads (16-byte
// loads, a quarter warp on 8 consecutive rows) and the columnwise ones (a warp on 32 consecutive columns of a row)
// are free of bank conflicts.
template <typename T>
struct RawTile {
  static constexpr int kChunkElements = 16 / sizeof(T);
  static constexpr int kChunksPerRow = kTile / kChunkElements;
  static constexpr int kChunksPerThread = kTile * kChunksPerRow / kThreads;
  static constexpr int kRowBytes = kTile * sizeof(T) + 16;
  static constexpr int kBytes = kTile * kRowBytes;

  // The tile at (m0, k0) copied asynchronously (cp.async, 16-byte chunks, zeros outside x: cols % 16 == 0, so a
  // chunk lies wholly inside or outside), one commit group.
  __device__ static void copy_async(uint8_t* tile, const QuantizeArgs& args, int64_t m0, int64_t k0, int tid) {
    const T* x = static_cast<const T*>(args.x);
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
#pragma unroll
    for (int u = 0; u < kChunksPerThread; ++u) {
      const int q = tid + u * kThreads, row = q / kChunksPerRow, chunk = q % kChunksPerRow;
      const int64_t m = m0 + row, k = k0 + chunk * kChunkElements;
      const bool inside = m < args.rows && k < args.cols;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(base + row * kRowBytes + chunk * 16),
                   "l"(inside ? x + m * args.cols + k : x), "r"(inside ? 16 : 0) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }

  // Elements [16 b, 16 b + 16) of row r, as FP32.
  __device__ static void read_row_block(const uint8_t* tile, int row, int block, float (&values)[kBlockSize]) {
#pragma unroll
    for (int q = 0; q < kBlockSize / kChunkElements; ++q) {
      float part[kChunkElements];
      unpack_vector<T>(*reinterpret_cast<const uint4*>(tile + row * kRowBytes + (block * kBlockSize + q * kChunkElements) * sizeof(T)), part);
#pragma unroll
      for (int e = 0; e < kChunkElements; ++e) values[q * kChunkElements + e] = part[e];
    }
  }

  // Rows [16 b, 16 b + 16) of column c, as FP32.
  __device__ static void read_column_block(const uint8_t* tile, int column, int block, float (&values)[kBlockSize]) {
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) {
      values[i] = to_float(*reinterpret_cast<const T*>(tile + (block * kBlockSize + i) * kRowBytes + column * sizeof(T)));
    }
  }
};

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
// scale into `codes` and `scale`. Every lane of the warp takes part (the 16x16 sums shuffle).
// byte_of: four_over_six_byte of a scale byte under global (a shared-memory table, or FourOverSixBytes).
// The exact error mode estimates the errors first (four_over_six_candidates' kEstimate: one FMA a value instead of a
// product and a division) and takes the exact ones only where the estimates do not settle the choice (near ties:
// rare), for a 16x16 tile where any tile of the warp asks (the shuffles need every lane).
template <typename T, bool k2D, bool kMSE, bool kFastMath, typename ByteOf>
__device__ __forceinline__ void encode_4over6_block(const float (&values)[kBlockSize], const FourOverSixScale& global,
                                                    const ByteOf& byte_of, uint2& codes, uint8_t& scale) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) amax = fmaxf(amax, fabsf(values[i]));
  if constexpr (k2D) amax = max_across_16_lanes(amax);
  constexpr bool kEstimate = !kFastMath;
  FourOverSixCandidates c = four_over_six_candidates<kMSE, kFastMath, sizeof(T) == 2, kEstimate>(values, amax, global,
                                                                                               byte_of);
  float error4 = c.error[0], error6 = c.error[1];
  if constexpr (k2D) {
    error4 = tile_error_across_16_lanes(error4);
    error6 = tile_error_across_16_lanes(error6);
  }
  if constexpr (kEstimate) {
    const bool settled = four_over_six_settled(error4, error6, four_over_six_error_slack<kMSE, k2D>(amax, error4),
                                               four_over_six_error_slack<kMSE, k2D>(amax, error6));
    if (k2D ? __any_sync(0xFFFFFFFFu, !settled) : !settled) {
      c = four_over_six_candidates<kMSE, false, sizeof(T) == 2>(values, amax, global, byte_of);
      error4 = c.error[0];
      error6 = c.error[1];
      if constexpr (k2D) {
        error4 = tile_error_across_16_lanes(error4);
        error6 = tile_error_across_16_lanes(error6);
      }
    }
  }
  const bool map_to_4 = four_over_six_choice(error4, error6) == 0;
  codes = map_to_4 ? c.packed[0] : c.packed[1];
  scale = static_cast<uint8_t>(map_to_4 ? c.scale[0] : c.scale[1]);
}

// One tile's codes and scales of one copy, staged in shared memory so that each row of the rowwise copy (each
// column, for the columnwise one) leaves in whole 16-byte stores (8-byte ones where alignment or the tensor's edge
// asks) instead of four 8-byte pieces from four warps: line [i] is tile row (or column) i, its 4 blocks in order.
struct StagedCopy {
  uint2 codes[kTile][kBlocksPerTileRow];
  uint8_t scales[kTile][kBlocksPerTileRow];
};

// Line `line` (tile row or column) of a staged copy written out by two threads (half 0, 1: blocks 2 half, 2 half + 1)
// for its codes, and by the first of them for its scales. data / scale: the line's first block in the copy;
// blocks: the line's blocks inside the tensor (0..4); wide_codes, wide_scales: those addresses are 16- and 4-byte
// aligned.
__device__ __forceinline__ void write_staged_line(const StagedCopy& staged, int line, int half, int blocks,
                                                  uint8_t* data, uint8_t* scale, bool wide_codes, bool wide_scales) {
  const int first = 2 * half;
  if (wide_codes && first + 1 < blocks) {
    const uint2 low = staged.codes[line][first], high = staged.codes[line][first + 1];
    *reinterpret_cast<uint4*>(data + first * 8) = make_uint4(low.x, low.y, high.x, high.y);
  } else {
#pragma unroll
    for (int j = first; j < first + 2; ++j) {
      if (j < blocks) *reinterpret_cast<uint2*>(data + j * 8) = staged.codes[line][j];
    }
  }
  if (half != 0) return;
  if (wide_scales && blocks == kBlocksPerTileRow) {
    *reinterpret_cast<uint32_t*>(scale) = *reinterpret_cast<const uint32_t*>(staged.scales[line]);
  } else {
    for (int j = 0; j < blocks; ++j) scale[j] = staged.scales[line][j];
  }
}

__device__ __forceinline__ bool aligned(const uint8_t* address, int bytes) {
  return reinterpret_cast<uintptr_t>(address) % bytes == 0;
}

// Line `line` of one copy's staged tile written out (write_staged_line): the copy's row first_line + line of
// `lines` rows, each `length` elements long (codes at data, scales at scale), from element `start` (the tile's).
__device__ __forceinline__ void write_staged_copy_line(const StagedCopy& staged, int line, int half, int64_t first_line,
                                                       int64_t lines, int64_t length, int64_t start, uint8_t* data,
                                                       uint8_t* scale) {
  const int64_t row = first_line + line;
  if (data == nullptr || row >= lines) return;
  const int64_t left = (length - start) / kBlockSize;
  write_staged_line(staged, line, half, left < kBlocksPerTileRow ? static_cast<int>(left) : kBlocksPerTileRow,
                    data + row * (length / 2) + start / 2, scale + row * (length / kBlockSize) + start / kBlockSize,
                    length % 32 == 0 && aligned(data, 16), length % 64 == 0 && aligned(scale, 4));
}

// A tile's staged copies written out: threads 0..127 the rowwise lines (two a row), 128..255 the columnwise ones
// (rows of x^T).
__device__ __forceinline__ void write_staged_tile(const StagedCopy (&staged)[2], const QuantizeArgs& args, int64_t m0,
                                                  int64_t k0, int tid) {
  const int line = (tid % 128) / 2, half = tid % 2;
  if (tid < 128) {
    write_staged_copy_line(staged[0], line, half, m0, args.rows, args.cols, k0, args.rowwise_data, args.rowwise_scale);
  } else {
    write_staged_copy_line(staged[1], line, half, k0, args.cols, args.rows, m0, args.columnwise_data,
                           args.columnwise_scale);
  }
}

// four_over_six_byte of each scale byte a non-negative block amax gives (0x00..0x7F) under one tensor scale, in
// shared memory: the bytes' values (the same for every tensor) and their common-case e_b.
struct ByteTable {
  const float* value;
  const float* common_encode;
  __device__ FourOverSixByte operator()(uint32_t scale) const {
    return FourOverSixByte{value[scale], common_encode[scale]};
  }
};
constexpr int kPositiveScales = 128;
static_assert(kThreads == 2 * kPositiveScales, "one thread per scale byte of each copy fills the byte tables");

// The origin (m0, k0) of a tile of x and of the tiles after it in row-major order, stepped without a division.
struct TileCursor {
  int64_t m0, k0;
  __device__ TileCursor(int64_t tile, int64_t column_tiles)
      : m0(tile / column_tiles * kTile), k0(tile % column_tiles * kTile) {}
  __device__ TileCursor next(int64_t cols) const {
    TileCursor after = *this;
    after.k0 += kTile;
    if (after.k0 >= cols) {
      after.k0 = 0;
      after.m0 += kTile;
    }
    return after;
  }
};

// Each CTA encodes up to tiles_per_cta consecutive 64 x 64 tiles, two tile buffers in shared memory: the next tile's
// copy is in flight while one is encoded. Thread t encodes the rowwise block (row t % 64, 16-column block t / 64) and
// the columnwise block (column t % 64, 16-row block t / 64) of each: lanes 16j .. 16j + 15 hold the 16 rows (or
// columns) of one 16x16 block.
template <typename T, bool k2D, bool kMSE, bool kFastMath>
__global__ void __launch_bounds__(kThreads, kCtasPerMultiprocessor)
    quantize_4over6_kernel(const QuantizeArgs args, int64_t column_tiles, int64_t tiles, int tiles_per_cta) {
  using Tile = RawTile<T>;
  __shared__ __align__(128) uint8_t tile_buffers[2][Tile::kBytes];
  __shared__ float byte_value[kPositiveScales];
  __shared__ float common_encode[2][kPositiveScales];  // rowwise (tensor-scaled), columnwise
  // per tile buffer: its rowwise and columnwise outputs, written out at the start of the next tile (or at the end)
  __shared__ __align__(16) StagedCopy staged[2][2];
  const int tid = threadIdx.x;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * tiles_per_cta;
  const int64_t end_tile = first_tile + tiles_per_cta < tiles ? first_tile + tiles_per_cta : tiles;
  TileCursor cursor(first_tile, column_tiles);
  Tile::copy_async(tile_buffers[0], args, cursor.m0, cursor.k0, tid);
  const float bound = static_cast<float>(args.e4m3_bound);
  const bool rowwise_tensor_scaled = args.rowwise_data != nullptr && !args.row_scaled;
  const FourOverSixScale rowwise_global = four_over_six_scale(rowwise_tensor_scaled ? args.amax_rowwise[0] : 1.0f, bound);
  const FourOverSixScale columnwise_global =
      four_over_six_scale(args.columnwise_data != nullptr ? args.amax_columnwise[0] : 1.0f, bound);
  {
    const int copy = tid / kPositiveScales, byte = tid % kPositiveScales;
    const FourOverSixByte entry = copy == 0 ? four_over_six_byte<kFastMath>(byte, rowwise_global)  // warp-uniform
                                            : four_over_six_byte<kFastMath>(byte, columnwise_global);
    common_encode[copy][byte] = entry.common_encode;
    if (copy == 0) byte_value[byte] = entry.value;
  }
  const int lane_index = tid % kTile, block = tid / kTile;
  int64_t staged_m0 = -1, staged_k0 = 0;  // the origin of the tile staged in the other buffer (-1: none)

#pragma unroll 1
  for (int64_t tile_index = first_tile, buffer = 0; tile_index < end_tile; ++tile_index, buffer ^= 1) {
    const int64_t m0 = cursor.m0, k0 = cursor.k0;
    cursor = cursor.next(args.cols);
    if (tile_index + 1 < end_tile) {  // the other buffer's readers passed the barrier at the end of the last tile
      Tile::copy_async(tile_buffers[buffer ^ 1], args, cursor.m0, cursor.k0, tid);
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();  // every thread's copies of this tile (and, once, the byte tables) are in
    const uint8_t* const tile = tile_buffers[buffer];
    if (staged_m0 >= 0) write_staged_tile(staged[buffer ^ 1], args, staged_m0, staged_k0, tid);  // the last tile's

    StagedCopy (&out)[2] = staged[buffer];
    if (args.rowwise_data != nullptr) {
      const int64_t m = m0 + lane_index;
      float values[kBlockSize];
      Tile::read_row_block(tile, lane_index, block, values);
      uint2& codes = out[0].codes[lane_index][block];
      uint8_t& scale = out[0].scales[lane_index][block];
      if (args.row_scaled) {  // 1D blocks only: S_enc per row
        const FourOverSixScale global = four_over_six_scale(m < args.rows ? args.amax_rowwise[m] : 0.0f, bound);
        encode_4over6_block<T, false, kMSE, kFastMath>(values, global, FourOverSixBytes<kFastMath>{global}, codes,
                                                       scale);
      } else {
        encode_4over6_block<T, k2D, kMSE, kFastMath>(values, rowwise_global, ByteTable{byte_value, common_encode[0]},
                                                     codes, scale);
      }
    }
    if (args.columnwise_data != nullptr) {  // rows % 16 == 0
      float values[kBlockSize];
      Tile::read_column_block(tile, lane_index, block, values);
      encode_4over6_block<T, k2D, kMSE, kFastMath>(values, columnwise_global, ByteTable{byte_value, common_encode[1]},
                                                   out[1].codes[lane_index][block], out[1].scales[lane_index][block]);
    }
    staged_m0 = m0;
    staged_k0 = k0;
    // this buffer's readers are done before the copy two tiles on, and this tile's staged outputs are in
    __syncthreads();
  }
  write_staged_tile(staged[(end_tile - first_tile - 1) % 2], args, staged_m0, staged_k0, tid);
}

// CTAs of quantize_4over6_kernel<T, k2D, kMSE, kFastMath> that one multiprocessor holds at once: at most
// kCtasPerMultiprocessor (its register bound), fewer where shared memory allows fewer (FP32 tiles on 100 KB parts).
template <typename T, bool k2D, bool kMSE, bool kFastMath>
int resident_ctas() {
  static const int resident =
      std::clamp(ctas_per_multiprocessor(quantize_4over6_kernel<T, k2D, kMSE, kFastMath>, kThreads, 0,
                                         kCtasPerMultiprocessor),
                 1, kCtasPerMultiprocessor);
  return resident;
}

template <typename T, bool k2D, bool kMSE, bool kFastMath>
cudaError_t launch_with_error(const QuantizeArgs& args, cudaStream_t stream) {
  const int64_t column_tiles = (args.cols + kTile - 1) / kTile;
  const int64_t tiles = (args.rows + kTile - 1) / kTile * column_tiles;
  if (tiles == 0) return cudaSuccess;
  if (tiles > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t resident = static_cast<int64_t>(device_multiprocessors()) * resident_ctas<T, k2D, kMSE, kFastMath>();
  const int tiles_per_cta = static_cast<int>(std::clamp<int64_t>(tiles / (resident * kMinWaves), 1, kMaxTilesPerCta));
  const dim3 grid(static_cast<unsigned int>((tiles + tiles_per_cta - 1) / tiles_per_cta));
  quantize_4over6_kernel<T, k2D, kMSE, kFastMath><<<grid, kThreads, 0, stream>>>(args, column_tiles, tiles,
                                                                                 tiles_per_cta);
  return cudaGetLastError();
}

template <typename T, bool k2D, bool kMSE>
cudaError_t launch_with_error(const QuantizeArgs& args, cudaStream_t stream) {
  return args.four_over_six_fast_math ? launch_with_error<T, k2D, kMSE, true>(args, stream)
                                      : launch_with_error<T, k2D, kMSE, false>(args, stream);
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
