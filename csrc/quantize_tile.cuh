// The NVFP4 tile cast (docs/numerics.md §2-7): one pass over a 128 x 128 tile of the input in shared memory writes
// the rowwise copy and the columnwise (transposed) copy with their E4M3 scales.
// Variants (template flags): 16x16 blocks for weights (docs/numerics.md §4; both copies under one tensor scale share
// their codes, so the columnwise copy is the rowwise codes transposed in shared memory), the RHT of the
// columnwise copy of BF16 inputs (docs/numerics.md §5), stochastic rounding with Philox bits (docs/numerics.md §7). Row-scaled
// amaxes (docs/numerics.md §6: per row of x for the rowwise copy, §6b: per row of x^T for the columnwise copy) and which
// copies to write are run-time arguments. For the RHT and stochastic-rounding casts of
// 16-bit inputs a CTA encodes 2 consecutive tiles (but the first CTAs on each multiprocessor and the last wave,
// one each), the next tile's copy (cp.async, into a second shared-memory buffer) in flight while it encodes the
// current one, and pays the per-CTA setup (the e_b tables) once. FP32 tiles (two would take 128 KiB) and the
// other 16-bit casts, which round to nearest (four CTAs per multiprocessor), run one CTA per tile.
// Consecutive tiles follow TileOrder (tile_order.cuh): row-major, or bands of 16 tile rows for wide x.
//
// A TileProducer makes the cast's input from the tile it copies (the fused producers: a norm's or an activation's
// output cast without being written, csrc/norm_quantize.cu, csrc/activation_quantize.cu):
//   static constexpr bool kTransforms;                  // false: the tile is the input itself (CastOfInput)
//   struct Staged;                                      // what transform needs besides the tile, in shared memory
//   int64_t row_stride(int64_t cols) const;             // elements between rows of args.x, the copied source
//   void stage(Staged&, int64_t m0, int64_t k0, int rows_in_tile, int cols_in_tile, int tid) const;
//   void transform(uint8_t* tile, const Staged&, int64_t m0, int64_t k0, int rows_in_tile, int cols_in_tile,
//                  int tid) const;
// stage runs while the tile's copy is in flight (its loads off the tile's critical path); transform, once the
// tile and the staged data are in: in place, the tile's 16-bit source values (TileLayout<__nv_bfloat16>'s layout)
// replaced by the produced values rounded to BF16, inside the tensor only (the zeros outside stay); the kernel
// then casts a BF16 tile.
#pragma once

#include <cstdint>
#include <type_traits>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"
#include "tile_order.cuh"

namespace nvfp4 {
namespace tile_cast {

// The cast of x itself.
struct CastOfInput {
  static constexpr bool kTransforms = false;
  struct Staged {};
  __device__ int64_t row_stride(int64_t cols) const { return cols; }
  __device__ void stage(Staged&, int64_t, int64_t, int, int, int) const {}
  __device__ void transform(uint8_t*, const Staged&, int64_t, int64_t, int, int, int) const {}
};

constexpr int kTileRows = 128, kTileCols = 128, kThreads = 256;
// CTAs per multiprocessor the registers must allow: FP32 input (85 registers, so 3 tiles overlap load
// and math); 16-bit input with two tiles per CTA (its registers also hold the next tile; shared memory allows
// no more than 3; 4 made the SR casts spill); the other 16-bit casts, one tile per CTA (64 registers, no
// spills; faster for the 1D and 2D casts than 3 CTAs of two tiles, slower for the RHT cast).
constexpr int kMinTilesPerMultiprocessor = 3;
constexpr int kMinTilesPerMultiprocessorPaired = 3;
constexpr int kMinTilesPerMultiprocessorNearest = 4;
constexpr int kRowBlocksPerTile = kTileRows / kBlockSize;   // 16-row blocks of a tile
constexpr int kColBlocksPerTile = kTileCols / kBlockSize;   // 16-column blocks of a tile
constexpr int kRowwiseItemsPerThread = kTileRows * kColBlocksPerTile / kThreads;        // (row, 16-col block)
constexpr int kColumnwiseItemsPerThread = kRowBlocksPerTile * (kTileCols / 2) / kThreads;  // (16-row block, col pair)
constexpr uint32_t kRowwiseStream = 0, kColumnwiseStream = 1;  // Philox counter word 2 of each copy
constexpr int kPositiveScales = 128;  // E4M3 bytes 0x00..0x7F (0x7F, NaN, only from a NaN amax)
static_assert(kThreads == 2 * kPositiveScales, "one thread per scale byte of each copy fills the e_b tables");

// A tile of T in shared memory, row-major, its 16-byte chunks XOR-swizzled by the key
// (row's 16-row block) ^ (row mod P), P = the chunks of a 16-element block (2 for 16-bit T, 4 for FP32).
// Free of bank conflicts: the rowwise reads, where a quarter warp reads P rows x 8/P blocks; the
// columnwise reads, where 8 lanes read row i of the 8 row blocks; the tile's stores, 8 lanes to 8
// consecutive chunks of a row (all with the tile on a 128-byte line). A columnwise item's 16 rows use P
// base addresses (i mod P) and immediate row offsets.
template <typename T>
struct TileLayout {
  static constexpr int kChunkElements = 16 / sizeof(T);
  static constexpr int kChunksPerRow = kTileCols / kChunkElements;
  static constexpr int kChunksPerBlock = kBlockSize / kChunkElements;
  static constexpr int kRowBytes = kTileCols * sizeof(T);
  static constexpr int kBytes = kTileRows * kRowBytes;

  __device__ static int chunk_offset(int row, int chunk) {
    return row * kRowBytes + ((chunk ^ (((row >> 4) ^ (row & (kChunksPerBlock - 1))) & 7)) << 4);
  }

  // The shared address of the chunk `rows` rows below the one at `address`, for a step that keeps row mod P
  // and moves the row's 16-row block by rows / 16 without a carry (a first row below 16, rows a multiple of
  // 16; or below 8 and 8): the key changes by an XOR. With the tile on a 128-byte line the XOR can act on the
  // whole address (one LOP3, the row offset an immediate of the access).
  __device__ static uint32_t address_rows_below(uint32_t address, int rows) {
    return (address ^ (((rows >> 4) & 7) << 4)) + rows * kRowBytes;
  }
};

// The rowwise codes of a tile in shared memory, for 2D casts whose columnwise copy is their transpose:
// row r's 8-byte code words at r * 64, block b's at chunk b ^ (r / 16). The swizzle keeps the rowwise
// stores (4 rows x 8 blocks per warp) and the columnwise 2-byte reads (8 row blocks x 4 column quads
// per warp, each row i in turn) free of bank conflicts.
struct CodeTile {
  static constexpr int kRowBytes = kTileCols / 2;
  __device__ static int block_offset(int row, int block) { return row * kRowBytes + ((block ^ (row >> 4)) & 7) * 8; }
};

// Byte values below 16, a0..a3 in a and b0..b3 in b -> one word of nibbles a0 a1 a2 a3 b0 b1 b2 b3.
__device__ __forceinline__ uint32_t nibbles_of_byte_values(uint32_t a, uint32_t b) {
  return __byte_perm(a | (a >> 4), b | (b >> 4), 0x6420);
}

__device__ __forceinline__ float block_amax(const float (&values)[kBlockSize]) {
  float running = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) running = fmaxf(running, fabsf(values[i]));
  return running;
}

// The 16 values of a block of one tile row whose first chunk is at `first_chunk` (a chunk_offset),
// and their amax (for 16-bit T taken on the packed pairs, one HMNMX2 per pair). Chunk q of the block
// lies at first_chunk ^ (q << 4): the block's chunks differ in the swizzle's low bits only.
template <typename T>
__device__ __forceinline__ void read_row_block(uint32_t first_chunk_address, float (&values)[kBlockSize], float& amax) {
  using Layout = TileLayout<T>;
  constexpr int kParts = Layout::kChunksPerBlock;
  uint4 raw[kParts];
#pragma unroll
  for (int q = 0; q < kParts; ++q) raw[q] = load_shared_16(first_chunk_address ^ (q << 4));
#pragma unroll
  for (int q = 0; q < kParts; ++q) {
    float part[Layout::kChunkElements];
    unpack_vector<T>(raw[q], part);
#pragma unroll
    for (int e = 0; e < Layout::kChunkElements; ++e) values[q * Layout::kChunkElements + e] = part[e];
  }
  if constexpr (sizeof(T) == 4) {
    amax = block_amax(values);
  } else {
    uint32_t running = max_abs_halves<T>(raw[0].x, raw[0].y);
    running = max_abs_halves<T>(running, raw[0].z);
    running = max_abs_halves<T>(running, raw[0].w);
    running = max_abs_halves<T>(running, raw[1].x);
    running = max_abs_halves<T>(running, raw[1].y);
    running = max_abs_halves<T>(running, raw[1].z);
    running = max_abs_halves<T>(running, raw[1].w);
    // both halves the max of the two: one byte swap and one more HMNMX2
    amax = abs_halves_as_float<T>(max_abs_halves<T>(running, __byte_perm(running, 0u, 0x1032))).x;
  }
}

// The rowwise items (tile row, 16-column block) of one thread. A quarter warp takes P consecutive rows
// x 8/P consecutive blocks (P = TileLayout<T>::kChunksPerBlock: conflict-free reads), a warp 4 rows
// x 8 blocks (it writes 64 contiguous bytes of each row), and item u lies 32u rows below item 0. Item
// 0's row is below 32, so the row step moves the swizzle key by 2u, an XOR: the items' shared-memory
// offsets differ by constants.
template <typename T>
struct RowwiseItems {
  static constexpr int kParts = TileLayout<T>::kChunksPerBlock;
  static constexpr int kBlocksPerQuarter = kColBlocksPerTile / kParts;
  static constexpr int kRowStep = 32;
  static_assert(kRowwiseItemsPerThread * kRowStep == kTileRows && kThreads == 256 && (kParts == 2 || kParts == 4),
                "item layout");
  int row, block, first_chunk;  // item 0

  __device__ explicit RowwiseItems(int tid)
      : row((tid >> 5) * 4 + (((tid & 31) >> 3) / kParts) * kParts + (tid & 7) / kBlocksPerQuarter),
        block((((tid & 31) >> 3) % kParts) * kBlocksPerQuarter + (tid & 7) % kBlocksPerQuarter),
        first_chunk(TileLayout<T>::chunk_offset(row, block * kParts)) {}

  // item u's first chunk in a tile at shared address tile_address (128-byte aligned)
  __device__ uint32_t chunk_address(uint32_t tile_address, int u) const {
    return TileLayout<T>::address_rows_below(tile_address + first_chunk, u * kRowStep);
  }
};

// Columns (column, column + 1) of the 16 rows of a row block, their first rows' element pairs at
// base[b] (b < P: rows i and i + P share their swizzle key), and the amax of each (for 16-bit T taken
// on the packed pairs, one HMNMX2 per row).
template <typename T>
__device__ __forceinline__ void read_column_pair(const uint8_t* const (&base)[TileLayout<T>::kChunksPerBlock], int shift,
                                                 float (&first)[kBlockSize], float (&second)[kBlockSize],
                                                 float (&amax)[2]) {
  using Layout = TileLayout<T>;
  constexpr int kBases = Layout::kChunksPerBlock;
  [[maybe_unused]] uint32_t running = 0u;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) {
    const uint8_t* address = base[i % kBases] + shift + (i / kBases) * kBases * Layout::kRowBytes;
    if constexpr (sizeof(T) == 4) {
      const float2 pair = *reinterpret_cast<const float2*>(address);
      first[i] = pair.x;
      second[i] = pair.y;
    } else {
      const uint32_t pair = *reinterpret_cast<const uint32_t*>(address);
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const float2 both = bf16_pair_to_float2(pair);
        first[i] = both.x;
        second[i] = both.y;
      } else {
        const T* halves = reinterpret_cast<const T*>(&pair);
        first[i] = to_float(halves[0]);
        second[i] = to_float(halves[1]);
      }
      running = i == 0 ? pair : max_abs_halves<T>(running, pair);
    }
  }
  if constexpr (sizeof(T) == 4) {
    amax[0] = block_amax(first);
    amax[1] = block_amax(second);
  } else {
    const float2 halves = abs_halves_as_float<T>(running);
    amax[0] = halves.x;
    amax[1] = halves.y;
  }
}

// Where a tile lies in x, and how much of it is inside x.
struct TileOrigin {
  int64_t m0, k0;
  int rows_in_tile, cols_in_tile;

  __device__ TileOrigin(const QuantizeArgs& args, int2 row_and_column)
      : TileOrigin(args, static_cast<int64_t>(row_and_column.x) * kTileRows,
                   static_cast<int64_t>(row_and_column.y) * kTileCols) {}

  __device__ TileOrigin(const QuantizeArgs& args, int64_t first_row, int64_t first_col)
      : m0(first_row),
        k0(first_col),
        rows_in_tile(args.rows - m0 < kTileRows ? static_cast<int>(args.rows - m0) : kTileRows),
        cols_in_tile(args.cols - k0 < kTileCols ? static_cast<int>(args.cols - k0) : kTileCols) {}

  // The next tile in row-major order, without the division.
  __device__ TileOrigin next_row_major(const QuantizeArgs& args) const {
    return k0 + kTileCols < args.cols ? TileOrigin(args, m0, k0 + kTileCols)
                                      : TileOrigin(args, m0 + kTileRows, int64_t{0});
  }

  __device__ bool whole() const { return rows_in_tile == kTileRows && cols_in_tile == kTileCols; }
};

// One thread's share of a tile's copy from global to shared memory (cp.async, 16 bytes each, zeros
// outside x; a whole tile, the common case, without the zero-fill predicates): copy u is chunk
// tid % kChunksPerRow of tile row tid / kChunksPerRow + u * kRowStep.
// Copy u's shared-memory offset differs from copy 0's by u * kRowStep rows, which moves the swizzle key
// by (u * kRowStep) >> 4 (an XOR, the first row < kRowStep <= 16) and leaves row mod P alone.
template <typename T>
__device__ __forceinline__ void copy_tile_async(uint8_t* tile, const QuantizeArgs& args, int64_t row_stride,
                                                const TileOrigin& origin, int tid) {
  using Layout = TileLayout<T>;
  constexpr int kCount = kTileRows * Layout::kChunksPerRow / kThreads;
  constexpr int kRowStep = kThreads / Layout::kChunksPerRow;
  const int row = tid / Layout::kChunksPerRow, chunk = tid % Layout::kChunksPerRow;
  const int64_t element_bytes = sizeof(T);
  const uint8_t* x = static_cast<const uint8_t*>(args.x) +
                     ((origin.m0 + row) * row_stride + origin.k0 + chunk * Layout::kChunkElements) * element_bytes;
  const int64_t stride = kRowStep * row_stride * element_bytes;
  const bool columns_in = chunk * Layout::kChunkElements < origin.cols_in_tile;
  // copy 0's shared address (the tile on a 128-byte line; copy u's: TileLayout::address_rows_below)
  const uint32_t first_address =
      static_cast<uint32_t>(__cvta_generic_to_shared(tile)) + Layout::chunk_offset(row, chunk);
  const auto shared_address = [&](int u) { return Layout::address_rows_below(first_address, u * kRowStep); };
  if (origin.whole()) {
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(u)), "l"(x + u * stride)
                   : "memory");
    }
  } else {
#pragma unroll
    for (int u = 0; u < kCount; ++u) {
      const bool inside = columns_in && row + u * kRowStep < origin.rows_in_tile;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(u)),
                   "l"(inside ? x + u * stride : x), "r"(inside ? 16 : 0) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Whether a CTA copies its next tile into a second buffer while it encodes the current one (two
// consecutive tiles per CTA): for the 16-bit casts with the longest encoding, RHT or stochastic rounding,
// whose two tiles take 64 KiB of shared memory (FP32's 128 KiB would leave one CTA per multiprocessor).
// The other 16-bit casts round to nearest without the RHT: their four CTAs of one tile each hide the
// loads as well.
template <typename T, bool kRHT, bool kSR>
constexpr bool kPrefetchNextTile = sizeof(T) == 2 && (kRHT || kSR);
template <typename T, bool kRHT, bool kSR>
constexpr int kTileBuffers = kPrefetchNextTile<T, kRHT, kSR> ? 2 : 1;

// When that copy starts: before the wait for the current tile, so that it overlaps all of its encoding,
// or, for the RHT cast, whose encoding takes longest, after the current tile's rowwise copy. The memory
// system then holds fewer tiles that nobody waits for yet, and the last CTAs' copies come back sooner
// (a gain for the compute-heavy RHT cast only; the memory-bound casts lose with it).
template <bool kRHT>
constexpr bool kNextCopyAfterRowwise = kRHT;

// The grid, in tile order (TileOrder): `leading_singles` CTAs of one tile, then `paired_ctas` CTAs of two
// consecutive tiles, then CTAs of one tile (both counts 0 without kPrefetchNextTile). The leading
// singles, one per multiprocessor (two for the RHT cast that rounds to nearest), end half-way through
// the first wave's pairs, so that the CTAs after them start (and load) out of step with the rest,
// instead of every CTA loading at once and then computing at once; the last CTAs to start, about one
// wave of them, take one tile, so the wave that ends the grid is half as long. sr_keys_of_seed: the Philox
// round keys of args.sr_seed, in the kernel's parameters (constant memory) rather than computed per Philox call;
// with args.sr_seed_device, each thread computes the keys of the seed in device memory once instead.
template <typename T, bool k2D, bool kRHT, bool kRandomSign, bool kSR, typename Producer>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 4 ? kMinTilesPerMultiprocessor
                                              : (kPrefetchNextTile<T, kRHT, kSR> ? kMinTilesPerMultiprocessorPaired
                                                                                 : kMinTilesPerMultiprocessorNearest))
    quantize_tile_kernel(const QuantizeArgs args, const __grid_constant__ StochasticRoundingKeys sr_keys_of_seed,
                         const TileOrder order, const int leading_singles, const int paired_ctas,
                         const Producer producer) {
  static_assert(!Producer::kTransforms || (std::is_same_v<T, __nv_bfloat16> && !k2D && !kSR),
                "producers make BF16 tiles, cast 1D and rounded to nearest");
  constexpr bool kPrefetch = kPrefetchNextTile<T, kRHT, kSR>;
  // kTileBuffers tiles, 128-byte aligned: TileLayout's conflict-free patterns assume rows that start on
  // 128-byte lines (tiles 16 bytes past a line, behind the static arrays, make every cast slower)
  extern __shared__ __align__(128) uint8_t tiles_in_shared[];
  // a 16x16-block tile's block amaxes (the bits of non-negative floats, maxed atomically), and its rowwise
  // codes for its columnwise copy (transpose_codes below)
  __shared__ uint32_t tile_amax_2d_bits[k2D ? kRowBlocksPerTile : 1][kColBlocksPerTile];
  __shared__ __align__(16) uint8_t codes_2d[k2D && !kSR ? kTileRows * CodeTile::kRowBytes : 1];
  __shared__ typename Producer::Staged staged;  // the producer's data for the tile (CastOfInput: none)
  const StochasticRoundingKeys sr_keys =
      kSR && args.sr_seed_device != nullptr
          ? stochastic_rounding_keys(static_cast<uint64_t>(*args.sr_seed_device))
          : sr_keys_of_seed;
  using Layout = TileLayout<T>;
  // behind the tiles: e_b per scale byte (encode_block's), rowwise and columnwise, and S_enc * fp32(1/6) of each
  float(*const encode_of_scale)[kPositiveScales] =
      reinterpret_cast<float(*)[kPositiveScales]>(tiles_in_shared + kTileBuffers<T, kRHT, kSR> * Layout::kBytes);
  float* const scale_factor = encode_of_scale[2];
  const int64_t rows = args.rows, cols = args.cols;
  const int64_t source_stride = producer.row_stride(cols);
  const int tid = threadIdx.x;

  // 1. The first tile's loads in flight; meanwhile e_b of each scale byte a non-negative block amax can
  //    give (block_scale_e4m3_of_nonnegative: 0x00..0x7E, 0x7F for NaN), once per CTA instead of one
  //    division per block (a per-row S_enc, for row-scaled copies, divides per block instead).
  // the tensor amaxes before the first tile's copies, so that their loads do not queue behind them (row-scaled:
  // the rowwise ones are read per row below); after them for the 1D and 2D SR casts, which are slower with
  // the loads first
  float rowwise_amax = 0.0f, columnwise_amax = 0.0f;
  const auto load_tensor_amaxes = [&] {
    const auto load = [](const float* amax) { return amax != nullptr ? *amax : 0.0f; };
    rowwise_amax = args.row_scaled ? 0.0f : load(args.amax_rowwise);
    columnwise_amax = args.row_scaled ? 0.0f : load(args.amax_columnwise);
  };
  if constexpr (!kSR || kRHT) load_tensor_amaxes();
  const int cta = static_cast<int>(blockIdx.x);
  const int pair = cta - leading_singles;
  const bool paired = kPrefetch && pair >= 0 && pair < paired_ctas;
  const int first_tile =
      !kPrefetch || cta < leading_singles ? cta : (paired ? leading_singles + 2 * pair : cta + paired_ctas);
  const int end_tile = paired ? first_tile + 2 : first_tile + 1;
  // the RHT cast's tiles row-major (a band_shift of 0), without the band arithmetic
  TileOrigin origin(args, kRHT ? order.row_major(first_tile) : order.row_and_column(first_tile));
  copy_tile_async<T>(tiles_in_shared, args, source_stride, origin, tid);
  if constexpr (kSR && !kRHT) load_tensor_amaxes();
  // one table for both copies where their tensor amaxes are equal (a plain cast's; the RHT changes the
  // columnwise one): the columnwise copy reads the rowwise table, and half the threads skip the divisions
  const bool shared_table = !kRHT && args.amax_rowwise != nullptr && args.amax_columnwise != nullptr &&
                            !args.row_scaled && float_bits(rowwise_amax) == float_bits(columnwise_amax);
  const int columnwise_table = shared_table ? 0 : 1;
  {
    const int copy = tid / kPositiveScales, scale = tid % kPositiveScales;
    const float* amax = copy == 0 ? args.amax_rowwise : args.amax_columnwise;
    if (amax != nullptr && !args.row_scaled && !(copy == 1 && shared_table)) {
      const float s_enc = encode_scale(copy == 0 ? rowwise_amax : columnwise_amax);
      encode_of_scale[copy][scale] =
          encode_block_factor<kSR>(block_encode_factor(static_cast<uint8_t>(scale), decode_scale(s_enc)));
      if (scale == 0) scale_factor[copy] = s_enc * kOneSixth;
    }
  }
  const RowwiseItems<T> rowwise(tid);
  // the codes leave L2 first (streaming stores of whole sectors); the scale bytes stay (l2_keep_policy) until the
  // tiles after complete their sectors, sparing DRAM the read-modify-writes of partial sectors
  const uint64_t keep_in_l2 = l2_keep_policy();
  // 2D casts of both copies under one tensor scale, round to nearest: an element gets the same 16x16 block
  // scale and so the same code in both copies (docs/numerics.md §4), and the columnwise copy is the rowwise codes
  // transposed, read back from shared memory instead of encoded again.
  const bool transpose_codes =
      k2D && !kSR && args.rowwise_data != nullptr && args.columnwise_data != nullptr && shared_table;

  for (int tile_index = first_tile, buffer = 0;; buffer ^= 1) {
    const int64_t m0 = origin.m0, k0 = origin.k0;
    const int rows_in_tile = origin.rows_in_tile, cols_in_tile = origin.cols_in_tile;
    const bool whole_tile = origin.whole();  // origin moves on to the next tile when its copy starts
    uint8_t* const tile = tiles_in_shared + buffer * Layout::kBytes;
    const uint32_t tile_address = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
    // zeros for this tile's block amaxes: the previous tile's readers are past the end-of-iteration barrier
    if (k2D && tid < kRowBlocksPerTile * kColBlocksPerTile) tile_amax_2d_bits[tid >> 3][tid & 7] = 0u;
    const int next_tile = tile_index + 1;
    const bool copy_next = kPrefetch && next_tile < end_tile;
    const auto start_next_copy = [&] {  // the next tile's copy in flight while this one is encoded
      origin = kRHT ? origin.next_row_major(args) : TileOrigin(args, order.row_and_column(next_tile));
      copy_tile_async<T>(tiles_in_shared + (buffer ^ 1) * Layout::kBytes, args, source_stride, origin, tid);
    };
    if constexpr (Producer::kTransforms) producer.stage(staged, m0, k0, rows_in_tile, cols_in_tile, tid);
    if (copy_next && !kNextCopyAfterRowwise<kRHT>) {
      start_next_copy();
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();  // every thread's copies of this tile (and, once, the e_b tables) are in
    if constexpr (Producer::kTransforms) {
      producer.transform(tile, staged, m0, k0, rows_in_tile, cols_in_tile, tid);
      __syncthreads();  // the produced tile is in
    }

    // 2. For 16x16 blocks: the amax of each 16x16 block, shared by both copies (docs/numerics.md §4), as the maximum of
    //    its rows' amaxes (rows outside x are zeros).
    if constexpr (k2D) {
#pragma unroll
      for (int u = 0; u < kRowwiseItemsPerThread; ++u) {
        float values[kBlockSize], amax;
        read_row_block<T>(rowwise.chunk_address(tile_address, u), values, amax);
        atomicMax(&tile_amax_2d_bits[(rowwise.row + u * rowwise.kRowStep) >> 4][rowwise.block], float_bits(amax));
      }
      __syncthreads();
    }
    [[maybe_unused]] const auto tile_amax_2d = [&](int row_block, int block) {
      return __uint_as_float(tile_amax_2d_bits[row_block][block]);
    };

    // 3-4. The copies, in two versions: with the per-item bounds checks, and without them for whole tiles (the
    //      common case: no check, branch or reconvergence per item).
    const auto encode_tile = [&](auto whole_tag) {
      constexpr bool kWhole = decltype(whole_tag)::value;

      // 3. Rowwise copy.
      if (args.rowwise_data != nullptr) {
        const float tensor_factor = scale_factor[0];
        const float* const row_amaxes = args.row_scaled ? args.amax_rowwise : args.amax_rowwise_rows;
        const int64_t data_stride = cols / 2, scale_stride = cols / kBlockSize;
        // item u's data and scale at u item steps from item 0's (pointer steps, not 64-bit products per item)
        uint8_t* data =
            args.rowwise_data + (m0 + rowwise.row) * data_stride + k0 / 2 + rowwise.block * (kBlockSize / 2);
        uint8_t* scales = args.rowwise_scale + (m0 + rowwise.row) * scale_stride + k0 / kBlockSize + rowwise.block;
        const int64_t data_step = rowwise.kRowStep * data_stride, scale_step = rowwise.kRowStep * scale_stride;
        // the thread's blocks share their Philox group (one column block), and differ in the row
        [[maybe_unused]] const PhiloxGroupPrefix sr_group =
            kSR ? stochastic_rounding_group_prefix((k0 + rowwise.block * kBlockSize) / kColumnsPerPhiloxCall,
                                                   kRowwiseStream, sr_keys)
                : PhiloxGroupPrefix{};
#pragma unroll
        for (int u = 0; u < kRowwiseItemsPerThread; ++u, data += data_step, scales += scale_step) {
          const int row = rowwise.row + u * rowwise.kRowStep, block = rowwise.block;
          if (!kWhole && (row >= rows_in_tile || block * kBlockSize >= cols_in_tile)) continue;
          float values[kBlockSize], row_block_amax;
          read_row_block<T>(rowwise.chunk_address(tile_address, u), values, row_block_amax);
          const float amax_of_block = k2D ? tile_amax_2d(row >> 4, block) : row_block_amax;
          float encode;
          uint32_t scale;
          if (row_amaxes != nullptr) {  // row-scaled, or a segmented cast: the row's own amax
            const float s_enc = encode_scale(row_amaxes[m0 + row]);
            scale = block_scale_e4m3_of_nonnegative(amax_of_block, s_enc * kOneSixth);
            encode = encode_block_factor<kSR>(block_encode_factor(scale, decode_scale(s_enc)));
          } else {
            scale = block_scale_e4m3_of_nonnegative(amax_of_block, tensor_factor);
            encode = encode_of_scale[0][scale];
          }
          // the rowwise copy's blocks start at multiples of 16: each is one Philox group
          const uint2 packed =
              encode_block<kSR, sizeof(T) == 2, kRHT>(values, encode, amax_of_block, sr_keys, true, sr_group,
                                                      kRowwiseStream, m0 + row + args.sr_row_offset,
                                                      k0 + block * kBlockSize);
          __stcs(reinterpret_cast<uint2*>(data), packed);
          store_byte(scales, scale, keep_in_l2);
          if constexpr (k2D && !kSR) {
            if (transpose_codes) *reinterpret_cast<uint2*>(codes_2d + CodeTile::block_offset(row, block)) = packed;
          }
        }
        if (k2D && transpose_codes) __syncthreads();  // the tile's codes are in
      }

      if (copy_next && kNextCopyAfterRowwise<kRHT>) start_next_copy();

      // 4. Columnwise copy of x^T (after the RHT when on): item u = (16-row block tid % 8, column pair
      //    (tid / 8) * 2 + u * 64); 8 lanes write 64 bytes of each of their two columns.
      if (args.columnwise_data != nullptr) {
        const float factor = scale_factor[columnwise_table];
        const int row_block = tid & 7, first_column = (tid >> 3) * 2;
        constexpr int kColumnStep = kThreads / kRowBlocksPerTile * 2;
        const int64_t data_stride = rows / 2, scale_stride = rows / kBlockSize;
        // item u's column pair's data and scales at u item steps from item 0's
        uint8_t* data =
            args.columnwise_data + (k0 + first_column) * data_stride + m0 / 2 + row_block * (kBlockSize / 2);
        uint8_t* scales = args.columnwise_scale + (k0 + first_column) * scale_stride + m0 / kBlockSize + row_block;
        const int64_t data_step = kColumnStep * data_stride, scale_step = kColumnStep * scale_stride;
        if (k2D && transpose_codes) {
          // one item per thread: row block tid % 8, columns 4 (tid / 8) .. + 3, bytes b, b + 1 of their block's
          // code words in the row block's 16 rows (b = the first column mod 16, halved); a column takes the low
          // or high nibbles of its byte
          const int quad_column = (tid >> 3) * 4;
          if (kWhole || (row_block * kBlockSize < rows_in_tile && quad_column < cols_in_tile)) {
            const uint8_t* bytes = codes_2d + CodeTile::block_offset(row_block * kBlockSize, quad_column >> 4) +
                                   ((quad_column & 15) >> 1);
            uint32_t pairs[kBlockSize];  // row i's two bytes
#pragma unroll
            for (int i = 0; i < kBlockSize; ++i) {
              pairs[i] = *reinterpret_cast<const uint16_t*>(bytes + i * CodeTile::kRowBytes);
            }
            uint32_t first[4], second[4];  // word q: rows 4q .. 4q + 3 of the first byte, of the second
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const uint32_t a = __byte_perm(pairs[4 * q], pairs[4 * q + 1], 0x5140);
              const uint32_t b = __byte_perm(pairs[4 * q + 2], pairs[4 * q + 3], 0x5140);
              first[q] = __byte_perm(a, b, 0x5410);
              second[q] = __byte_perm(a, b, 0x7632);
            }
            const uint32_t scale = block_scale_e4m3_of_nonnegative(tile_amax_2d(row_block, quad_column >> 4), factor);
            uint8_t* column_data =
                args.columnwise_data + (k0 + quad_column) * data_stride + m0 / 2 + row_block * (kBlockSize / 2);
            uint8_t* column_scales =
                args.columnwise_scale + (k0 + quad_column) * scale_stride + m0 / kBlockSize + row_block;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t(&words)[4] = j < 2 ? first : second;
              const int shift = (j & 1) * 4;
              constexpr uint32_t kLow = 0x0F0F0F0Fu;
              *reinterpret_cast<uint2*>(column_data + j * data_stride) =
                  make_uint2(nibbles_of_byte_values((words[0] >> shift) & kLow, (words[1] >> shift) & kLow),
                             nibbles_of_byte_values((words[2] >> shift) & kLow, (words[3] >> shift) & kLow));
              store_byte(column_scales + j * scale_stride, scale, keep_in_l2);
            }
          }
        } else {
          // the thread's blocks share their Philox group (one row block of x) and differ in the column
          const uint64_t sr_column = m0 + row_block * kBlockSize + args.sr_row_offset;
          const bool sr_one_group = args.sr_row_offset % kColumnsPerPhiloxCall == 0;
          [[maybe_unused]] const PhiloxGroupPrefix sr_group =
              kSR ? stochastic_rounding_group_prefix(sr_column / kColumnsPerPhiloxCall, kColumnwiseStream, sr_keys)
                  : PhiloxGroupPrefix{};
          const uint8_t* base[Layout::kChunksPerBlock];
#pragma unroll
          for (int b = 0; b < Layout::kChunksPerBlock; ++b) {
            base[b] = tile + Layout::chunk_offset(row_block * kBlockSize + b, first_column / Layout::kChunkElements) +
                      first_column % Layout::kChunkElements * static_cast<int>(sizeof(T));
          }
#pragma unroll
          for (int u = 0; u < kColumnwiseItemsPerThread; ++u, data += data_step, scales += scale_step) {
            const int column = first_column + u * kColumnStep;
            if (!kWhole && (row_block * kBlockSize >= rows_in_tile || column >= cols_in_tile)) continue;
            float pair[2][kBlockSize], pair_amax[2];
            read_column_pair<T>(base, u * kColumnStep * static_cast<int>(sizeof(T)), pair[0], pair[1], pair_amax);
            if constexpr (kRHT) {
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                float transformed[kBlockSize];  // odd elements negated
                rht_chunk_odd_negated<kRandomSign>(pair[j], transformed);
                uint32_t running = 0u;  // the amax on the packed BF16 pairs, as read_row_block takes it
#pragma unroll
                for (int i = 0; i < kBlockSize; i += 2) {  // RNE to BF16, two values per conversion
                  const __nv_bfloat162 rounded = __floats2bfloat162_rn(transformed[i], transformed[i + 1]);
                  const uint32_t bits = *reinterpret_cast<const uint32_t*>(&rounded);
                  const float2 both = bf16_pair_to_float2(bits);
                  pair[j][i] = both.x;
                  pair[j][i + 1] = -both.y;  // undoes rht_chunk_odd_negated's sign, free in the scaling FMA
                  running = i == 0 ? bits : max_abs_halves<__nv_bfloat16>(running, bits);
                }
                pair_amax[j] = abs_halves_as_float<__nv_bfloat16>(
                    max_abs_halves<__nv_bfloat16>(running, __byte_perm(running, 0u, 0x1032))).x;
              }
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float amax_of_block = k2D ? tile_amax_2d(row_block, column >> 4) : pair_amax[j];
              uint32_t scale;
              float encode;
              if (args.row_scaled || args.amax_columnwise_chunks != nullptr) {
                // row-scaled: one amax per row of x^T, i.e. per column of x (docs/numerics.md §6b); a segmented
                // cast: the amax of the row block's 16-row chunk of x (its segment's)
                const float s_enc = encode_scale(args.row_scaled ? args.amax_columnwise[k0 + column + j]
                                                                 : args.amax_columnwise_chunks[m0 / kBlockSize + row_block]);
                scale = block_scale_e4m3_of_nonnegative(amax_of_block, s_enc * kOneSixth);
                encode = encode_block_factor<kSR>(block_encode_factor(scale, decode_scale(s_enc)));
              } else {
                scale = block_scale_e4m3_of_nonnegative(amax_of_block, factor);
                encode = encode_of_scale[columnwise_table][scale];
              }
              const uint2 packed =
                  encode_block<kSR, sizeof(T) == 2, kRHT>(pair[j], encode, amax_of_block, sr_keys, sr_one_group,
                                                          sr_group, kColumnwiseStream, k0 + column + j, sr_column);
              __stcs(reinterpret_cast<uint2*>(data + j * data_stride), packed);
              store_byte(scales + j * scale_stride, scale, keep_in_l2);
            }
          }
        }
      }
    };
    if (whole_tile) {
      encode_tile(std::true_type{});
    } else {
      encode_tile(std::false_type{});
    }

    if (!copy_next) break;
    tile_index = next_tile;
    __syncthreads();  // this buffer's reads are done before the next iteration copies into it
  }
}

template <typename T, bool k2D, bool kRHT, bool kRandomSign, bool kSR, typename Producer = CastOfInput>
cudaError_t launch_tiles(const QuantizeArgs& args, cudaStream_t stream, const Producer& producer = Producer{}) {
  const int64_t column_tiles = (args.cols + kTileCols - 1) / kTileCols;
  const int64_t tile_rows = (args.rows + kTileRows - 1) / kTileRows;
  const int64_t tiles = tile_rows * column_tiles;
  if (tiles == 0) return cudaSuccess;
  if (tiles > INT32_MAX) return cudaErrorInvalidValue;
  constexpr bool kPrefetch = kPrefetchNextTile<T, kRHT, kSR>;
  constexpr int kSharedBytes =
      kTileBuffers<T, kRHT, kSR> * TileLayout<T>::kBytes + (2 * kPositiveScales + 2) * static_cast<int>(sizeof(float));
  auto kernel = quantize_tile_kernel<T, k2D, kRHT, kRandomSign, kSR, Producer>;
  if (kSharedBytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
    if (status != cudaSuccess) return status;
  }
  // one single-tile CTA per multiprocessor first (on grids of over 4 waves; two for the RHT cast that rounds
  // to nearest, whose first wave is the longest),
  // about one wave of them at the end (the CTAs per multiprocessor the registers allow), pairs between
  const int64_t multiprocessors = device_multiprocessors();
  const int band_shift = !kRHT && 5 * multiprocessors < 10 * column_tiles ? 4 : 0;  // see TileOrder
  const int64_t last_wave = multiprocessors * kMinTilesPerMultiprocessorPaired;
  const int64_t leading = kPrefetch && tiles > 4 * last_wave ? (kRHT ? (kSR ? 1 : 2) : 1) * multiprocessors : 0;
  const int64_t paired_ctas = kPrefetch && tiles > last_wave + leading ? (tiles - last_wave - leading) / 2 : 0;
  kernel<<<static_cast<int>(tiles - paired_ctas), kThreads, kSharedBytes, stream>>>(
      args, stochastic_rounding_keys(args.sr_seed), TileOrder(tile_rows, column_tiles, band_shift),
      static_cast<int>(leading), static_cast<int>(paired_ctas), producer);
  return cudaGetLastError();
}

}  // namespace tile_cast
}  // namespace nvfp4
