// The order in which the quantize kernels (quantize.cu) visit the 128 x 128 tiles of x, and the
// division-free quotient it uses. Host and device code, so that the CPU tests check both.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "nvfp4_numerics.cuh"  // NVFP4_HD

namespace nvfp4 {

// n / d for 0 <= n < 2^31 and a fixed 1 <= d < 2^31, without a division: (2n * multiplier) >> (32 + shift)
// with shift = ceil(log2 d) and multiplier = ceil(2^(31 + shift) / d) < 2^32. The product exceeds n / d
// by less than n / (d 2^(31 + shift)) * d <= 2^-shift <= 1 / d, too little to reach the next integer.
struct FastDivisor {
  int divisor;
  uint32_t multiplier, shift;

  __host__ explicit FastDivisor(int d) : divisor(d), shift(0) {
    while ((int64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << (31 + shift)) + d - 1) / d);
  }
  NVFP4_HD int quotient(int n) const {
    const uint32_t twice = 2u * static_cast<uint32_t>(n);
#ifdef __CUDA_ARCH__
    return static_cast<int>(__umulhi(twice, multiplier) >> shift);
#else
    return static_cast<int>((static_cast<uint64_t>(twice) * multiplier) >> 32 >> shift);
#endif
  }
};

// The order of the tiles: bands of 2^band_shift tile rows, column-major within a band (row-major for
// band_shift 0). launch_tiles (quantize.cu) picks bands of 16 tile rows where row-major tiles in flight
// at once (about 5 per multiprocessor) would span fewer than 10 tile rows: then the columnwise
// (transposed) copies of vertically adjacent tiles fill 16 x 64 contiguous bytes of each output row,
// where row-major tiles of a wide x wrote 64-byte pieces; the RHT cast, bound by compute, stays row-major.
struct TileOrder {
  FastDivisor band_tiles;       // tiles in a band
  FastDivisor last_band_rows;   // tile rows of the last band (fewer where the tile rows are no multiple)
  int full_bands, band_shift;

  __host__ TileOrder(int64_t tile_rows, int64_t column_tiles, int shift)
      : band_tiles(static_cast<int>((column_tiles << shift) > INT32_MAX ? INT32_MAX : (column_tiles << shift))),
        last_band_rows(static_cast<int>(tile_rows - ((tile_rows - 1) >> shift << shift))),
        full_bands(static_cast<int>((tile_rows - 1) >> shift)),
        band_shift(shift) {}

  // (tile row, tile column) of the tile-th tile in row-major order (band_shift 0)
  NVFP4_HD int2 row_major(int tile) const {
    const int row = band_tiles.quotient(tile);
    return make_int2(row, tile - row * band_tiles.divisor);
  }

  // (tile row, tile column) of the tile-th tile
  NVFP4_HD int2 row_and_column(int tile) const {
    const int band = band_tiles.quotient(tile), within = tile - band * band_tiles.divisor;
    if (band < full_bands) {
      return make_int2((band << band_shift) + (within & ((1 << band_shift) - 1)), within >> band_shift);
    }
    const int column = last_band_rows.quotient(within);
    return make_int2((band << band_shift) + within - column * last_band_rows.divisor, column);
  }
};

}  // namespace nvfp4
