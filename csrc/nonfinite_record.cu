// The NaN/Inf records of nvfp4_dist/finite_check.py: a check's kernel folds its values into a record in pinned
// host memory, which the host reads whenever it likes, without waiting for the GPU (eager calls and CUDA graph
// replays alike).
#include <cuda_runtime.h>

#include <cstdint>

#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace {

constexpr int kRecordThreads = 128;

__device__ __forceinline__ float nan_propagating_max(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmaxf(a, b); }

// One block. Value j is the maximum of check.values[j][0 .. check.counts[j]) (NaN if any is NaN). When one is not
// finite and the record holds none yet (record[count] == 0), the record gets all values, then record[count] = 1,
// then *any_record = 1: the host reads the flags first, so it sees the values only after they landed.
__global__ void record_check_kernel(const CheckedValues check, volatile float* record, volatile float* any_record) {
  __shared__ float maxima[kMaxCheckedValues];
  for (int j = 0; j < check.count; ++j) {
    float running = 0.0f;
    for (int64_t i = threadIdx.x; i < check.counts[j]; i += blockDim.x) {
      running = nan_propagating_max(running, check.values[j][i]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      running = nan_propagating_max(running, __shfl_down_sync(0xffffffffu, running, offset));
    }
    __shared__ float warp_maxima[kRecordThreads / 32];
    if (threadIdx.x % 32 == 0) warp_maxima[threadIdx.x / 32] = running;
    __syncthreads();
    if (threadIdx.x == 0) {
      float block = warp_maxima[0];
      for (int w = 1; w < kRecordThreads / 32; ++w) block = nan_propagating_max(block, warp_maxima[w]);
      maxima[j] = block;
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  bool finite = true;
  for (int j = 0; j < check.count; ++j) finite = finite && isfinite(maxima[j]);
  if (finite || record[check.count] != 0.0f) return;
  for (int j = 0; j < check.count; ++j) record[j] = maxima[j];
  __threadfence_system();
  record[check.count] = 1.0f;
  __threadfence_system();
  *any_record = 1.0f;
}

float* device_view(float* pinned, cudaError_t* status) {
  float* device = nullptr;
  *status = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), pinned, 0);
  return device;
}

}  // namespace

cudaError_t launch_record_check(const CheckedValues& check, float* record, float* any_record, cudaStream_t stream) {
  if (check.count <= 0 || check.count > kMaxCheckedValues) return cudaErrorInvalidValue;
  cudaError_t status = cudaSuccess;
  float* device_record = device_view(record, &status);
  if (status != cudaSuccess) return status;
  float* device_any = device_view(any_record, &status);
  if (status != cudaSuccess) return status;
  record_check_kernel<<<1, kRecordThreads, 0, stream>>>(check, device_record, device_any);
  return cudaGetLastError();
}

}  // namespace nvfp4
