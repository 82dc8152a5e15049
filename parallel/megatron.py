"""Megatron-Core integration: NVFP4 linears behind Megatron's linear-module contract, and layer specs.

A Megatron-Core user switches a GPT model to NVFP4 by changing its layer spec:

    from nvfp4_dist.parallel.megatron import get_gpt_layer_nvfp4_spec
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_nvfp4_spec(), ...)

or, to keep the first N / last M transformer layers in BF16,

    spec = get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=1, bf16_last_layers=1)

The adapters take the constructor arguments Megatron-Core passes to linear_qkv, linear_proj,
linear_fc1 and linear_fc2 (megatron-core 0.16 to 0.19) and return (output, bias) like Megatron's
own local ColumnParallelLinear / RowParallelLinear; their state dicts and sharded state dicts have
the same keys and shard layout, so checkpoints move between the two.

Weights are initialised from the FULL weight (Megatron's use_cpu_initialization semantics) on the
device the config asks for, with the default RNG, so a TP=N model equals the TP=1 model. With
stride > 1 (GLU fc1: each rank holds [gate shard | up shard]) the shards are Megatron's strided ones.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.package_info import __version__ as MEGATRON_CORE_VERSION
    from megatron.core.tensor_parallel import layers as megatron_layers
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from megatron.core.utils import get_pg_size, get_tensor_model_parallel_group_if_none
except ImportError as error:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "nvfp4_dist.parallel.megatron needs megatron-core (0.16 to 0.19): "
        "pip install nvfp4-dist[megatron]") from error

from ..recipe import NVFP4Recipe
from .layers import ColumnParallelLinear, RowParallelLinear
from .norm import SequenceParallelNorm

logger = logging.getLogger("nvfp4_dist")

SUPPORTED_MEGATRON_CORE = ("0.16", "0.19")

_MEGATRON_NORMS: tuple = (WrappedTorchNorm,)
try:  # Megatron's local spec picks apex's FusedLayerNorm when apex is installed.
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    _MEGATRON_NORMS += (FusedLayerNorm,)
except ImportError:  # pragma: no cover
    pass

# Submodule fields of Megatron's attention / MLP submodule dataclasses that hold the linears.
_LINEAR_FIELDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


if not (_version_tuple(SUPPORTED_MEGATRON_CORE[0]) <= _version_tuple(MEGATRON_CORE_VERSION)
        <= _version_tuple(SUPPORTED_MEGATRON_CORE[1])):
    logger.warning("megatron-core %s is outside the tested range %s to %s", MEGATRON_CORE_VERSION,
                   *SUPPORTED_MEGATRON_CORE)


# ----------------------------------------------------------------------------------------------
# Helpers shared by the two adapters
# ----------------------------------------------------------------------------------------------
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


def _layer_device(config) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


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


def _log_unknown_kwargs(layer: str, kwargs: dict) -> None:
    if kwargs:
        logger.debug("%s: ignoring Megatron keyword arguments %s", layer, sorted(kwargs))


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

    def forward(self, input_: torch.Tensor):
        self.keep_quantized_weight = self.is_first_microbatch is not None
        if self.is_first_microbatch is not False:
            self.invalidate_weight_cache()
        if self.is_first_microbatch:
            self.is_first_microbatch = False
        return super().forward(input_)

    @staticmethod
    def _layer_options(config, init_method, partition_dim: int, stride: int, tp_size: int, master,
                       recipe, bf16_fallback: bool) -> dict:
        """The parallel layer's keyword arguments that follow Megatron's config."""
        return dict(init_method=_full_weight_init(init_method, config.perform_initialization, partition_dim, stride,
                                                  tp_size, master),
                    recipe=recipe, params_dtype=config.params_dtype, device=_layer_device(config),
                    bf16_fallback=bf16_fallback, accumulate_into_main_grad=bool(config.gradient_accumulation_fusion),
                    delay_wgrad=bool(getattr(config, "delay_wgrad_compute", False)))

    def _adopt_megatron_attributes(self, config, *, input_size: int, output_size: int, is_expert: bool,
                                   stride: int, name, tp_comm_buffer_name, master) -> None:
        """Megatron's layer attributes, parameter flags, zero bias and _extra_state loading hook."""
        self.config = config
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


# ----------------------------------------------------------------------------------------------
# Adapters
# ----------------------------------------------------------------------------------------------
class NVFP4ColumnParallelLinear(_MegatronLinearContract, ColumnParallelLinear):
    """NVFP4 ColumnParallelLinear with the constructor and forward of Megatron-Core's.

    forward(input_, weight=None, runtime_gather_output=None) -> (output, bias or None).
    Extra keywords (besides Megatron's): recipe (NVFP4Recipe or None: autocast/environment),
    bf16_fallback (run this layer in BF16). Unknown keywords from newer Megatron are accepted.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable,
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer=None,
                 grad_output_buffer=None, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, disable_grad_reduce: bool = False,
                 tp_group=None, name: Optional[str] = None, recipe: Optional[NVFP4Recipe] = None,
                 bf16_fallback: bool = False, **future_kwargs):
        _check_megatron_only_options(
            type(self).__name__, skip_weight_param_allocation=skip_weight_param_allocation,
            embedding_activation_buffer=embedding_activation_buffer,
            grad_output_buffer=grad_output_buffer, disable_grad_reduce=disable_grad_reduce)
        _log_unknown_kwargs(type(self).__name__, future_kwargs)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        tp_size = get_pg_size(tp_group)
        _check_explicit_expert_comm(type(self).__name__, config, is_expert, tp_size)
        sequence_parallel = bool(config.sequence_parallel) and tp_size > 1
        master = [] if keep_master_weight_for_test else None
        super().__init__(
            input_size, output_size, bias=bias, tp_group=tp_group,
            sequence_parallel=sequence_parallel, gather_output=gather_output, skip_bias_add=skip_bias_add,
            **self._layer_options(config, init_method, 0, stride, tp_size, master, recipe, bf16_fallback))
        self._adopt_megatron_attributes(config, input_size=input_size, output_size=output_size, is_expert=is_expert,
                                        stride=stride, name=name, tp_comm_buffer_name=tp_comm_buffer_name,
                                        master=master)
        self.output_size_per_partition = output_size // tp_size
        if self.bias is not None:
            self.bias.partition_stride = stride

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


class NVFP4RowParallelLinear(_MegatronLinearContract, RowParallelLinear):
    """NVFP4 RowParallelLinear with the constructor and forward of Megatron-Core's.

    forward(input_) -> (output, bias or None). The bias is not sharded; under sequence parallelism it
    is marked `sequence_parallel` so Megatron all-reduces its gradient over the TP group.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable,
                 bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False,
                 stride: int = 1, keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, name: Optional[str] = None,
                 recipe: Optional[NVFP4Recipe] = None, bf16_fallback: bool = False,
                 **future_kwargs):
        _log_unknown_kwargs(type(self).__name__, future_kwargs)
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
                                        master=master)
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


class NVFP4Norm(SequenceParallelNorm):
    """Megatron's norm-builder signature (config, hidden_size, eps) over SequenceParallelNorm.

    Follows config.normalization (LayerNorm | RMSNorm), config.layernorm_zero_centered_gamma,
    config.sequence_parallel and config.params_dtype; the device follows use_cpu_initialization.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: Optional[str] = None, **future_kwargs):
        _log_unknown_kwargs(type(self).__name__, future_kwargs)
        super().__init__(
            hidden_size, eps, normalization=config.normalization,
            sequence_parallel=bool(config.sequence_parallel),
            zero_centered_gamma=bool(config.layernorm_zero_centered_gamma or zero_centered_gamma),
            params_dtype=config.params_dtype, device=_layer_device(config))


class SDPACoreAttention(torch.nn.Module):
    """Megatron core_attention on torch's scaled_dot_product_attention (flash / memory-efficient kernels).

    Megatron's local DotProductAttention materialises the [b, heads, s, s] scores; this one does not,
    which keeps attention from dominating memory without Transformer Engine. Causal self-attention
    (attn_mask_type causal) ignores attention_mask, like Transformer Engine's; other mask types use it
    (True = masked out). Grouped-query attention is supported; context parallelism, packed sequences
    and attention bias are not.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **future_kwargs):
        super().__init__()
        _log_unknown_kwargs(type(self).__name__, future_kwargs)
        if config.context_parallel_size != 1:
            raise ValueError(f"SDPACoreAttention: context_parallel_size={config.context_parallel_size}; "
                             "allowed: 1")
        from megatron.core.transformer.enums import AttnMaskType
        self.config = config
        self.causal = attn_mask_type == AttnMaskType.causal
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: attention_bias and packed_seq_params are not supported; "
                             "allowed: None")
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != q.shape[1]:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        mask = None if (self.causal or attention_mask is None) else attention_mask.logical_not()
        dropout = self.dropout if self.training else 0.0
        if dropout > 0 and q.is_cuda:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
            with get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     is_causal=self.causal, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=self.causal, scale=self.softmax_scale)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


# ----------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------
def _swap_submodules(spec, replacements: Callable[[str, Any], Any]):
    """Copy of a Megatron spec tree with `replacements(field, value)` applied to every submodule field.

    Handles the spec forms Megatron uses: ModuleSpec (0.16, 0.19), functools.partial with a
    `submodules` keyword (0.19's MLP builders), the *Submodules dataclasses and lists of layer specs.
    """
    if isinstance(spec, list):
        swapped = [_swap_submodules(item, replacements) for item in spec]
        return spec if all(a is b for a, b in zip(swapped, spec)) else swapped
    if isinstance(spec, ModuleSpec):
        if spec.submodules is None:
            return spec
        return dataclasses.replace(spec, submodules=_swap_submodules(spec.submodules, replacements))
    if isinstance(spec, functools.partial) and "submodules" in spec.keywords:
        keywords = dict(spec.keywords, submodules=_swap_submodules(spec.keywords["submodules"], replacements))
        return functools.partial(spec.func, *spec.args, **keywords)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            new_value = replacements(field.name, value)
            if new_value is value:
                new_value = _swap_submodules(value, replacements)
            if new_value is not value:
                changes[field.name] = new_value
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec


def _nvfp4_replacements(recipe: Optional[NVFP4Recipe], bf16: bool) -> Callable[[str, Any], Any]:
    params = {"recipe": recipe, "bf16_fallback": bf16}
    column = ModuleSpec(module=NVFP4ColumnParallelLinear, params=params)
    row = ModuleSpec(module=NVFP4RowParallelLinear, params=params)

    def replace(field: str, value):
        if field in _LINEAR_FIELDS and value is megatron_layers.ColumnParallelLinear:
            return column
        if field in _LINEAR_FIELDS and value is megatron_layers.RowParallelLinear:
            return row
        if isinstance(value, type) and issubclass(value, _MEGATRON_NORMS):
            return NVFP4Norm
        return value

    return replace


def with_sdpa_attention(spec):
    """Any Megatron spec (layer or block) with DotProductAttention replaced by SDPACoreAttention."""
    def replace(field: str, value):
        return SDPACoreAttention if field == "core_attention" and value is DotProductAttention else value
    return _swap_submodules(spec, replace)


def with_sequence_parallel_norm(spec):
    """Any Megatron spec with its local norms replaced by NVFP4Norm (which supports sequence parallelism)."""
    def replace(field: str, value):
        return NVFP4Norm if isinstance(value, type) and issubclass(value, _MEGATRON_NORMS) else value
    return _swap_submodules(spec, replace)


def get_gpt_layer_nvfp4_spec(*, recipe: Optional[NVFP4Recipe] = None, bf16: bool = False,
                             sdpa_attention: bool = False, **local_spec_kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec with linear_qkv/proj/fc1/fc2 in NVFP4 and SP-capable norms.

    local_spec_kwargs go to Megatron's get_gpt_layer_local_spec (num_experts, qk_layernorm,
    normalization, ...). recipe: per-layer NVFP4Recipe (None: nvfp4_dist.autocast, then environment).
    bf16: build the same layer with the adapters in their BF16 fallback.
    sdpa_attention: use SDPACoreAttention instead of Megatron's DotProductAttention.
    With sequence parallelism use get_gpt_decoder_block_nvfp4_spec: given a layer spec, GPTModel
    builds the final norm from Megatron's local norm, which refuses sequence parallelism.
    """
    spec = _swap_submodules(get_gpt_layer_local_spec(**local_spec_kwargs), _nvfp4_replacements(recipe, bf16))
    return with_sdpa_attention(spec) if sdpa_attention else spec


def bf16_layer_counts(config, recipe: Optional[NVFP4Recipe] = None,
                      bf16_first_layers: Optional[int] = None,
                      bf16_last_layers: Optional[int] = None) -> tuple[int, int]:
    """(first, last) transformer layers to keep in BF16.

    Explicit arguments win; then Megatron's config.first_last_layers_bf16 with
    num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16; then the recipe (or
    NVFP4Recipe.from_env(), e.g. NVFP4_BF16_FIRST_LAYERS).
    """
    if getattr(config, "first_last_layers_bf16", False):
        first, last = config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16
    else:
        resolved = recipe if recipe is not None else NVFP4Recipe.from_env()
        first, last = resolved.bf16_first_layers, resolved.bf16_last_layers
    first = first if bf16_first_layers is None else bf16_first_layers
    last = last if bf16_last_layers is None else bf16_last_layers
    for name, value in (("bf16_first_layers", first), ("bf16_last_layers", last)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r}: must be an integer >= 0")
    return first, last


def get_gpt_decoder_block_nvfp4_spec(config, *, recipe: Optional[NVFP4Recipe] = None,
                                     bf16_first_layers: Optional[int] = None,
                                     bf16_last_layers: Optional[int] = None,
                                     sdpa_attention: bool = False, vp_stage: Optional[int] = None,
                                     pp_rank: Optional[int] = None,
                                     **local_spec_kwargs) -> TransformerBlockSubmodules:
    """Decoder-block spec: NVFP4 layers except the first/last ones (see bf16_layer_counts) in BF16.

    Pass it to GPTModel(transformer_layer_spec=...). Only this pipeline stage's layers are listed
    (vp_stage / pp_rank as in Megatron's get_gpt_decoder_block_spec). local_spec_kwargs default to
    the config's normalization, qk_layernorm and multi_latent_attention. sdpa_attention: see
    get_gpt_layer_nvfp4_spec.
    """
    if getattr(config, "num_moe_experts", None):
        raise ValueError(f"config.num_moe_experts={config.num_moe_experts}: the block builder is for "
                         "dense GPT models; build MoE layers with get_gpt_layer_nvfp4_spec(num_experts=...)")
    first, last = bf16_layer_counts(config, recipe, bf16_first_layers, bf16_last_layers)
    local_spec_kwargs.setdefault("normalization", config.normalization)
    local_spec_kwargs.setdefault("qk_layernorm", config.qk_layernorm)
    local_spec_kwargs.setdefault("multi_latent_attention", config.multi_latent_attention)
    nvfp4_layer = get_gpt_layer_nvfp4_spec(recipe=recipe, sdpa_attention=sdpa_attention, **local_spec_kwargs)
    bf16_layer = get_gpt_layer_nvfp4_spec(recipe=recipe, bf16=True, sdpa_attention=sdpa_attention,
                                          **local_spec_kwargs)
    num_layers = config.num_layers
    layer_specs = [bf16_layer if (index < first or index >= num_layers - last) else nvfp4_layer
                   for index in range(num_layers)]
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType
        local_ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = [layer_specs[index] for index in local_ids]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = layer_specs[offset:offset + count]
    logger.info("NVFP4 decoder block: %d layers, first %d and last %d in BF16", num_layers, first, last)
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=NVFP4Norm)


__all__ = ["MEGATRON_CORE_VERSION", "NVFP4ColumnParallelLinear", "NVFP4Norm", "NVFP4RowParallelLinear",
           "SDPACoreAttention", "bf16_layer_counts", "get_gpt_decoder_block_nvfp4_spec", "get_gpt_layer_nvfp4_spec",
           "with_sdpa_attention", "with_sequence_parallel_norm"]
