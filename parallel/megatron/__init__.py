"""Megatron-Core integration: NVFP4 linears behind Megatron's linear-module contract, and layer specs.

A Megatron-Core user switches a GPT model to NVFP4 by changing its layer spec:

    from nvfp4_dist.parallel.megatron import get_gpt_layer_nvfp4_spec
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_nvfp4_spec(), ...)

or, to keep the first N / last M transformer layers in BF16,

    spec = get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=1, bf16_last_layers=1)

compat: the megatron-core requirement and constructor conventions; adapters: the NVFP4 column/row-parallel
linears (and the column-parallel one with the layer's norm inside); mlp: NVFP4MLP (the activation inside
linear_fc2); moe: NVFP4GroupedMLP (MoE experts on nvfp4_dist.GroupedLinear) and NVFP4MoELayer (NVFP4
dispatch); norm: NVFP4Norm; attention: SDPACoreAttention; specs: the spec functions; param_gather:
enable_nvfp4_param_gather (the distributed optimizer's param all-gather moving the NVFP4 linears' weights in NVFP4).
"""
from nvfp4_dist.parallel.megatron.compat import MEGATRON_CORE_VERSION, SUPPORTED_MEGATRON_CORE
from nvfp4_dist.parallel.megatron.adapters import (NVFP4ColumnParallelLinear, NVFP4LayerNormColumnParallelLinear,
                                                   NVFP4RowParallelLinear)
from nvfp4_dist.parallel.megatron.attention import SDPACoreAttention
from nvfp4_dist.parallel.megatron.mlp import NVFP4MLP
from nvfp4_dist.parallel.megatron.moe import NVFP4GroupedMLP, NVFP4MoELayer
from nvfp4_dist.parallel.megatron.norm import NVFP4Norm
from nvfp4_dist.parallel.megatron.param_gather import NVFP4ParamGather, enable_nvfp4_param_gather
from nvfp4_dist.parallel.megatron.specs import (bf16_layer_counts, get_gpt_decoder_block_nvfp4_spec,
                                                get_gpt_layer_nvfp4_spec, moe_layer_pattern, with_sdpa_attention,
                                                with_sequence_parallel_norm)

__all__ = ["MEGATRON_CORE_VERSION", "NVFP4ColumnParallelLinear", "NVFP4GroupedMLP",
           "NVFP4LayerNormColumnParallelLinear", "NVFP4MLP", "NVFP4MoELayer", "NVFP4Norm", "NVFP4ParamGather", "NVFP4RowParallelLinear",
           "SDPACoreAttention", "SUPPORTED_MEGATRON_CORE", "bf16_layer_counts", "enable_nvfp4_param_gather",
           "get_gpt_decoder_block_nvfp4_spec",
           "get_gpt_layer_nvfp4_spec", "moe_layer_pattern", "with_sdpa_attention", "with_sequence_parallel_norm"]
