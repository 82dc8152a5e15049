// The NVFP4 cast (SPEC 2-7): one pass over a 128 x 128 tile of the input in shared memory writes
// the rowwise copy and the columnwise (transposed) copy with their E4M3 scales.
// Variants (template flags): 16x16 blocks for weights (SPEC 4), the RHT of the columnwise copy of
// BF16 inputs (SPEC 5), stochastic rounding with Philox bits (SPEC 7). Row-scaled amax (SPEC 6)
// and which copies to write are run-time arguments.
#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kTileRows = 128, kTileCols = 128, kThreads = 256;
constexpr int kMinTilesPerMultiprocessor = 3;  // caps registers at 85 so 3 tiles overlap load and math
constexpr int kMinTilesPerMultiprocessor2D = 4;  // 16x16 blocks of 16-bit input: 64 registers, ~4% faster on H100
constexpr int kRowBlocksPerTile = kTileRows / kBlockSize;   // 16-row blocks of a tile
constexpr int kColBlocksPerTile = kTileCols / kBlockSize;   // 16-column blocks of a tile
constexpr int kRowwiseItemsPerThread = kTileRows * kColBlocksPerTile / kThreads;        // (row, 16-col block)
constexpr int kColumnwiseItemsPerThread = kRowBlocksPerTile * (kTileCols / 2) / kThreads;  // (16-row block, col pair)
constexpr uint32_t kRowwiseStream = 0, kColumnwiseStream = 1;  // Philox counter word 2 of each copy
constexpr int kPositiveScales = 128;  // E4M3 bytes 0x00..0x7F (0x7F, NaN, never occurs as a scale)
static_assert(kThreads == 2 * kPositiveScales, "one thread per scale byte of each copy fills the e_b tables");

// A tile of T in shared memory, row-major, its 16-byte chunks XOR-swizzled by the row's 16-row block
// so that both the rowwise reads (16 consecutive elements) and the columnwise reads (an element
// pair down 16 rows) are free of bank conflicts.
template <typename T>
struct TileLayout {
  static constexpr int kChunkElements = 16 / sizeof(T);
  static constexpr int kChunksPerRow = kTileCols / kChunkElements;
  static constexpr int kChunksPerBlock = kBlockSize / kChunkElements;
  static constexpr int kRowBytes = kTileCols * sizeof(T);
  static constexpr int kBytes = kTileRows * kRowBytes;

  __device__ static int chunk_offset(int row, int chunk) { return row * kRowBytes + ((chunk ^ ((row >> 4) & 7)) << 4); }
  __device__ static int element_offset(int row, int column) {
    const int byte = column * static_cast<int>(sizeof(T));
    return chunk_offset(row, byte >> 4) + (byte & 15);
  }
};

__device__ __forceinline__ float block_amax(const float (&values)[kBlockSize]) {
  float running = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) running = fmaxf(running, fabsf(values[i]));
  return running;
}

// The 16 values of row `row`, column block `block` of the tile, and their amax (for 16-bit T taken on
// the packed pairs, one HMNMX2 per pair). Lanes with block >= 4 (>= 2, ...) read their chunks in a
// rotated order, which spreads one row's 8 blocks over all banks.
template <typename T>
__device__ __forceinline__ void read_row_block(const uint8_t* tile, int row, int block, float (&values)[kBlockSize],
                                               float& amax) {
  using Layout = TileLayout<T>;
  constexpr int kParts = Layout::kChunksPerBlock;
  const int rotation = (block >> (kParts == 2 ? 2 : 1)) & (kParts - 1);
  uint4 raw[kParts];
#pragma unroll
  for (int h = 0; h < kParts; ++h) {
    const int chunk = block * kParts + ((h + rotation) & (kParts - 1));
    raw[h] = *reinterpret_cast<const uint4*>(tile + Layout::chunk_offset(row, chunk));
  }
  uint4 logical[kParts];  // undo the rotation with compile-time register indices
#pragma unroll
  for (int q = 0; q < kParts; ++q) logical[q] = (rotation & 1) ? raw[(q + kParts - 1) % kParts] : raw[q];
  if constexpr (kParts == 4) {
    uint4 shifted[kParts];
#pragma unroll
    for (int q = 0; q < kParts; ++q) shifted[q] = (rotation & 2) ? logical[(q + 2) % kParts] : logical[q];
#pragma unroll
    for (int q = 0; q < kParts; ++q) logical[q] = shifted[q];
  }
#pragma unroll
  for (int q = 0; q < kParts; ++q) {
    float part[Layout::kChunkElements];
    unpack_vector<T>(logical[q], part);
#pragma unroll
    for (int e = 0; e < Layout::kChunkElements; ++e) values[q * Layout::kChunkElements + e] = part[e];
  }
  if constexpr (sizeof(T) == 4) {
    amax = block_amax(values);
  } else {
    uint32_t running = max_abs_halves<T>(logical[0].x, logical[0].y);
    running = max_abs_halves<T>(running, logical[0].z);
    running = max_abs_halves<T>(running, logical[0].w);
    running = max_abs_halves<T>(running, logical[1].x);
    running = max_abs_halves<T>(running, logical[1].y);
    running = max_abs_halves<T>(running, logical[1].z);
    running = max_abs_halves<T>(running, logical[1].w);
    const float2 halves = abs_halves_as_float<T>(running);
    amax = fmaxf(halves.x, halves.y);
  }
}

// Columns (column, column + 1) of the 16 rows of row block `row_block`, and the amax of each (for
// 16-bit T taken on the packed pairs, one HMNMX2 per row).
template <typename T>
__device__ __forceinline__ void read_column_pair(const uint8_t* tile, int row_block, int column, float (&first)[kBlockSize],
                                                 float (&second)[kBlockSize], float (&amax)[2]) {
  using Layout = TileLayout<T>;
  [[maybe_unused]] uint32_t running = 0u;
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i) {
    const uint8_t* address = tile + Layout::element_offset(row_block * kBlockSize + i, column);
    if constexpr (sizeof(T) == 4) {
      const float2 pair = *reinterpret_cast<const float2*>(address);
      first[i] = pair.x;
      second[i] = pair.y;
    } else {
      const uint32_t pair = *reinterpret_cast<const uint32_t*>(address);
      const T* halves = reinterpret_cast<const T*>(&pair);
      first[i] = to_float(halves[0]);
      second[i] = to_float(halves[1]);
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

template <typename T, bool k2D, bool kRHT, bool kRandomSign, bool kSR>
__global__ void __launch_bounds__(kThreads, k2D && sizeof(T) == 2 ? kMinTilesPerMultiprocessor2D : kMinTilesPerMultiprocessor)
    quantize_tile_kernel(const QuantizeArgs args) {
  extern __shared__ __align__(16) uint8_t tile[];
  __shared__ float block_amax_2d[k2D ? kTileRows : 1][kColBlocksPerTile];
  __shared__ float tile_amax_2d[k2D ? kRowBlocksPerTile : 1][kColBlocksPerTile];
  __shared__ float encode_of_scale[2][kPositiveScales];  // e_b of each scale byte: rowwise, columnwise
  using Layout = TileLayout<T>;
  const int64_t rows = args.rows, cols = args.cols;
  const int64_t column_tiles = (cols + kTileCols - 1) / kTileCols;
  const int64_t m0 = (blockIdx.x / column_tiles) * kTileRows, k0 = (blockIdx.x % column_tiles) * kTileCols;
  const int tid = threadIdx.x;

  // 1. The tile into shared memory, all loads in flight before the first store.
  constexpr int kLoads = kTileRows * Layout::kChunksPerRow / kThreads;
  const uint8_t* x = static_cast<const uint8_t*>(args.x);
  uint4 staged[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int index = u * kThreads + tid, row = index / Layout::kChunksPerRow, chunk = index % Layout::kChunksPerRow;
    const int64_t global_row = m0 + row, global_col = k0 + chunk * Layout::kChunkElements;
    staged[u] = (global_row < rows && global_col < cols)
                    ? load_streaming(x + (global_row * cols + global_col) * static_cast<int64_t>(sizeof(T)))
                    : make_uint4(0u, 0u, 0u, 0u);
  }
  // While the loads are in flight: e_b of each non-negative scale byte, once per tile instead of one
  // division per block (a per-row S_enc, for row-scaled copies, divides per block instead).
  {
    const int copy = tid / kPositiveScales, scale = tid % kPositiveScales;
    const float* amax = copy == 0 ? args.amax_rowwise : args.amax_columnwise;
    if (amax != nullptr && !(copy == 0 && args.row_scaled)) {
      encode_of_scale[copy][scale] = block_encode_factor(static_cast<uint8_t>(scale), decode_scale(encode_scale(amax[0])));
    }
  }
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int index = u * kThreads + tid;
    *reinterpret_cast<uint4*>(tile + Layout::chunk_offset(index / Layout::kChunksPerRow, index % Layout::kChunksPerRow)) = staged[u];
  }
  __syncthreads();

  // 2. For 16x16 blocks: the amax of each 16x16 block, shared by both copies (SPEC 4).
  if constexpr (k2D) {
#pragma unroll
    for (int u = 0; u < kRowwiseItemsPerThread; ++u) {
      const int item = u * kThreads + tid, block = item & 7, row = item >> 3;
      float values[kBlockSize], amax;
      read_row_block<T>(tile, row, block, values, amax);
      block_amax_2d[row][block] = amax;
    }
    __syncthreads();
    if (tid < kRowBlocksPerTile * kColBlocksPerTile) {
      const int row_block = tid >> 3, block = tid & 7;
      float running = 0.0f;
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i) running = fmaxf(running, block_amax_2d[row_block * kBlockSize + i][block]);
      tile_amax_2d[row_block][block] = running;
    }
    __syncthreads();
  }

  // 3. Rowwise copy: item = (tile row, 16-column block); 8 lanes write one row's 64 bytes.
  if (args.rowwise_data != nullptr) {
    const float tensor_s_enc = args.row_scaled ? 1.0f : encode_scale(args.amax_rowwise[0]);
#pragma unroll
    for (int u = 0; u < kRowwiseItemsPerThread; ++u) {
      const int item = u * kThreads + tid, block = item & 7, row = item >> 3;
      const int64_t global_row = m0 + row, global_col = k0 + block * kBlockSize;
      if (global_row >= rows || global_col >= cols) continue;
      float values[kBlockSize], row_block_amax;
      read_row_block<T>(tile, row, block, values, row_block_amax);
      const float amax_of_block = k2D ? tile_amax_2d[row >> 4][block] : row_block_amax;
      const float s_enc = args.row_scaled ? encode_scale(args.amax_rowwise[global_row]) : tensor_s_enc;
      const uint8_t scale = block_scale_e4m3(amax_of_block, s_enc);
      const float encode = args.row_scaled || scale >= kPositiveScales ? block_encode_factor(scale, decode_scale(s_enc))
                                                                       : encode_of_scale[0][scale];
      const uint2 packed = encode_block<kSR>(values, encode, amax_of_block, args.sr_seed, kRowwiseStream,
                                             global_row + args.sr_row_offset, global_col);
      *reinterpret_cast<uint2*>(args.rowwise_data + global_row * (cols / 2) + global_col / 2) = packed;
      args.rowwise_scale[global_row * (cols / kBlockSize) + global_col / kBlockSize] = scale;
    }
  }

  // 4. Columnwise copy of x^T (after the RHT when on): item = (16-row block, column pair);
  //    8 lanes write 64 bytes of each of their two columns.
  if (args.columnwise_data != nullptr) {
    const float s_enc = encode_scale(args.amax_columnwise[0]);
    const float s_dec = decode_scale(s_enc);
#pragma unroll
    for (int u = 0; u < kColumnwiseItemsPerThread; ++u) {
      const int item = u * kThreads + tid, row_block = item & 7, column = (item >> 3) * 2;
      const int64_t global_row = m0 + row_block * kBlockSize, global_col = k0 + column;
      if (global_row >= rows || global_col >= cols) continue;
      float pair[2][kBlockSize], pair_amax[2];
      read_column_pair<T>(tile, row_block, column, pair[0], pair[1], pair_amax);
      if constexpr (kRHT) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float transformed[kBlockSize];
          rht_chunk<kRandomSign>(pair[j], transformed);
#pragma unroll
          for (int i = 0; i < kBlockSize; i += 2) {  // RNE to BF16, two values per conversion
            const __nv_bfloat162 rounded = __floats2bfloat162_rn(transformed[i], transformed[i + 1]);
            pair[j][i] = __low2float(rounded);
            pair[j][i + 1] = __high2float(rounded);
          }
          pair_amax[j] = block_amax(pair[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float amax_of_block = k2D ? tile_amax_2d[row_block][column >> 4] : pair_amax[j];
        const uint8_t scale = block_scale_e4m3(amax_of_block, s_enc);
        const float encode = scale >= kPositiveScales ? block_encode_factor(scale, s_dec) : encode_of_scale[1][scale];
        const uint2 packed = encode_block<kSR>(pair[j], encode, amax_of_block, args.sr_seed, kColumnwiseStream,
                                               global_col + j,
                                               global_row + args.sr_row_offset);
        *reinterpret_cast<uint2*>(args.columnwise_data + (global_col + j) * (rows / 2) + global_row / 2) = packed;
        args.columnwise_scale[(global_col + j) * (rows / kBlockSize) + global_row / kBlockSize] = scale;
      }
    }
  }
}

template <typename T, bool k2D, bool kRHT, bool kRandomSign, bool kSR>
cudaError_t launch_tiles(const QuantizeArgs& args, cudaStream_t stream) {
  const int64_t tiles = ((args.rows + kTileRows - 1) / kTileRows) * ((args.cols + kTileCols - 1) / kTileCols);
  if (tiles == 0) return cudaSuccess;
  constexpr int kSharedBytes = TileLayout<T>::kBytes;
  auto kernel = quantize_tile_kernel<T, k2D, kRHT, kRandomSign, kSR>;
  if (kSharedBytes > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
    if (status != cudaSuccess) return status;
  }
  kernel<<<static_cast<unsigned int>(tiles), kThreads, kSharedBytes, stream>>>(args);
  return cudaGetLastError();
}

template <typename T, bool k2D>
cudaError_t launch_1d_or_2d(const QuantizeArgs& args, cudaStream_t stream) {
  return args.stochastic_rounding ? launch_tiles<T, k2D, false, false, true>(args, stream)
                                  : launch_tiles<T, k2D, false, false, false>(args, stream);
}

template <bool kRandomSign>
cudaError_t launch_rht(const QuantizeArgs& args, cudaStream_t stream) {
  return args.stochastic_rounding ? launch_tiles<__nv_bfloat16, false, true, kRandomSign, true>(args, stream)
                                  : launch_tiles<__nv_bfloat16, false, true, kRandomSign, false>(args, stream);
}

}  // namespace

cudaError_t launch_quantize(const QuantizeArgs& args, cudaStream_t stream) {
  const bool columnwise = args.columnwise_data != nullptr;
  if (args.cols % kBlockSize != 0 || ((columnwise || args.block_2d) && args.rows % kBlockSize != 0)) {
    return cudaErrorInvalidValue;
  }
  if (args.rht && columnwise) {
    if (args.type != InputType::kBFloat16 || args.block_2d) return cudaErrorInvalidValue;
    return args.rht_random_sign ? launch_rht<true>(args, stream) : launch_rht<false>(args, stream);
  }
  NVFP4_DISPATCH_INPUT_TYPE(args.type, T,
                            return args.block_2d ? launch_1d_or_2d<T, true>(args, stream)
                                                 : launch_1d_or_2d<T, false>(args, stream));
  return cudaSuccess;
}

}  // namespace nvfp4
