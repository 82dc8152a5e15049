// The NVFP4 cast of a tensor (docs/numerics.md §2-7): quantize_tile.cuh's tile cast of x itself, by input type and
// variant. 4over6 block scaling is quantize_4over6.cu's cast.
#include <cstdint>

#include "nvfp4_device.cuh"
#include "nvfp4_numerics.cuh"
#include "quantize_tile.cuh"

namespace nvfp4 {
namespace {

using tile_cast::launch_tiles;

template <typename T, bool k2D>
cudaError_t launch_1d_or_2d(const QuantizeArgs& args, cudaStream_t stream) {
  return args.stochastic_rounding ? launch_tiles<T, k2D, false, false, true>(args, stream)
                                  : launch_tiles<T, k2D, false, false, false>(args, stream);
}

template <bool kRandomSign>
cudaError_t launch_rht(const QuantizeArgs& args, cudaStream_t stream) {
  return args.stochastic_rounding ? launch_tiles<__nv_bfloat16, false, true, kRandomSign, true>(args, stream)
                                  : launch_tiles<__nv_bfloat16, false, true, kRandomSign, false>(args, stream);
}

}  // namespace

cudaError_t launch_quantize(const QuantizeArgs& args, cudaStream_t stream) {
  const bool segmented = args.amax_rowwise_rows != nullptr || args.amax_columnwise_chunks != nullptr;
  if (segmented && (args.row_scaled || args.four_over_six || (args.amax_rowwise_rows != nullptr &&
                                                              args.amax_rowwise != nullptr) ||
                    (args.amax_columnwise_chunks != nullptr && args.amax_columnwise != nullptr))) {
    return cudaErrorInvalidValue;  // a segmented copy's amaxes replace its tensor amax; no row scaling, no 4over6
  }
  if (args.four_over_six) return launch_quantize_4over6(args, stream);
  const bool columnwise = args.columnwise_data != nullptr;
  if (args.e4m3_bound != 448 || (args.row_scaled && args.block_2d)) return cudaErrorInvalidValue;
  if (args.cols % kBlockSize != 0 || ((columnwise || args.block_2d) && args.rows % kBlockSize != 0)) {
    return cudaErrorInvalidValue;
  }
  if (args.rht && columnwise) {
    if (args.type != InputType::kBFloat16 || args.block_2d) return cudaErrorInvalidValue;
    return args.rht_random_sign ? launch_rht<true>(args, stream) : launch_rht<false>(args, stream);
  }
  NVFP4_DISPATCH_INPUT_TYPE(args.type, T,
                            return args.block_2d ? launch_1d_or_2d<T, true>(args, stream)
                                                 : launch_1d_or_2d<T, false>(args, stream));
  return cudaSuccess;
}

}  // namespace nvfp4
