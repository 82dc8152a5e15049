// transpose_codes (docs/numerics.md §4): packed FP4 codes [N, K/2] (element 2i of a row in the low nibble) -> the
// codes of the transpose, packed the same way, [K, N/2]; a 16x16-blocked rowwise copy's columnwise copy.
#include "nvfp4_device.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;  // codes per tile side: 64 rows of 32 bytes in, 64 rows of 32 bytes out

__global__ void __launch_bounds__(kThreads) transpose_codes_kernel(const uint8_t* __restrict__ in, int64_t rows,
                                                                   int64_t cols, uint8_t* __restrict__ out) {
  __shared__ uint8_t tile[kTile][kTile + 1];  // codes [row][col] of this tile, padded against bank conflicts
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t in_row_bytes = cols / 2, out_row_bytes = rows / 2;
  for (int i = threadIdx.x; i < kTile * kTile / 2; i += kThreads) {
    const int r = i / (kTile / 2), b = i % (kTile / 2);
    const int64_t row = row0 + r, byte = col0 / 2 + b;
    const uint8_t packed = (row < rows && byte < in_row_bytes) ? in[row * in_row_bytes + byte] : 0;
    tile[r][2 * b] = packed & 0xF;
    tile[r][2 * b + 1] = packed >> 4;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * kTile / 2; i += kThreads) {
    const int c = i / (kTile / 2), b = i % (kTile / 2);
    const int64_t col = col0 + c, byte = row0 / 2 + b;
    if (col < cols && byte < out_row_bytes) {
      out[col * out_row_bytes + byte] = static_cast<uint8_t>(tile[2 * b][c] | (tile[2 * b + 1][c] << 4));
    }
  }
}

}  // namespace

cudaError_t launch_transpose_codes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows % 2 != 0 || cols % 2 != 0) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned int>((cols + kTile - 1) / kTile), static_cast<unsigned int>((rows + kTile - 1) / kTile));
  transpose_codes_kernel<<<grid, kThreads, 0, stream>>>(in, rows, cols, out);
  return cudaGetLastError();
}

}  // namespace nvfp4
