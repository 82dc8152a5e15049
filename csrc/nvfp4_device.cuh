// Device-side helpers shared by the kernels: input element types, 16-byte loads, reductions.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "nvfp4_kernels.h"

namespace nvfp4 {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// BF16 rounding (RNE) of an FP32 value, back in FP32.
__device__ __forceinline__ float round_to_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The two halves of a packed BF16 pair as FP32 (exact): the low one shifted up, the high one masked
// (one instruction each; converting each half on its own costs the high half an extra byte permute).
__device__ __forceinline__ float2 bf16_pair_to_float2(uint32_t pair) {
  return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xFFFF0000u));
}

// 16 bytes of shared memory at a 16-byte-aligned shared-window address (ld.shared, so that the address
// arithmetic stays 32-bit and a constant offset becomes the load's immediate).
__device__ __forceinline__ uint4 load_shared_16(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}

// The elements of one 16-byte vector as FP32.
template <typename T>
__device__ __forceinline__ void unpack_vector(const uint4& vec, float (&out)[16 / sizeof(T)]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t words[4] = {vec.x, vec.y, vec.z, vec.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = bf16_pair_to_float2(words[i]);
      out[2 * i] = pair.x;
      out[2 * i + 1] = pair.y;
    }
  } else {
    const T* elements = reinterpret_cast<const T*>(&vec);
#pragma unroll
    for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) out[i] = to_float(elements[i]);
  }
}

// max(|a|, |b|) of each 16-bit half of two packed pairs of T, its sign bit arbitrary: one HMNMX2
// (exact; NaN loses to a number, as in fmaxf).
template <typename T> __device__ __forceinline__ uint32_t max_abs_halves(uint32_t a, uint32_t b);
template <> __device__ __forceinline__ uint32_t max_abs_halves<__nv_bfloat16>(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <> __device__ __forceinline__ uint32_t max_abs_halves<__half>(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// |low half| and |high half| of a packed pair of T as FP32.
template <typename T>
__device__ __forceinline__ float2 abs_halves_as_float(uint32_t pair) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const float2 both = bf16_pair_to_float2(pair);
    return make_float2(fabsf(both.x), fabsf(both.y));
  } else {
    const T* halves = reinterpret_cast<const T*>(&pair);
    return make_float2(fabsf(to_float(halves[0])), fabsf(to_float(halves[1])));
  }
}

__device__ __forceinline__ uint4 load_streaming(const void* address) {
  return __ldcs(reinterpret_cast<const uint4*>(address));
}

// Amax reductions run on the bit patterns of |x|: for values >= 0 (and NaN, which must win so a
// NaN input is detected, as torch.amax propagates it) unsigned order is float order.
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// An L2 cache policy that keeps the lines it writes (evict_last): for scale bytes, whose 32-byte sectors the stores of
// several tiles complete; a sector evicted before that costs DRAM a read-modify-write.
__device__ __forceinline__ uint64_t l2_keep_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void store_byte(uint8_t* address, uint32_t value, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.b8 [%0], %1, %2;" ::"l"(address), "h"(static_cast<uint16_t>(value)), "l"(policy)
               : "memory");
}

// The unsigned maximum of a's and b's low halves, and of their high halves (one VIMNMX): the amax of two BF16
// magnitudes (bits, sign cleared) a word.
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Block-wide max of `v`; every thread gets the result. `scratch` holds one word per warp.
__device__ __forceinline__ uint32_t block_max_bits(uint32_t v, uint32_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0u;
  return __reduce_max_sync(0xFFFFFFFFu, v);
}

__device__ __forceinline__ void atomic_max_bits(float* address, uint32_t bits) {
  atomicMax(reinterpret_cast<unsigned int*>(address), bits);
}

inline int device_multiprocessors() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count > 0 ? count : 132;
}

// CTAs of `kernel` (`threads` a CTA, `dynamic_shared_bytes` of dynamic shared memory) that one multiprocessor of the
// current device holds at once, by the occupancy calculator; `fallback` where it fails (its error cleared).
template <typename Kernel>
int ctas_per_multiprocessor(Kernel kernel, int threads, size_t dynamic_shared_bytes, int fallback) {
  int ctas = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, dynamic_shared_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  return ctas;
}

// Run `body.template operator()<T>()` for the element type of `type`.
#define NVFP4_DISPATCH_INPUT_TYPE(type, T, ...)            \
  switch (type) {                                          \
    case InputType::kFloat32: {                            \
      using T = float;                                     \
      __VA_ARGS__;                                         \
      break;                                               \
    }                                                      \
    case InputType::kFloat16: {                            \
      using T = __half;                                    \
      __VA_ARGS__;                                         \
      break;                                               \
    }                                                      \
    case InputType::kBFloat16: {                           \
      using T = __nv_bfloat16;                             \
      __VA_ARGS__;                                         \
      break;                                               \
    }                                                      \
    default:                                               \
      return cudaErrorInvalidValue;                        \
  }

}  // namespace nvfp4
