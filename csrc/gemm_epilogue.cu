// The epilogue of the Hopper GEMM's dequantize path (nvfp4_dist/gemm/hopper.py): cuBLAS leaves the
// FP32 product of the exact block values; this applies alpha = S_dec(a) * S_dec(b) (docs/numerics.md §8; S_dec(a) per
// row for a row-scaled A, S_dec(b) per column for the columnwise copy of a row-scaled activation, §6b), the bias
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

// S_dec(b) of output column `column`: b's one value, or its column's (per-row amax of B).
__device__ __forceinline__ float column_decode_scale(const float* b_amax, bool b_per_column, float b_numerator,
                                                     float b_tensor_decode, int64_t column) {
  return b_per_column ? decode_scale(encode_scale(b_amax[column], b_numerator)) : b_tensor_decode;
}

__device__ __forceinline__ float epilogue_value(float acc, float a_decode, float b_decode, const void* bias,
                                                InputType bias_type, int64_t column) {
  const float value = acc * (a_decode * b_decode);
  return bias == nullptr ? value : value + load_as_float(bias, bias_type, column);
}

// Block b: row b / segments, columns [segment * 2048, +2048), lanes on consecutive columns (coalesced).
// kVector: 4 columns per access (float4 of acc, 4 outputs at once), for 16-byte aligned acc rows and
// out rows aligned to 4 elements; otherwise one column per access.
template <typename OutT, bool kVector>
__global__ void __launch_bounds__(kThreads) gemm_epilogue_kernel(const float* __restrict__ acc, int64_t acc_stride,
                                                                 const float* __restrict__ a_amax, bool a_per_row,
                                                                 const float* __restrict__ b_amax, bool b_per_column,
                                                                 float a_numerator, float b_numerator,
                                                                 const void* bias, InputType bias_type,
                                                                 bool accumulate, int64_t cols, int64_t segments,
                                                                 OutT* __restrict__ out, int64_t out_stride) {
  constexpr int kWidth = kVector ? 4 : 1;
  const int64_t row = blockIdx.x / segments;
  const int64_t segment_start = (blockIdx.x % segments) * kColumnsPerBlock;
  const float a_decode = decode_scale(encode_scale(a_amax[a_per_row ? row : 0], a_numerator));
  const float b_tensor_decode = b_per_column ? 0.0f : decode_scale(encode_scale(b_amax[0], b_numerator));
  const float* acc_row = acc + row * acc_stride;
  OutT* out_row = out + row * out_stride;
#pragma unroll
  for (int k = 0; k < kColumnsPerThread / kWidth; ++k) {
    const int64_t column = segment_start + (k * kThreads + threadIdx.x) * kWidth;
    if (column >= cols) break;
    if constexpr (kVector) {
      const float4 loaded = *reinterpret_cast<const float4*>(acc_row + column);
      const float accs[4] = {loaded.x, loaded.y, loaded.z, loaded.w};
      struct alignas(4 * sizeof(OutT)) Quad { OutT v[4]; };
      Quad quad = accumulate ? *reinterpret_cast<const Quad*>(out_row + column) : Quad{};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float b_decode = column_decode_scale(b_amax, b_per_column, b_numerator, b_tensor_decode, column + i);
        float value = epilogue_value(accs[i], a_decode, b_decode, bias, bias_type, column + i);
        if (accumulate) value = value + to_float(quad.v[i]);
        quad.v[i] = from_float<OutT>(value);
      }
      *reinterpret_cast<Quad*>(out_row + column) = quad;
    } else {
      const float b_decode = column_decode_scale(b_amax, b_per_column, b_numerator, b_tensor_decode, column);
      float value = epilogue_value(acc_row[column], a_decode, b_decode, bias, bias_type, column);
      if (accumulate) value = value + to_float(out_row[column]);
      out_row[column] = from_float<OutT>(value);
    }
  }
}

template <typename OutT>
cudaError_t launch_typed(const float* acc, int64_t acc_stride, const float* a_amax, bool a_per_row, const float* b_amax,
                         bool b_per_column, float a_numerator, float b_numerator, const void* bias,
                         InputType bias_type, bool accumulate, int64_t rows, int64_t cols, OutT* out,
                         int64_t out_stride, cudaStream_t stream) {
  const int64_t segments = (cols + kColumnsPerBlock - 1) / kColumnsPerBlock;
  if (rows * segments == 0) return cudaSuccess;
  if (rows * segments > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const unsigned int grid = static_cast<unsigned int>(rows * segments);
  const bool vector = cols % 4 == 0 && acc_stride % 4 == 0 && out_stride % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(acc) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % (4 * sizeof(OutT)) == 0;
  if (vector) {
    gemm_epilogue_kernel<OutT, true><<<grid, kThreads, 0, stream>>>(
        acc, acc_stride, a_amax, a_per_row, b_amax, b_per_column, a_numerator, b_numerator, bias, bias_type, accumulate,
        cols, segments, out, out_stride);
  } else {
    gemm_epilogue_kernel<OutT, false><<<grid, kThreads, 0, stream>>>(
        acc, acc_stride, a_amax, a_per_row, b_amax, b_per_column, a_numerator, b_numerator, bias, bias_type, accumulate,
        cols, segments, out, out_stride);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gemm_epilogue(const float* acc, int64_t acc_stride, const float* a_amax, bool a_per_row,
                                 const float* b_amax, bool b_per_column, int a_e4m3_bound, int b_e4m3_bound,
                                 const void* bias, InputType bias_type, bool accumulate, int64_t rows, int64_t cols,
                                 void* out, InputType out_type, int64_t out_stride, cudaStream_t stream) {
  const float a_numerator = kFp4Max * a_e4m3_bound, b_numerator = kFp4Max * b_e4m3_bound;
  NVFP4_DISPATCH_INPUT_TYPE(out_type, T,
                            return launch_typed<T>(acc, acc_stride, a_amax, a_per_row, b_amax, b_per_column,
                                                   a_numerator, b_numerator, bias, bias_type, accumulate, rows, cols,
                                                   static_cast<T*>(out), out_stride, stream));
  return cudaSuccess;
}

}  // namespace nvfp4
