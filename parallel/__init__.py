"""nvfp4_dist.parallel: tensor/sequence-parallel NVFP4 linear layers and their communication (docs/numerics.md §9)."""
from nvfp4_dist.parallel.collective_timeout import CollectiveTimeoutError
from nvfp4_dist.parallel.collectives import (all_gather_bf16, all_gather_nvfp4, all_reduce_amax, all_reduce_bf16,
                                             reduce_scatter_bf16)
from nvfp4_dist.parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["CollectiveTimeoutError", "ColumnParallelLinear", "RowParallelLinear", "all_gather_bf16", "all_gather_nvfp4", "all_reduce_amax",
           "all_reduce_bf16", "reduce_scatter_bf16"]
