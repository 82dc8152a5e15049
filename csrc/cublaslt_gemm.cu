// The cuBLAS step of the Hopper GEMM's dequantize path (nvfp4_dist/gemm/hopper.py) through cuBLASLt:
// out = alpha * (A . B^T) with alpha = S_dec(a) * S_dec(b) read from device memory (docs/numerics.md §8), written in
// the output type by cuBLAS itself, so no FP32 product goes through memory and no epilogue pass or host
// sync is needed. A [M, K] and B [N, K] hold the exact BF16 block values (fp4 * block scale); the FP32
// accumulator is scaled, the bias (of the output's type) added, and rounded once, as the epilogue kernel
// does. Accumulating into out (beta = 1) takes no bias.
#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"

namespace nvfp4 {
namespace {

constexpr int kMaxScalarGemms = 64;  // GEMMs whose scalars one launch computes (their pointers are kernel arguments)

struct GemmScalarsArgs {
  const float* a_amax[kMaxScalarGemms];
  const float* b_amax[kMaxScalarGemms];
  int count;
  float a_numerator, b_numerator;
  bool accumulate;
  float* scalars;
};

// scalars[2i], scalars[2i + 1] = alpha and beta of GEMM i.
__global__ void gemm_scalars_kernel(GemmScalarsArgs args) {
  const int i = threadIdx.x;
  if (i < args.count) {
    args.scalars[2 * i] = gemm_alpha(args.a_amax[i][0], args.b_amax[i][0], args.a_numerator, args.b_numerator);
    args.scalars[2 * i + 1] = args.accumulate ? 1.0f : 0.0f;
  }
}

cudaDataType_t data_type(InputType type) {
  switch (type) {
    case InputType::kBFloat16: return CUDA_R_16BF;
    case InputType::kFloat16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// Descriptors and the heuristic's algorithm of one problem, kept for the next call of the same problem
// (creating them and asking the heuristic costs more host time than the launch).
struct Plan {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
  bool found = false;
};

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool, size_t>;

cublasLtHandle_t device_handle(int device) {
  static std::map<int, cublasLtHandle_t> handles;
  auto found = handles.find(device);
  if (found != handles.end()) return found->second;
  cublasLtHandle_t handle = nullptr;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return nullptr;
  handles[device] = handle;
  return handle;
}

// The plan of out[M, N] = op(A) x op(B) seen column-major: D (N x M, ld out_stride) = B' (N x K) . A (K x M),
// with B stored K x N (ld ldb, transposed) and A stored K x M (ld lda).
const Plan* plan_for(cublasLtHandle_t handle, const PlanKey& key, size_t workspace_bytes) {
  static std::map<PlanKey, Plan> plans;
  auto cached = plans.find(key);
  if (cached != plans.end()) return cached->second.found ? &cached->second : nullptr;
  const auto [device, m, n, k, lda, ldb, ldd, out_type, bias_type, accumulate, workspace] = key;
  (void)device;
  (void)workspace;
  Plan plan;
  bool ok = cublasLtMatmulDescCreate(&plan.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS;
  const cublasOperation_t transposed = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  const int32_t pointer_mode = CUBLASLT_POINTER_MODE_DEVICE;
  ok = ok && cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSA, &transposed,
                                            sizeof(transposed)) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof(plain)) ==
                 CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode,
                                            sizeof(pointer_mode)) == CUBLAS_STATUS_SUCCESS;
  if (bias_type >= 0) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_data_type = data_type(static_cast<InputType>(bias_type));
    ok = ok && cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                              sizeof(epilogue)) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_data_type,
                                              sizeof(bias_data_type)) == CUBLAS_STATUS_SUCCESS;
  }
  ok = ok && cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, k, n, ldb) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, k, m, lda) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&plan.d, data_type(static_cast<InputType>(out_type)), n, m, ldd) ==
                 CUBLAS_STATUS_SUCCESS;
  if (ok) {
    cublasLtMatmulPreference_t preference = nullptr;
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    ok = cublasLtMatmulPreferenceCreate(&preference) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                              sizeof(workspace_bytes)) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulAlgoGetHeuristic(handle, plan.operation, plan.b, plan.a, plan.d, plan.d, preference, 1, &result,
                                        &count) == CUBLAS_STATUS_SUCCESS &&
         count > 0;
    if (preference != nullptr) cublasLtMatmulPreferenceDestroy(preference);
    if (ok) plan.algorithm = result.algo;
  }
  plan.found = ok;
  const Plan& stored = plans[key] = plan;
  return ok ? &stored : nullptr;
}

}  // namespace

cudaError_t launch_gemm_scalars(const float* const* a_amax, const float* const* b_amax, int64_t count,
                                int a_e4m3_bound, int b_e4m3_bound, bool accumulate, float* scalars,
                                cudaStream_t stream) {
  for (int64_t first = 0; first < count; first += kMaxScalarGemms) {
    GemmScalarsArgs args{};
    args.count = static_cast<int>(std::min<int64_t>(kMaxScalarGemms, count - first));
    for (int i = 0; i < args.count; ++i) {
      args.a_amax[i] = a_amax[first + i];
      args.b_amax[i] = b_amax[first + i];
    }
    args.a_numerator = kFp4Max * a_e4m3_bound;
    args.b_numerator = kFp4Max * b_e4m3_bound;
    args.accumulate = accumulate;
    args.scalars = scalars + 2 * first;
    gemm_scalars_kernel<<<1, kMaxScalarGemms, 0, stream>>>(args);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) return launched;
  }
  return cudaSuccess;
}

cudaError_t launch_cublaslt_gemm(const void* a, int64_t lda, const void* b, int64_t ldb, int64_t m, int64_t n,
                                 int64_t k, const float* a_amax, const float* b_amax, int a_e4m3_bound,
                                 int b_e4m3_bound, const void* bias, InputType bias_type, bool accumulate, void* out,
                                 InputType out_type, int64_t out_stride, float* scalars, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
  if (m <= 0 || n <= 0 || k <= 0 || (bias != nullptr && (accumulate || bias_type != out_type))) {
    return cudaErrorInvalidValue;
  }
  int device = 0;
  cudaGetDevice(&device);
  cublasLtHandle_t handle = device_handle(device);
  if (handle == nullptr) return cudaErrorNotSupported;
  const PlanKey key{device, m, n, k, lda, ldb, out_stride, static_cast<int>(out_type),
                    bias != nullptr ? static_cast<int>(bias_type) : -1, accumulate, workspace_bytes};
  const Plan* plan = plan_for(handle, key, workspace_bytes);
  if (plan == nullptr) return cudaErrorNotSupported;  // no algorithm: the caller takes the FP32-output path
  if (bias != nullptr &&
      cublasLtMatmulDescSetAttribute(plan->operation, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)) !=
          CUBLAS_STATUS_SUCCESS) {
    return cudaErrorUnknown;
  }
  if (a_amax != nullptr) {
    const cudaError_t launched =
        launch_gemm_scalars(&a_amax, &b_amax, 1, a_e4m3_bound, b_e4m3_bound, accumulate, scalars, stream);
    if (launched != cudaSuccess) return launched;
  }
  const cublasStatus_t status =
      cublasLtMatmul(handle, plan->operation, scalars, b, plan->b, a, plan->a, scalars + 1, out, plan->d, out, plan->d,
                     &plan->algorithm, workspace, workspace_bytes, stream);
  return status == CUBLAS_STATUS_SUCCESS ? cudaGetLastError() : cudaErrorUnknown;
}

}  // namespace nvfp4
