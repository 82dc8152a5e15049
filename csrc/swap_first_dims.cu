// swap_first_dims (docs/numerics.md §9): a gathered columnwise copy [W*K, X] viewed as (W, K, X) -> (K, W, X).
#include "nvfp4_device.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 256;

// One thread per vector of VectorT in the output; consecutive threads read and write consecutive vectors.
template <typename VectorT>
__global__ void __launch_bounds__(kThreads) swap_first_dims_kernel(const VectorT* __restrict__ in, int64_t world_size,
                                                                   int64_t rows, int64_t row_vectors,
                                                                   VectorT* __restrict__ out) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= world_size * rows * row_vectors) return;
  const int64_t within = index % row_vectors;
  const int64_t rank = (index / row_vectors) % world_size;
  const int64_t row = index / (row_vectors * world_size);
  out[index] = in[(rank * rows + row) * row_vectors + within];
}

template <typename VectorT>
cudaError_t launch_with(const uint8_t* in, int64_t world_size, int64_t rows, int64_t row_bytes, uint8_t* out,
                        cudaStream_t stream) {
  const int64_t row_vectors = row_bytes / static_cast<int64_t>(sizeof(VectorT));
  const int64_t total = world_size * rows * row_vectors;
  swap_first_dims_kernel<VectorT><<<static_cast<unsigned int>((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const VectorT*>(in), world_size, rows, row_vectors, reinterpret_cast<VectorT*>(out));
  return cudaGetLastError();
}

bool aligned(const void* pointer, int64_t row_bytes, int64_t width) {
  return reinterpret_cast<uintptr_t>(pointer) % width == 0 && row_bytes % width == 0;
}

}  // namespace

cudaError_t launch_swap_first_dims(const uint8_t* in, int64_t world_size, int64_t rows, int64_t row_bytes,
                                   uint8_t* out, cudaStream_t stream) {
  if (world_size * rows * row_bytes == 0) return cudaSuccess;
  if (aligned(in, row_bytes, 16) && aligned(out, row_bytes, 16)) return launch_with<uint4>(in, world_size, rows, row_bytes, out, stream);
  if (aligned(in, row_bytes, 4) && aligned(out, row_bytes, 4)) return launch_with<uint32_t>(in, world_size, rows, row_bytes, out, stream);
  return launch_with<uint8_t>(in, world_size, rows, row_bytes, out, stream);
}

}  // namespace nvfp4
