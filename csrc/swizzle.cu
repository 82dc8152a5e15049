// The 128x4 swizzled block-scale layout of Blackwell block-scaled GEMMs (docs/numerics.md §8), zero padded.
#include "nvfp4_device.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kTileBytes = 512;  // one 128-row x 4-column tile of scales

// One thread per output byte: invert offset(r, c) = ((r/128) * (Cp/4) + c/4) * 512
//   + (r%32) * 16 + ((r%128)/32) * 4 + c%4, and copy scale[r, c] or write the zero padding.
__global__ void __launch_bounds__(kThreads) swizzle_scales_kernel(const uint8_t* __restrict__ scale, int64_t rows,
                                                                  int64_t cols, int64_t padded_cols, int64_t total,
                                                                  uint8_t* __restrict__ out) {
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (offset >= total) return;
  const int64_t tile = offset / kTileBytes;
  const int within = static_cast<int>(offset % kTileBytes);
  const int64_t tiles_per_row = padded_cols / 4;
  const int64_t row = (tile / tiles_per_row) * 128 + ((within % 16) / 4) * 32 + within / 16;
  const int64_t col = (tile % tiles_per_row) * 4 + within % 4;
  out[offset] = (row < rows && col < cols) ? scale[row * cols + col] : 0;
}

}  // namespace

cudaError_t launch_swizzle_scales(const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* out,
                                  cudaStream_t stream) {
  const int64_t padded_rows = (rows + 127) / 128 * 128, padded_cols = (cols + 3) / 4 * 4;
  const int64_t total = padded_rows * padded_cols;
  if (total == 0) return cudaSuccess;
  swizzle_scales_kernel<<<static_cast<unsigned int>((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      scale, rows, cols, padded_cols, total, out);
  return cudaGetLastError();
}

}  // namespace nvfp4
