"""ColumnParallelLinear and RowParallelLinear in NVFP4 with tensor and sequence parallelism (docs/numerics.md §9).

Same arguments and return convention as Megatron-Core's layers: forward(x) -> (output, bias or None).
Activations are [s, b, h] (or any [..., h]); sequence parallelism shards dim 0.

Column-parallel, weight [out/tp, in]:
  forward   x_local -> amax all-reduce (SP) -> quantize -> NVFP4 all-gather (SP) -> fprop -> [s, b, out/tp]
  backward  dgrad -> BF16 reduce-scatter (SP) / all-reduce; wgrad from the columnwise copies, the input's
            gathered again in NVFP4 (default) or kept from forward (keep_input_columnwise=True)
Row-parallel, weight [out, in/tp]:
  forward   fprop -> BF16 reduce-scatter (SP) / all-reduce -> + bias
  backward  dy_local -> amax all-reduce -> quantize (SR) -> NVFP4 all-gather (SP) -> dgrad and wgrad
With recipe.backward_mode high_precision or dequantized the backward GEMMs run in the compute dtype on the
unquantized output gradient (gathered as it is under row-parallel SP) and the input and weight as given or as
fprop's NVFP4 copies dequantized (nvfp4_dist/linear.py).
A column-parallel layer may normalize its input first (input_norm) and a row-parallel one apply fc1's activation
(forward(x, activation=...)); each producer is fused into the cast of the layer's input (nvfp4_dist/fused.py).

Stochastic rounding of a sharded gradient uses the same seed on every rank (drawn from torch's CPU
generator: ranks must share torch.manual_seed) and this rank's row offset, so the gathered gradient
equals quantizing the full gradient byte for byte.

The first call of each layer (every call with NVFP4_CHECK_TP_CONSISTENCY=1) compares its configuration, recipe
and input across the group (parallel/group_checks.py), so that ranks that disagree raise on every rank instead
of hanging or aborting in a collective. An empty input (no tokens, as MoE routing makes) runs the BF16 path:
an empty output and zero weight gradients, as torch.nn.Linear gives.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nvfp4_dist import environment
from nvfp4_dist.autocast import nvfp4_enabled, resolve_layer_recipe
from nvfp4_dist.layernorm_linear import ActivationProducer, NormProducer, produced_linear
from nvfp4_dist.linear import (LinearComm, WeightCache, WeightParameter, bf16_linear, check_activation,
                               check_features, check_parameter_dtype, check_weight_dtype, describe_layer,
                               needs_columnwise_weight, nvfp4_linear, quantize_weight)
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap, check_layer_recipe
from nvfp4_dist.reference.fused_producers import ACTIVATIONS, NORMALIZATIONS
from nvfp4_dist.parallel import collectives, group_checks
from nvfp4_dist.parallel.overlap import overlapped_comm
from nvfp4_dist.parallel.layer_comm import ColumnParallelComm, RowParallelComm


def default_init_method(weight: torch.Tensor) -> None:
    """torch.nn.Linear's weight initialisation, applied to the full weight."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def resolve_group(tp_group):
    """tp_group, else the world group when torch.distributed is initialised, else None (TP=1)."""
    if tp_group is not None:
        return tp_group
    return dist.group.WORLD if dist.is_initialized() else None


# ----------------------------------------------------------------------------------------------------------
# BF16 region mappings (Megatron-Core tensor_parallel/mappings.py), for the BF16 fallback and the
# gather_output / input_is_parallel=False options.

def _region_mapping(name: str, forward_op, backward_op) -> type:
    """An autograd Function of (x, group): forward_op(x, group) forward, backward_op(dy, group) backward."""

    def forward(ctx, x, group):
        ctx.group = group
        return forward_op(x, group)

    def backward(ctx, dy):
        return backward_op(dy, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward),
                                                   "__doc__": f"Forward: {forward_op.__doc__} Backward: "
                                                              f"{backward_op.__doc__}"})


def _identity(x, group):
    """identity."""
    return x


def _all_reduce(x, group):
    """all-reduce (sum)."""
    return collectives.all_reduce_bf16(x.clone(), group)


def _all_gather(x, group):
    """all-gather along dim 0."""
    return collectives.all_gather_bf16(x, group)


def _reduce_scatter(x, group):
    """reduce-scatter along dim 0."""
    return collectives.reduce_scatter_bf16(x, group)


def _split_last_dim(x, group):
    """keep this rank's slice of the last dim."""
    return collectives.split_last_dim(x, group)


def _all_gather_last_dim(x, group):
    """all-gather along the last dim."""
    return collectives.all_gather_last_dim(x, group)


_CopyToTensorParallelRegion = _region_mapping("_CopyToTensorParallelRegion", _identity, _all_reduce)
_ReduceFromTensorParallelRegion = _region_mapping("_ReduceFromTensorParallelRegion", _all_reduce, _identity)
_GatherFromSequenceParallelRegion = _region_mapping("_GatherFromSequenceParallelRegion", _all_gather, _reduce_scatter)
_ReduceScatterToSequenceParallelRegion = _region_mapping("_ReduceScatterToSequenceParallelRegion", _reduce_scatter,
                                                         _all_gather)
_ScatterToTensorParallelRegion = _region_mapping("_ScatterToTensorParallelRegion", _split_last_dim,
                                                 _all_gather_last_dim)
_GatherFromTensorParallelRegion = _region_mapping("_GatherFromTensorParallelRegion", _all_gather_last_dim,
                                                  _split_last_dim)


# ----------------------------------------------------------------------------------------------------------

class _ParallelLinear(torch.nn.Module):
    """Parameters, weight cache, recipe and wgrad hooks shared by the column- and row-parallel layers.

    keep_quantized_weight: reuse the quantized weight across forwards while the parameter is unchanged
    (WeightCache). False: quantize its rowwise copy at each forward and its columnwise copy in backward,
    holding no copy in between (less memory; for callers that requantize every forward anyway).
    recipe: an NVFP4Recipe, or a RecipeMap matched against layer_name (nvfp4_dist/recipe_map.py); None: the
      enclosing nvfp4_dist.autocast's (its recipes= map, then its recipe), else from the environment.
    layer_name: the module name that recipe maps match, and the layer in error messages (nvfp4_dist.name_layers
      sets it; default: None, shown as class and sizes).
    last_recipe: the NVFP4Recipe the last forward ran with; None when it ran in BF16.
    """

    keep_quantized_weight = True

    def __init__(self, in_features, out_features, *, bias, tp_group, sequence_parallel, skip_bias_add,
                 init_method, recipe, params_dtype, device, bf16_fallback, accumulate_into_main_grad, delay_wgrad,
                 partition_dim):
        super().__init__()
        check_layer_recipe(recipe)
        self.tp_group = resolve_group(tp_group)
        self.world_size, self.rank = collectives.group_size(self.tp_group), collectives.group_rank(self.tp_group)
        partitioned = out_features if partition_dim == 0 else in_features
        name = "out_features" if partition_dim == 0 else "in_features"
        if partitioned % self.world_size:
            raise ValueError(f"{name}={partitioned}: must be divisible by the tensor-parallel size {self.world_size}")
        self.in_features, self.out_features = in_features, out_features
        local_shape = [out_features, in_features]
        local_shape[partition_dim] //= self.world_size
        if not bf16_fallback:
            check_features("in_features per rank" if partition_dim else "in_features", local_shape[1])
            check_features("out_features per rank" if partition_dim == 0 else "out_features", local_shape[0])
            check_parameter_dtype(params_dtype)
        self.layer_name: str | None = None
        self.last_recipe: NVFP4Recipe | None = None
        self.consistency_checked = False  # whether the group compared this layer (check_group_consistency)
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.recipe, self.bf16_fallback = recipe, bf16_fallback
        self.accumulate_into_main_grad, self.delay_wgrad = accumulate_into_main_grad, delay_wgrad
        self.weight = WeightParameter(self._weight_shard(init_method or default_init_method, params_dtype, device,
                                                            partition_dim))
        for attribute, value in (("tensor_model_parallel", True), ("partition_dim", partition_dim),
                                 ("partition_stride", 1)):
            setattr(self.weight, attribute, value)
        self.weight_cache = WeightCache()
        self.wgrad_store: list = []

    def _weight_shard(self, init_method, dtype, device, partition_dim) -> torch.Tensor:
        """Every rank builds the full weight from the same RNG state and keeps its slice: TP=N equals TP=1."""
        full = torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)
        init_method(full)
        return full.chunk(self.world_size, dim=partition_dim)[self.rank].clone()

    def invalidate_weight_cache(self) -> None:
        """Force requantizing the weight at the next forward (after writes through weight.data)."""
        self.weight_cache.invalidate()

    def backward_dw(self) -> None:
        """Run the wgrad GEMMs that backward deferred (delay_wgrad=True), oldest first."""
        while self.wgrad_store:
            self.wgrad_store.pop(0)()

    def _linear(self, x, bias, comm: LinearComm, recipe: NVFP4Recipe | None, producer=None, reduce_amaxes=None):
        """The local NVFP4 linear with `recipe` (None: the BF16 fallback); comm is used on the NVFP4 path only.

        producer: x is a norm's or an activation's input (nvfp4_dist.layernorm_linear NormProducer /
        ActivationProducer) whose output is the linear's input: fused into its cast where the recipe allows
        (reduce_amaxes: the amax all-reduce between its passes), else formed first.
        """
        store = self.wgrad_store if self.delay_wgrad else None
        self.last_recipe = recipe
        if recipe is None:
            x = x if producer is None else producer.output(x)
            return bf16_linear(x, self.weight, bias, accumulate_into_main_grad=self.accumulate_into_main_grad,
                               wgrad_store=store)
        if recipe.overlap and self.world_size > 1:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{describe_layer(self)}: recipe.overlap=True cannot be captured in a CUDA graph (its "
                                   "pipeline measures link speeds and syncs streams on the host); capture with "
                                   "overlap=False, or run this layer eagerly")
            comm = self._overlapped(comm, recipe)
        if self.keep_quantized_weight:
            weight_q = self._cached_weight(recipe)
        else:  # requantized at every forward anyway: hold no copy between forward and backward
            self.weight_cache.invalidate()
            weight_q = quantize_weight(self.weight, recipe, columnwise=False)
        options = dict(weight_q=weight_q, comm=comm, accumulate_into_main_grad=self.accumulate_into_main_grad,
                       wgrad_store=store, requantize_weight_in_backward=not self.keep_quantized_weight,
                       layer_name=describe_layer(self))
        if producer is not None:
            return produced_linear(producer, x, self.weight, bias, recipe, reduce_amaxes=reduce_amaxes, **options)
        return nvfp4_linear(x, self.weight, bias, recipe, **options)

    def _cached_weight(self, recipe: NVFP4Recipe):
        """The weight quantized with `recipe` for this forward and its backward, from the cache if current."""
        return self.weight_cache.get(self.weight, recipe, columnwise=needs_columnwise_weight(recipe))

    def _overlapped(self, comm: LinearComm, recipe: NVFP4Recipe) -> LinearComm:
        """The pipelined twin of `comm` (recipe.overlap, docs/numerics.md §9 "Overlap"), built once; its minimum
        step size, transports and whether it weighs the measured link speed follow the recipe of each call."""
        self._overlapped_comm = overlapped_comm(getattr(self, "_overlapped_comm", None) or comm,
                                                recipe.overlap_min_chunk_gflops, recipe.overlap_measure_links,
                                                recipe.overlap_transport)
        return self._overlapped_comm

    def resolved_recipe(self) -> NVFP4Recipe | None:
        """The recipe a forward now runs with (nvfp4_dist/autocast.py has the order); None: the BF16 fallback
        (bf16_fallback, autocast(enabled=False), or a recipe map's "bf16" entry)."""
        if self.bf16_fallback or not nvfp4_enabled():
            return None
        return resolve_layer_recipe(self.recipe, self.layer_name, describe_layer(self))

    @staticmethod
    def _nvfp4_recipe(recipe: NVFP4Recipe | None, x: torch.Tensor) -> NVFP4Recipe | None:
        """The recipe of the NVFP4 path, or None for the BF16 path (also taken by inputs with no tokens)."""
        return recipe if x.numel() > 0 else None

    def _local_input_problem(self, x, in_features: int, recipe: NVFP4Recipe | None) -> str | None:
        """Why this rank cannot run x (wrong type, dtype, shape or device; an unsupported weight dtype), or None."""
        try:
            if recipe is not None:
                check_weight_dtype(self.weight)
            check_activation(x, in_features, self.weight)
            self._check_input_shape(x)
        except ValueError as error:
            return str(error)
        return None

    def _check_input_shape(self, x: torch.Tensor) -> None:
        """ValueError for an input shape this layer kind cannot take (beyond its last dim)."""

    def _options(self) -> list:
        """(name, kind, value) of the options, besides the common ones, that the ranks must share."""
        return []

    def check_group_consistency(self, x, in_features: int, recipe: NVFP4Recipe | None) -> None:
        """Validate x; at the first call (every call with NVFP4_CHECK_TP_CONSISTENCY=1) also compare this layer's
        configuration, recipe (this forward's, None for BF16) and input across the group, raising on every rank
        when they differ."""
        problem = self._local_input_problem(x, in_features, recipe)
        compare = self.world_size > 1 and (not self.consistency_checked or environment.CHECK_TP_CONSISTENCY.read())
        if compare and isinstance(x, torch.Tensor) and x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{describe_layer(self)}: the comparison of this layer across its group reads results "
                               "on the host and cannot run inside a CUDA graph capture: run the layer once eagerly "
                               "before capturing it (warm-up), and leave NVFP4_CHECK_TP_CONSISTENCY unset")
        if compare:
            self.consistency_checked = True
            group_checks.check_consistency(describe_layer(self), group_checks.layer_fields(self, x, recipe),
                                           self.tp_group, problem)
        if problem is not None:
            raise ValueError(problem)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split along its output dim (Megatron-Core's ColumnParallelLinear, NVFP4 GEMMs).

    sequence_parallel: x is [s/tp, b, in] and gathered along dim 0 (in NVFP4) before fprop.
    gather_output: all-gather the output along its last dim (BF16) to [.., out] (not with SP).
    keep_input_columnwise: keep the gathered input from forward instead of re-gathering it in backward (its
      columnwise copy; with recipe.backward_mode high_precision the input itself, dequantized its rowwise copy).
    input_norm: "LayerNorm" or "RMSNorm" over x before the linear (TE's LayerNormColumnParallelLinear), with
      parameters layer_norm_weight (and layer_norm_bias), replicated and marked `sequence_parallel` like
      parallel/norm.py's (their gradients are partial sums under SP: Megatron all-reduces them); norm_eps,
      zero_centered_gamma as there. The norm is fused into the input's cast where recipe.fused_producers allows
      (under SP the amax all-reduce between its passes, its copies into the NVFP4 all-gather).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, tp_group=None,
                 sequence_parallel: bool = False, gather_output: bool = False, skip_bias_add: bool = False,
                 init_method=None, recipe: NVFP4Recipe | RecipeMap | None = None,
                 params_dtype: torch.dtype = torch.float32, device=None, keep_input_columnwise: bool = False,
                 bf16_fallback: bool = False, accumulate_into_main_grad: bool = False, delay_wgrad: bool = False,
                 input_norm: str | None = None, norm_eps: float = 1e-5, zero_centered_gamma: bool = False):
        super().__init__(in_features, out_features, bias=bias, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         skip_bias_add=skip_bias_add, init_method=init_method, recipe=recipe,
                         params_dtype=params_dtype, device=device, bf16_fallback=bf16_fallback,
                         accumulate_into_main_grad=accumulate_into_main_grad, delay_wgrad=delay_wgrad, partition_dim=0)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True with sequence_parallel=True: not supported (as in Megatron-Core)")
        self.gather_output = gather_output
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features // self.world_size, dtype=params_dtype,
                                                       device=device))
            for attribute, value in (("tensor_model_parallel", True), ("partition_dim", 0), ("partition_stride", 1)):
                setattr(self.bias, attribute, value)
        else:
            self.register_parameter("bias", None)
        self._add_input_norm(input_norm, norm_eps, zero_centered_gamma, params_dtype, device)
        self.comm = ColumnParallelComm(self.tp_group, sequence_parallel, keep_input_columnwise)

    def _options(self):
        return [("gather_output", "int", self.gather_output),
                ("keep_input_columnwise", "int", self.comm.keep_input_columnwise),
                ("input_norm", "text", self.input_norm or "none"), ("norm_eps", "text", self.norm_eps),
                ("zero_centered_gamma", "int", self.zero_centered_gamma),
                *group_checks.parameter_fields("layer_norm_weight", getattr(self, "layer_norm_weight", None)),
                *group_checks.parameter_fields("layer_norm_bias", getattr(self, "layer_norm_bias", None))]

    def _add_input_norm(self, input_norm, eps, zero_centered_gamma, dtype, device) -> None:
        if input_norm is not None and input_norm not in NORMALIZATIONS:
            raise ValueError(f"input_norm={input_norm!r}: allowed values are None and {NORMALIZATIONS}")
        if input_norm is not None and (not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0):
            raise ValueError(f"norm_eps={eps!r}: must be a finite number > 0")
        self.input_norm, self.norm_eps, self.zero_centered_gamma = input_norm, float(eps), zero_centered_gamma
        if input_norm is None:
            return
        factory = dict(dtype=dtype, device=device)
        gamma = 0.0 if zero_centered_gamma else 1.0
        self.layer_norm_weight = torch.nn.Parameter(torch.full((self.in_features,), gamma, **factory))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(self.in_features, **factory))
                                if input_norm == "LayerNorm" else None)
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = self.sequence_parallel

    def input_producer(self, x: torch.Tensor) -> NormProducer | None:
        """The input norm for input x (its parameters as it computes with them), or None without one."""
        if self.input_norm is None:
            return None
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        bias = None if self.layer_norm_bias is None else self.layer_norm_bias.to(x.dtype)
        return NormProducer(weight.to(x.dtype), bias, self.input_norm, self.norm_eps)

    def _input_amax_reduction(self):
        """The all-reduce of the input's amaxes under SP (the gathered copies share one scale, docs/numerics.md §9)."""
        if not (self.sequence_parallel and self.world_size > 1):
            return None
        return lambda amaxes: collectives.all_reduce_amax(amaxes, self.tp_group)

    def forward(self, x: torch.Tensor):
        recipe = self.resolved_recipe()
        self.check_group_consistency(x, self.in_features, recipe)
        bias = None if self.skip_bias_add else self.bias
        producer = self.input_producer(x)
        recipe = self._nvfp4_recipe(recipe, x)
        if recipe is None:  # the NVFP4 path communicates inside its autograd Function
            if producer is not None:  # the norm on this rank's tokens, then the BF16 gather
                x, producer = producer.output(x), None
            if self.sequence_parallel:
                x = _GatherFromSequenceParallelRegion.apply(x, self.tp_group)
            elif self.world_size > 1:
                x = _CopyToTensorParallelRegion.apply(x, self.tp_group)
        y = self._linear(x, bias, self.comm, recipe, producer, self._input_amax_reduction())
        if self.gather_output and self.world_size > 1:
            y = _GatherFromTensorParallelRegion.apply(y, self.tp_group)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split along its input dim (Megatron-Core's RowParallelLinear, NVFP4 GEMMs).

    input_is_parallel: x is already split along its last dim (else it is split here).
    sequence_parallel: the output is reduce-scattered along dim 0 to [s/tp, b, out].
    The bias (full [out]) is added after the reduction, or returned unadded with skip_bias_add.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, tp_group=None,
                 sequence_parallel: bool = False, input_is_parallel: bool = True, skip_bias_add: bool = False,
                 init_method=None, recipe: NVFP4Recipe | RecipeMap | None = None,
                 params_dtype: torch.dtype = torch.float32, device=None, bf16_fallback: bool = False,
                 accumulate_into_main_grad: bool = False, delay_wgrad: bool = False):
        super().__init__(in_features, out_features, bias=bias, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         skip_bias_add=skip_bias_add, init_method=init_method, recipe=recipe,
                         params_dtype=params_dtype, device=device, bf16_fallback=bf16_fallback,
                         accumulate_into_main_grad=accumulate_into_main_grad, delay_wgrad=delay_wgrad, partition_dim=1)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (as in Megatron-Core)")
        self.input_is_parallel = input_is_parallel
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device))
            setattr(self.bias, "sequence_parallel", sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.comm = RowParallelComm(self.tp_group, sequence_parallel)

    def _options(self):
        return [("input_is_parallel", "int", self.input_is_parallel)]

    def _check_input_shape(self, x):
        if self.sequence_parallel and x.dim() >= 2 and x.shape[0] % self.world_size:
            raise ValueError(f"input.shape={tuple(x.shape)}: with sequence_parallel the first dim must be divisible "
                             f"by the tensor-parallel size {self.world_size}")

    def forward(self, x: torch.Tensor, *, activation: str | None = None):
        """activation: x is fc1's output and the layer's input its activation ("gelu", or "swiglu" of x = [gate | up],
        this rank's shards), fused into the input's cast where recipe.fused_producers allows."""
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: allowed values are None and {ACTIVATIONS}")
        widen = 2 if activation == "swiglu" else 1
        scatter = not self.input_is_parallel and self.world_size > 1
        if scatter and activation is not None:
            raise ValueError("activation with input_is_parallel=False: the activation takes this rank's shard of "
                             "fc1's output; pass input_is_parallel=True")
        recipe = self.resolved_recipe()
        self.check_group_consistency(x, self.in_features if scatter else widen * self.in_features // self.world_size,
                                     recipe)
        if scatter:
            x = _ScatterToTensorParallelRegion.apply(x, self.tp_group)
        recipe = self._nvfp4_recipe(recipe, x)
        y = self._linear(x, None, self.comm, recipe, None if activation is None else ActivationProducer(activation))
        if recipe is None:  # the NVFP4 path reduces inside its autograd Function
            if self.sequence_parallel:
                y = _ReduceScatterToSequenceParallelRegion.apply(y, self.tp_group)
            elif self.world_size > 1:
                y = _ReduceFromTensorParallelRegion.apply(y, self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias.to(y.dtype)
        return y, (self.bias if self.skip_bias_add else None)
