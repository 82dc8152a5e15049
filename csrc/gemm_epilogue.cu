// The epilogue of the Hopper GEMM's dequantize path (nvfp4_dist/gemm_hopper.py): cuBLAS leaves the
// FP32 product of the exact block values; this applies alpha = S_dec(a) * S_dec(b) (SPEC 8), the bias
// and the accumulation, in FP32 in that order, with one rounding to the output type. A C++ launch
// instead of a Triton one: the per-chunk GEMMs of the overlapped layers are host-bound on small shapes.
#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kColumnsPerThread = 8;  // a block covers 2048 columns of one row; alpha once per thread
constexpr int kColumnsPerBlock = kThreads * kColumnsPerThread;

__device__ __forceinline__ float load_as_float(const void* base, InputType type, int64_t index) {
  switch (type) {
    case InputType::kBFloat16: return to_float(static_cast<const __nv_bfloat16*>(base)[index]);
    case InputType::kFloat16: return to_float(static_cast<const __half*>(base)[index]);
    default: return static_cast<const float*>(base)[index];
  }
}

// Block b: row b / segments, columns [segment * 2048, +2048), lanes on consecutive columns (coalesced).
template <typename OutT>
__global__ void __launch_bounds__(kThreads) gemm_epilogue_kernel(const float* __restrict__ acc, int64_t acc_stride,
                                                                 const float* __restrict__ a_amax, bool a_per_row,
                                                                 const float* __restrict__ b_amax, const void* bias,
                                                                 InputType bias_type, bool accumulate, int64_t cols,
                                                                 int64_t segments, OutT* __restrict__ out,
                                                                 int64_t out_stride) {
  const int64_t row = blockIdx.x / segments;
  const int64_t first = (blockIdx.x % segments) * kColumnsPerBlock + threadIdx.x;
  const float alpha = decode_scale(encode_scale(a_amax[a_per_row ? row : 0])) * decode_scale(encode_scale(b_amax[0]));
#pragma unroll
  for (int k = 0; k < kColumnsPerThread; ++k) {
    const int64_t column = first + k * kThreads;
    if (column >= cols) break;
    float value = acc[row * acc_stride + column] * alpha;
    if (bias != nullptr) value = value + load_as_float(bias, bias_type, column);
    OutT* destination = out + row * out_stride + column;
    if (accumulate) value = value + to_float(*destination);
    *destination = from_float<OutT>(value);
  }
}

}  // namespace

cudaError_t launch_gemm_epilogue(const float* acc, int64_t acc_stride, const float* a_amax, bool a_per_row,
                                 const float* b_amax, const void* bias, InputType bias_type, bool accumulate,
                                 int64_t rows, int64_t cols, void* out, InputType out_type, int64_t out_stride,
                                 cudaStream_t stream) {
  const int64_t segments = (cols + kColumnsPerBlock - 1) / kColumnsPerBlock;
  if (rows * segments == 0) return cudaSuccess;
  if (rows * segments > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const unsigned int grid = static_cast<unsigned int>(rows * segments);
  NVFP4_DISPATCH_INPUT_TYPE(out_type, T, gemm_epilogue_kernel<T><<<grid, kThreads, 0, stream>>>(
                                             acc, acc_stride, a_amax, a_per_row, b_amax, bias, bias_type, accumulate,
                                             cols, segments, static_cast<T*>(out), out_stride));
  return cudaGetLastError();
}

}  // namespace nvfp4
