// One-shot collectives over NVLink peer memory (torch symmetric memory), used by
// parallel/symmetric.py. The reference twin is the NCCL path of parallel/collectives.py.
//  - peer_publish: copy this rank's pieces into its own symmetric buffer, then (the last block to
//    finish) a cross-rank barrier, so that every rank's shard is readable when the next kernel starts.
//  - peer_gather: every piece's W shards (read through peer pointers) into one output, rank blocks
//    concatenated along rows (rowwise copies) or interleaved per row: the swap_first_dims reorder of
//    the columnwise copies, done for free while gathering.
//  - peer_amax_all_reduce: the MAX over ranks of a few FP32 values (the per-tensor amaxes, docs/numerics.md §9),
//    publish + barrier + reduce in one single-block kernel.
//  - peer_barrier: the barrier alone (the symmetric reduce-scatter's, after its copy-engine pushes).
// Barrier: torch symmetric memory's signal pads, slot [channel * W + source] of each rank's pad, set
// 0 -> 1 by the source and reset 1 -> 0 by the owner (system-scope CAS), with system fences around.
#include <algorithm>

#include "nvfp4_device.cuh"

namespace nvfp4 {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kMaxBlocksPerPiece = 264;  // two per SM of an H100/H200: enough loads in flight over NVLink

__device__ __forceinline__ void barrier_with_peers(const PeerBarrier& barrier) {
  __syncthreads();
  if (threadIdx.x < barrier.world_size) {
    const int peer = threadIdx.x;
    __threadfence_system();  // this rank's writes before its arrival
    uint32_t* arrive = barrier.signal_pads[peer] + barrier.channel * barrier.world_size + barrier.rank;
    while (atomicCAS_system(arrive, 0u, 1u) != 0u) {}
    uint32_t* wait = barrier.signal_pads[barrier.rank] + barrier.channel * barrier.world_size + peer;
    while (atomicCAS_system(wait, 1u, 0u) != 1u) {}
    __threadfence_system();  // the peer's writes before this rank's reads
  }
  __syncthreads();
}

// Chunks of kThreads vectors alternate between sources (rotated by this rank), so that all ranks read
// from all peers at once instead of all reading rank 0 first.
template <typename VectorT>
__device__ __forceinline__ void gather_piece(const PeerPiece& piece, int world_size, int rank) {
  const int64_t row_vectors = piece.row_bytes / static_cast<int64_t>(sizeof(VectorT));
  const int64_t per_source = piece.rows * row_vectors;
  const int64_t chunks = world_size * ((per_source + kThreads - 1) / kThreads);
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const int source = static_cast<int>((chunk + rank) % world_size);
    const int64_t vector = (chunk / world_size) * kThreads + threadIdx.x;
    if (vector >= per_source) continue;
    const int64_t row = vector / row_vectors, column = vector - row * row_vectors;
    const int64_t out_row = piece.interleave ? row * world_size + source : source * piece.rows + row;
    const VectorT value = reinterpret_cast<const VectorT*>(piece.src[source])[vector];
    reinterpret_cast<VectorT*>(piece.dst)[out_row * row_vectors + column] = value;
  }
}

__device__ __forceinline__ void gather_pieces(const PeerGatherArgs& args, int rank) {
  const PeerPiece& piece = args.pieces[blockIdx.y];
  switch (piece.vector_bytes) {
    case 16: gather_piece<uint4>(piece, args.world_size, rank); break;
    case 4: gather_piece<uint32_t>(piece, args.world_size, rank); break;
    default: gather_piece<uint8_t>(piece, args.world_size, rank); break;
  }
}

__global__ void __launch_bounds__(kThreads) peer_gather_kernel(const PeerGatherArgs args, int rank) {
  gather_pieces(args, rank);
}

// args: world_size 1 (this rank's pieces into its own buffer). The last block to finish runs the barrier.
__global__ void __launch_bounds__(kThreads) peer_publish_kernel(const PeerGatherArgs args, const PeerBarrier barrier) {
  gather_pieces(args, 0);
  __threadfence_system();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(barrier.blocks_done, 1) == static_cast<int>(gridDim.x * gridDim.y) - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) *barrier.blocks_done = 0;  // ready for the next launch (stream order)
  barrier_with_peers(barrier);
}

// NaN wins, as in torch.amax, so that a non-finite shard is still detected after the reduction.
__global__ void peer_amax_all_reduce_kernel(const PeerAmaxArgs args, const PeerBarrier barrier) {
  const int i = threadIdx.x;
  if (i < args.count) args.slots[barrier.rank][i] = *args.values[i];
  barrier_with_peers(barrier);
  if (i >= args.count) return;
  float running = 0.0f;
  for (int rank = 0; rank < barrier.world_size; ++rank) {
    const float value = *reinterpret_cast<const volatile float*>(args.slots[rank] + i);
    running = (value > running || isnan(value)) ? value : running;
  }
  *args.values[i] = running;
}

__global__ void peer_barrier_kernel(const PeerBarrier barrier) { barrier_with_peers(barrier); }

int vector_bytes(const PeerPiece& piece, int world_size) {
  uintptr_t alignment = reinterpret_cast<uintptr_t>(piece.dst) | static_cast<uintptr_t>(piece.row_bytes);
  for (int rank = 0; rank < world_size; ++rank) alignment |= reinterpret_cast<uintptr_t>(piece.src[rank]);
  return alignment % 16 == 0 ? 16 : alignment % 4 == 0 ? 4 : 1;
}

// Sets each piece's vector width; the grid: enough blocks for the largest piece, capped.
bool prepare(PeerGatherArgs& args, dim3& grid) {
  if (args.count < 1 || args.count > kMaxPeerPieces || args.world_size < 1 || args.world_size > kMaxPeers) return false;
  int64_t blocks = 1;
  for (int p = 0; p < args.count; ++p) {
    PeerPiece& piece = args.pieces[p];
    piece.vector_bytes = vector_bytes(piece, args.world_size);
    const int64_t per_source = piece.rows * (piece.row_bytes / piece.vector_bytes);
    blocks = std::max(blocks, std::min(kMaxBlocksPerPiece, args.world_size * ((per_source + kThreads - 1) / kThreads)));
  }
  grid = dim3(static_cast<unsigned int>(blocks), static_cast<unsigned int>(args.count));
  return true;
}

bool valid(const PeerBarrier& barrier) {
  return barrier.world_size >= 1 && barrier.world_size <= kMaxPeers && barrier.rank >= 0 &&
         barrier.rank < barrier.world_size && barrier.channel >= 0;
}

}  // namespace

cudaError_t launch_peer_publish(PeerGatherArgs args, const PeerBarrier& barrier, cudaStream_t stream) {
  dim3 grid;
  if (args.world_size != 1 || !prepare(args, grid) || !valid(barrier) || barrier.blocks_done == nullptr) {
    return cudaErrorInvalidValue;
  }
  peer_publish_kernel<<<grid, kThreads, 0, stream>>>(args, barrier);
  return cudaGetLastError();
}

cudaError_t launch_peer_gather(PeerGatherArgs args, int rank, cudaStream_t stream) {
  dim3 grid;
  if (!prepare(args, grid) || rank < 0 || rank >= args.world_size) return cudaErrorInvalidValue;
  peer_gather_kernel<<<grid, kThreads, 0, stream>>>(args, rank);
  return cudaGetLastError();
}

cudaError_t launch_peer_amax_all_reduce(const PeerAmaxArgs& args, const PeerBarrier& barrier, cudaStream_t stream) {
  if (args.count < 1 || args.count > kMaxPeerAmaxes || !valid(barrier)) return cudaErrorInvalidValue;
  peer_amax_all_reduce_kernel<<<1, 32, 0, stream>>>(args, barrier);
  return cudaGetLastError();
}

cudaError_t launch_peer_barrier(const PeerBarrier& barrier, cudaStream_t stream) {
  if (!valid(barrier)) return cudaErrorInvalidValue;
  peer_barrier_kernel<<<1, 32, 0, stream>>>(barrier);
  return cudaGetLastError();
}

}  // namespace nvfp4
