// The NaN/Inf record of checks captured in CUDA graphs (nvfp4_dist/finite_check.py): each replay folds its
// values into a record in pinned host memory, which the host reads without waiting for the GPU.
#include <cuda_runtime.h>

#include <cstdint>

#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace {

// record[i] keeps the first non-finite values[i] it is given (finite entries are 0 until then): a NaN/Inf of any
// replay stays visible to the host until it clears the record, however many replays follow.
__global__ void record_nonfinite_kernel(const float* __restrict__ values, int64_t count, volatile float* record) {
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const float value = values[i];
    if (!isfinite(value) && isfinite(record[i])) record[i] = value;
  }
}

}  // namespace

cudaError_t launch_record_nonfinite(const float* values, int64_t count, float* record, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  float* device_record = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_record), record, 0);
  if (status != cudaSuccess) return status;
  record_nonfinite_kernel<<<1, 32, 0, stream>>>(values, count, device_record);
  return cudaGetLastError();
}

}  // namespace nvfp4
