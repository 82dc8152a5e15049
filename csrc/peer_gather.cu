// One-shot collectives over NVLink peer memory (torch symmetric memory), used by
// nvfp4_dist/parallel/symmetric.py. The reference twin is the NCCL path of parallel/comm.py.
//  - peer_gather: every piece's W source shards (one per rank, read through peer pointers) into one
//    output, rank blocks concatenated along rows (rowwise copies) or interleaved per row, which is
//    the swap_first_dims reorder of the columnwise copies done for free while gathering.
//  - peer_amax_max: the MAX over ranks of a few FP32 values (the per-tensor amaxes, SPEC 9).
// The cross-rank barrier between the writes and these reads is the caller's (symmetric memory's own).
#include <algorithm>

#include "nvfp4_device.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kMaxBlocksPerPiece = 264;  // two per SM of an H100/H200: enough loads in flight over NVLink

template <typename VectorT>
__device__ __forceinline__ void gather_piece(const PeerPiece& piece, int world_size) {
  const int64_t row_vectors = piece.row_bytes / static_cast<int64_t>(sizeof(VectorT));
  const int64_t per_rank = piece.rows * row_vectors;
  const int64_t total = per_rank * world_size;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  // Source-major order: consecutive threads read consecutive vectors of one rank's shard.
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += stride) {
    const int64_t rank = index / per_rank, within_rank = index - rank * per_rank;
    const int64_t row = within_rank / row_vectors, column = within_rank - row * row_vectors;
    const int64_t out_row = piece.interleave ? row * world_size + rank : rank * piece.rows + row;
    const VectorT value = reinterpret_cast<const VectorT*>(piece.src[rank])[within_rank];
    reinterpret_cast<VectorT*>(piece.dst)[out_row * row_vectors + column] = value;
  }
}

__global__ void __launch_bounds__(kThreads) peer_gather_kernel(const PeerGatherArgs args) {
  const PeerPiece& piece = args.pieces[blockIdx.y];
  switch (piece.vector_bytes) {
    case 16: gather_piece<uint4>(piece, args.world_size); break;
    case 4: gather_piece<uint32_t>(piece, args.world_size); break;
    default: gather_piece<uint8_t>(piece, args.world_size); break;
  }
}

// NaN wins, as in torch.amax, so that a non-finite shard is still detected after the reduction.
__global__ void peer_amax_max_kernel(const PeerAmaxArgs args) {
  const int i = threadIdx.x;
  if (i >= args.count) return;
  float running = 0.0f;
  for (int rank = 0; rank < args.world_size; ++rank) {
    const float value = *reinterpret_cast<const volatile float*>(args.src[rank] + i);
    running = (value > running || isnan(value)) ? value : running;
  }
  *args.dst[i] = running;
}

int vector_bytes(const PeerPiece& piece, int world_size) {
  uintptr_t alignment = reinterpret_cast<uintptr_t>(piece.dst) | static_cast<uintptr_t>(piece.row_bytes);
  for (int rank = 0; rank < world_size; ++rank) alignment |= reinterpret_cast<uintptr_t>(piece.src[rank]);
  return alignment % 16 == 0 ? 16 : alignment % 4 == 0 ? 4 : 1;
}

}  // namespace

cudaError_t launch_peer_gather(PeerGatherArgs args, cudaStream_t stream) {
  if (args.count < 0 || args.count > kMaxPeerPieces || args.world_size < 1 || args.world_size > kMaxPeers) {
    return cudaErrorInvalidValue;
  }
  if (args.count == 0) return cudaSuccess;
  int64_t blocks = 1;  // enough for the largest piece, one vector per thread, capped
  for (int p = 0; p < args.count; ++p) {
    PeerPiece& piece = args.pieces[p];
    piece.vector_bytes = vector_bytes(piece, args.world_size);
    const int64_t vectors = args.world_size * piece.rows * (piece.row_bytes / piece.vector_bytes);
    blocks = std::max(blocks, std::min(kMaxBlocksPerPiece, (vectors + kThreads - 1) / kThreads));
  }
  peer_gather_kernel<<<dim3(static_cast<unsigned int>(blocks), static_cast<unsigned int>(args.count)), kThreads, 0,
                       stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_peer_amax_max(const PeerAmaxArgs& args, cudaStream_t stream) {
  if (args.count < 1 || args.count > kMaxPeerAmaxes || args.world_size < 1 || args.world_size > kMaxPeers) {
    return cudaErrorInvalidValue;
  }
  peer_amax_max_kernel<<<1, 32, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace nvfp4
