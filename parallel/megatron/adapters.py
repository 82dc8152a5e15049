"""NVFP4 linears behind Megatron-Core's linear-module contract.

The adapters take the constructor arguments Megatron-Core passes to linear_qkv, linear_proj,
linear_fc1 and linear_fc2 (megatron-core 0.16 to 0.19) and return (output, bias) like Megatron's
own local ColumnParallelLinear / RowParallelLinear; their state dicts and sharded state dicts have
the same keys and shard layout, so checkpoints move between the two.

Weights are initialised from the FULL weight (Megatron's use_cpu_initialization semantics) on the
device the config asks for, with the default RNG, so a TP=N model equals the TP=1 model. With
stride > 1 (GLU fc1: each rank holds [gate shard | up shard]) the shards are Megatron's strided ones.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from megatron.core import parallel_state
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_size, get_tensor_model_parallel_group_if_none

from nvfp4_dist.parallel.layers import ColumnParallelLinear, RowParallelLinear
from nvfp4_dist.parallel.megatron.compat import layer_device, log_unknown_kwargs
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap


def _strided_order(full: torch.Tensor, partition_dim: int, stride: int, tp_size: int) -> torch.Tensor:
    """Reorder `full` so that its contiguous TP shard r is Megatron's strided shard r.

    Megatron splits the weight along partition_dim into stride * tp_size chunks and gives rank r the
    chunks r, r + tp, r + 2 tp, ... concatenated (so with stride 2 a GLU fc1 rank holds [gate | up]).
    """
    chunk = full.shape[partition_dim] // (stride * tp_size)
    chunks = torch.split(full, chunk, dim=partition_dim)
    return torch.cat([chunks[rank + tp_size * j] for rank in range(tp_size) for j in range(stride)],
                     dim=partition_dim)


def _full_weight_init(init_method: Callable, perform_initialization: bool, partition_dim: int,
                      stride: int, tp_size: int, keep_master: Optional[list]) -> Callable:
    """The init_method the parallel layers call on the full weight, following Megatron's conventions."""

    @torch.no_grad()
    def initialize(full_weight: torch.Tensor) -> None:
        if not perform_initialization:
            return
        master = torch.empty(full_weight.shape, dtype=torch.float32, device=full_weight.device)
        init_method(master)
        if keep_master is not None:
            keep_master.append(master.clone())
        if stride > 1:
            master = _strided_order(master, partition_dim, stride, tp_size)
        full_weight.copy_(master)

    return initialize


def _uses_expert_groups(config, is_expert: bool) -> bool:
    """Megatron's rule for parameters reduced over the expert data-parallel group (allreduce=False)."""
    if not is_expert:
        return False
    expert_tp = getattr(config, "expert_tensor_parallel_size", None)
    return config.expert_model_parallel_size > 1 or (
        expert_tp is not None and expert_tp != config.tensor_model_parallel_size)


def _check_megatron_only_options(layer: str, **options) -> None:
    """Reject Megatron options that the NVFP4 adapters do not implement (they must keep defaults)."""
    for name, value in options.items():
        if value:
            raise ValueError(f"{layer}: {name}={value!r} is not supported by the NVFP4 adapters; "
                             f"allowed: the default (False/None). Keep Megatron's own layer for this module.")


def _sharded_state_dict(module: torch.nn.Module, prefix: str, sharded_offsets, metadata,
                        tp_axis_map: dict) -> dict:
    dp_cp_group = (metadata or {}).get("dp_cp_group")
    if dp_cp_group is None:
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    state_dict = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state_dict, prefix, tp_axis_map, sharded_offsets,
                                               tp_group=module.tp_group, dp_cp_group=dp_cp_group)


def _default_extra_state_hook(state_dict, prefix, *args, **kwargs):
    """Like Megatron's local layers: checkpoints without _extra_state load too."""
    state_dict.setdefault(f"{prefix}_extra_state")


class _MegatronLinearContract:
    """Megatron's _extra_state / first-micro-batch protocols shared by both adapters."""

    # Megatron's optimizers write parameters through `.data` (no autograd version bump), so the
    # weight cache cannot see the update. Like Transformer Engine's layers, requantize the weight at
    # each step's first micro-batch when Megatron's schedules flag it (set_is_first_microbatch), and at
    # every forward when nothing flags it (None: Megatron flags it only with config.fp8/fp4). Requantized
    # every forward, the weight is not kept between forward and backward (keep_quantized_weight).
    is_first_microbatch = None

    def forward(self, input_: torch.Tensor, **layer_kwargs):
        self.keep_quantized_weight = self.is_first_microbatch is not None
        if self.is_first_microbatch is not False:
            self.invalidate_weight_cache()
        if self.is_first_microbatch:
            self.is_first_microbatch = False
        return super().forward(input_, **layer_kwargs)

    @staticmethod
    def _layer_options(config, init_method, partition_dim: int, stride: int, tp_size: int, master,
                       recipe, bf16_fallback: bool) -> dict:
        """The parallel layer's keyword arguments that follow Megatron's config."""
        return dict(init_method=_full_weight_init(init_method, config.perform_initialization, partition_dim, stride,
                                                  tp_size, master),
                    recipe=recipe, params_dtype=config.params_dtype, device=layer_device(config),
                    bf16_fallback=bf16_fallback, accumulate_into_main_grad=bool(config.gradient_accumulation_fusion),
                    delay_wgrad=bool(getattr(config, "delay_wgrad_compute", False)))

    def _adopt_megatron_attributes(self, config, *, input_size: int, output_size: int, is_expert: bool,
                                   stride: int, name, tp_comm_buffer_name, master, layer_name) -> None:
        """Megatron's layer attributes, parameter flags, zero bias and _extra_state loading hook."""
        self.config = config
        self.layer_name = layer_name
        self.input_size = input_size
        self.output_size = output_size
        self.is_expert = is_expert
        self.stride = stride
        self.name = name
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.master_weight = master[0] if master else None
        reduce_over_dp = not _uses_expert_groups(config, is_expert)
        self.weight.partition_stride = stride
        self.weight.allreduce = reduce_over_dp
        if self.bias is not None:
            self.bias.allreduce = reduce_over_dp
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
        self._register_load_state_dict_pre_hook(_default_extra_state_hook)

    def get_extra_state(self) -> None:
        """No extra state (as Megatron's local layers); the key exists for TE-spec compatibility."""
        return None

    def set_extra_state(self, state: Any) -> None:
        """Extra state from any checkpoint (local or TE layers) is ignored."""


class NVFP4ColumnParallelLinear(_MegatronLinearContract, ColumnParallelLinear):
    """NVFP4 ColumnParallelLinear with the constructor and forward of Megatron-Core's.

    forward(input_, weight=None, runtime_gather_output=None) -> (output, bias or None).
    Extra keywords (besides Megatron's): recipe (NVFP4Recipe, RecipeMap, or None: autocast/environment),
    bf16_fallback (run this layer in BF16), layer_name (the module name recipe maps match; the specs pass
    "decoder.layers.<n>.<submodule path>"). Unknown keywords from newer Megatron are accepted.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable,
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer=None,
                 grad_output_buffer=None, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, disable_grad_reduce: bool = False,
                 tp_group=None, name: Optional[str] = None,
                 recipe: Optional[Union[NVFP4Recipe, RecipeMap]] = None, bf16_fallback: bool = False,
                 layer_name: Optional[str] = None, **future_kwargs):
        _check_megatron_only_options(
            type(self).__name__, skip_weight_param_allocation=skip_weight_param_allocation,
            embedding_activation_buffer=embedding_activation_buffer,
            grad_output_buffer=grad_output_buffer, disable_grad_reduce=disable_grad_reduce)
        log_unknown_kwargs(type(self).__name__, future_kwargs)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        tp_size = get_pg_size(tp_group)
        _check_explicit_expert_comm(type(self).__name__, config, is_expert, tp_size)
        sequence_parallel = bool(config.sequence_parallel) and tp_size > 1
        master = [] if keep_master_weight_for_test else None
        super().__init__(
            input_size, output_size, bias=bias, tp_group=tp_group,
            sequence_parallel=sequence_parallel, gather_output=gather_output, skip_bias_add=skip_bias_add,
            **self._layer_options(config, init_method, 0, stride, tp_size, master, recipe, bf16_fallback),
            **self._input_norm_options(config))
        self._adopt_megatron_attributes(config, input_size=input_size, output_size=output_size, is_expert=is_expert,
                                        stride=stride, name=name, tp_comm_buffer_name=tp_comm_buffer_name,
                                        master=master, layer_name=layer_name)
        self.output_size_per_partition = output_size // tp_size
        if self.bias is not None:
            self.bias.partition_stride = stride

    @staticmethod
    def _input_norm_options(config) -> dict:
        """ColumnParallelLinear's input-norm keywords: none here (see NVFP4LayerNormColumnParallelLinear)."""
        return {}

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if weight is not None:
            raise ValueError(f"{type(self).__name__}.forward: weight= (an externally supplied weight) "
                             "is not supported; allowed: None (the layer's own weight)")
        if runtime_gather_output is None or runtime_gather_output == self.gather_output:
            return super().forward(input_)
        configured, self.gather_output = self.gather_output, runtime_gather_output
        try:
            return super().forward(input_)
        finally:
            self.gather_output = configured

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Weight and bias sharded along dim 0 over TP, like Megatron's ColumnParallelLinear."""
        return _sharded_state_dict(self, prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.output_size // self.output_size_per_partition}, "
                f"sequence_parallel={self.sequence_parallel}, bf16_fallback={self.bf16_fallback}")


class NVFP4LayerNormColumnParallelLinear(NVFP4ColumnParallelLinear):
    """NVFP4ColumnParallelLinear with the layer's norm inside (TE's TELayerNormColumnParallelLinear), for
    linear_qkv and linear_fc1 behind an IdentityOp input_layernorm / pre_mlp_layernorm: the norm
    (config.normalization, layernorm_epsilon, layernorm_zero_centered_gamma) is fused into the cast of the
    linear's input where recipe.fused_producers allows. Its parameters layer_norm_weight / layer_norm_bias are
    replicated (the checkpoint keys Megatron maps the local spec's norms to) and marked sequence_parallel
    under SP, so Megatron all-reduces their gradients over the TP group.
    """

    @staticmethod
    def _input_norm_options(config) -> dict:
        if getattr(config, "apply_residual_connection_post_layernorm", False):
            raise ValueError("config.apply_residual_connection_post_layernorm=True: the residual would take the "
                             "norm's output, which this layer keeps inside; build the spec with fused_producers=False")
        return dict(input_norm=config.normalization, norm_eps=config.layernorm_epsilon,
                    zero_centered_gamma=bool(config.layernorm_zero_centered_gamma))


class NVFP4RowParallelLinear(_MegatronLinearContract, RowParallelLinear):
    """NVFP4 RowParallelLinear with the constructor and forward of Megatron-Core's.

    forward(input_, activation=None) -> (output, bias or None); activation (NVFP4MLP): input_ is fc1's output and
    the layer applies the activation, fused into its input's cast. The bias is not sharded; under sequence
    parallelism it is marked `sequence_parallel` so Megatron all-reduces its gradient over the TP group.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable,
                 bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False,
                 stride: int = 1, keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, name: Optional[str] = None,
                 recipe: Optional[Union[NVFP4Recipe, RecipeMap]] = None, bf16_fallback: bool = False,
                 layer_name: Optional[str] = None, **future_kwargs):
        log_unknown_kwargs(type(self).__name__, future_kwargs)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        tp_size = get_pg_size(tp_group)
        _check_explicit_expert_comm(type(self).__name__, config, is_expert, tp_size)
        sequence_parallel = bool(config.sequence_parallel) and tp_size > 1
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{type(self).__name__}: input_is_parallel=False with "
                             "config.sequence_parallel=True; sequence parallelism needs input_is_parallel=True")
        master = [] if keep_master_weight_for_test else None
        super().__init__(
            input_size, output_size, bias=bias, tp_group=tp_group,
            sequence_parallel=sequence_parallel, input_is_parallel=input_is_parallel,
            skip_bias_add=skip_bias_add,
            **self._layer_options(config, init_method, 1, stride, tp_size, master, recipe, bf16_fallback))
        self._adopt_megatron_attributes(config, input_size=input_size, output_size=output_size, is_expert=is_expert,
                                        stride=stride, name=name, tp_comm_buffer_name=tp_comm_buffer_name,
                                        master=master, layer_name=layer_name)
        self.input_size_per_partition = input_size // tp_size
        self.input_is_parallel = input_is_parallel
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Weight sharded along dim 1 over TP; bias replicated, like Megatron's RowParallelLinear."""
        return _sharded_state_dict(self, prefix, sharded_offsets, metadata, {"weight": 1})

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.input_size // self.input_size_per_partition}, "
                f"sequence_parallel={self.sequence_parallel}, bf16_fallback={self.bf16_fallback}")


def _check_explicit_expert_comm(layer: str, config, is_expert: bool, tp_size: int) -> None:
    """Expert layers whose token dispatcher does the TP communication are supported only at expert TP=1.

    (At expert-TP 1 the layer has nothing to communicate, which is what the dispatcher expects.)
    """
    if is_expert and tp_size > 1:
        raise ValueError(f"{layer}: is_expert=True with expert tensor-parallel size {tp_size}; the NVFP4 "
                         "adapters support MoE experts only at expert_tensor_parallel_size=1")
