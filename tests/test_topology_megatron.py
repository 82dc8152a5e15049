"""The Megatron-Core adapters in a 4-rank job as TP=2 x DP=2 and TP=2 x PP=2 (Megatron's own parallel_state groups).

Megatron builds the tensor-parallel groups ({0, 1} and {2, 3}) and hands the adapters theirs; each data-parallel
replica or pipeline stage runs its own data, and every rank is held to the independent oracle of its own TP group
alone (tests/test_topology_layers.py): GEMM operands byte for byte (amaxes shared and copies gathered within the
group), outputs and gradients within the oracle's bounds.
"""
import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from tests.helpers.topology import TP, WORLD, Placement
from tests.test_topology_layers import FFN, HIDDEN, ROW_OUT, check_configurations

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

TIMEOUT_S = 600
CONFIGURATIONS = [("column", "default", True, False), ("column", "default", False, False),
                  ("row", "default", True, False), ("row", "default", False, True)]


def _megatron_placement(other: str) -> Placement:
    """Megatron's model-parallel groups on the gloo world (TP=2 and `other` = "data" or "pipeline" of 2), and this
    rank's TP group; replica: the data-parallel rank or the pipeline stage. Megatron's helpers allocate on
    torch.cuda.current_device(), made the CPU here (tests/test_megatron.py's _init_megatron says why)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    torch.cuda.current_device = lambda: torch.device("cpu")
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP,
                                             pipeline_model_parallel_size=2 if other == "pipeline" else 1)
    group = parallel_state.get_tensor_model_parallel_group()
    replica = (parallel_state.get_pipeline_model_parallel_rank() if other == "pipeline"
               else parallel_state.get_data_parallel_rank())
    assert parallel_state.get_data_parallel_world_size() == (1 if other == "pipeline" else 2)
    return Placement(group, tuple(dist.get_process_group_ranks(group)),
                     parallel_state.get_tensor_model_parallel_rank(), replica)


def _megatron_builder(other: str):
    """build(kind, place, weight, sequence_parallel, recipe) of tests/test_topology_layers.py: the NVFP4 adapter
    as a Megatron spec builds it (tp_group from parallel_state), its shard of `weight` copied in."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nvfp4_dist.parallel.megatron import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear

    def build(kind, place, weight, sequence_parallel, recipe):
        config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4,
                                   tensor_model_parallel_size=TP,
                                   pipeline_model_parallel_size=2 if other == "pipeline" else 1,
                                   pipeline_dtype=torch.float32,
                                   sequence_parallel=sequence_parallel, use_cpu_initialization=True,
                                   add_bias_linear=True, gradient_accumulation_fusion=False)
        if kind == "column":
            layer = NVFP4ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=config.init_method, bias=True,
                                              recipe=recipe)
            shard = weight.chunk(TP, dim=0)[place.rank]
        else:
            layer = NVFP4RowParallelLinear(FFN, ROW_OUT, config=config, init_method=config.init_method, bias=True,
                                           input_is_parallel=True, skip_bias_add=False, recipe=recipe)
            shard = weight.chunk(TP, dim=1)[place.rank]
        assert layer.tp_group is place.group
        with torch.no_grad():
            layer.weight.copy_(shard)
        layer.invalidate_weight_cache()
        return layer
    return build


def _check_adapters(rank, world_size, other):
    place = _megatron_placement(other)
    check_configurations(rank, place, CONFIGURATIONS, build=_megatron_builder(other), label=f"megatron TP x {other}")


@pytest.mark.parametrize("other", ["data", "pipeline"])
def test_adapters_match_the_oracle_of_their_own_group(other):
    run_distributed(_check_adapters, WORLD, other, timeout_s=TIMEOUT_S)
