"""FSDP2 (torch.distributed.fsdp.fully_shard) gathering the NVFP4 layers' weights in NVFP4 (docs/data_parallel.md).

enable_nvfp4_param_gather(model, dp_size) wraps each NVFP4 layer's weight in an NVFP4ShardedWeight before
fully_shard. FSDP2 then calls its all-gather extension points: fsdp_pre_all_gather quantizes this rank's shard
with the whole weight's amax (nvfp4_dist/sharded_weight.py) and hands FSDP the NVFP4 bytes; fsdp_post_all_gather
turns the gathered bytes into an NVFP4GatheredWeight, the unsharded parameter, whose NVFP4Tensor the layer's
forward and backward use as their quantized weight (GatheredWeightCache): no BF16 copy of the weight is gathered
or quantized again. The sharded parameters (FP32 or BF16 master weights) stay the optimizer's, the gradients are
reduce-scattered by FSDP as usual, and the state dict holds the sharded parameters in their own dtype.

The amaxes: precompute_weight_amaxes(model), called after each optimizer step, all-reduces every weight's
amax in one collective per FSDP mesh; a weight written since (or never precomputed) all-reduces its own amax
in its pre-all-gather instead (the same bytes, one small collective per weight).

A layer that runs unquantized (bf16_fallback, a "bf16" recipe-map entry) or whose recipe needs the unquantized
weight (backward_mode "high_precision") gathers its weight in the parameter dtype, as without this module.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from nvfp4_dist import ops, sharded_weight
from nvfp4_dist.linear import WeightCache, describe_layer, needs_columnwise_weight
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor
from nvfp4_dist.parallel import collectives

logger = logging.getLogger("nvfp4_dist")
aten = torch.ops.aten

# Ops whose result is the sharded weight again (FSDP2's sharding and padding, device moves): every other op,
# the optimizer's and its states' included, sees and returns plain tensors.
_SHARDED_PRESERVED_OPS = {
    aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
    aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
    aten.detach.default, aten.alias.default,
}
_GATHERED_VIEW_OPS = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default}


def _weight_quantization(recipe: NVFP4Recipe) -> dict:
    """What of a recipe decides a weight's NVFP4 bytes (docs/numerics.md §4, §12)."""
    options = ops.quantize_options("weight", recipe)
    return {name: options[name] for name in ("block_2d", "four_over_six")}


def _gathers_nvfp4(recipe: NVFP4Recipe | None) -> bool:
    """Whether a layer running `recipe` (None: unquantized) takes its weight gathered in NVFP4."""
    return recipe is not None and recipe.backward_mode != "high_precision"


class NVFP4ShardedWeight(torch.Tensor):
    """This rank's shard of an NVFP4 layer's weight (dim 0), in the parameter's own dtype: FSDP2's sharded
    parameter, which every op but the all-gather sees as the plain tensor it wraps."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   layout=tensor.layout, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor
        # (amax float32 (1,), the dtype it was taken in, the wrapped tensor's version then), until a write
        self.precomputed_amax: tuple | None = None
        self.gather_recipe: NVFP4Recipe | None = None  # the recipe of the last gather in forward
        self.gather_dtype: torch.dtype | None = None   # the dtype the layer computes with (FSDP's param_dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:  # a write: the precomputed amax no longer describes the values
            for value in pytree.tree_leaves((args, kwargs)):
                if isinstance(value, cls):
                    value.precomputed_amax = None
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs))
        out = func(*args, **kwargs)
        if func not in _SHARDED_PRESERVED_OPS:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride):
        return NVFP4ShardedWeight(inner_tensors["_tensor"])

    def __repr__(self) -> str:
        return f"NVFP4ShardedWeight({self._tensor!r})"

    def _recipe_for_gather(self, module) -> NVFP4Recipe | None:
        """The layer's recipe for this gather: resolved now in forward; in backward (FSDP's re-gather after
        resharding) the forward's, so backward reads the bytes forward did."""
        if torch._C._current_graph_task_id() != -1:
            return self.gather_recipe
        self.gather_recipe = module.resolved_recipe()
        return self.gather_recipe

    def _global_amax(self, shard: torch.Tensor, mesh) -> torch.Tensor:
        if self.precomputed_amax is not None and self.precomputed_amax[1:] == (shard.dtype, self._tensor._version):
            return self.precomputed_amax[0]
        logger.debug("weight shard %s: amax all-reduced on its own (precompute_weight_amaxes after the "
                     "optimizer step does all weights in one collective)", tuple(shard.shape))
        return collectives.all_reduce_amax([sharded_weight.local_weight_amax(shard)], mesh.get_group())[0]

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The all-gather inputs: this shard's NVFP4 bytes (wire_pieces) quantized with the weight's amax, or its
        values in the parameter dtype for a layer that takes its weight unquantized."""
        dtype = mp_policy.param_dtype or self.dtype
        self.gather_dtype = dtype
        shard = self._tensor.to(dtype)
        recipe = self._recipe_for_gather(module)
        if not _gathers_nvfp4(recipe):
            return (shard,), ("values",)
        sharded_weight.check_weight_sharding(outer_size, mesh.size(), name=f"{describe_layer(module)}.weight")
        columnwise = needs_columnwise_weight(recipe)
        q = sharded_weight.quantize_shard(shard, self._global_amax(shard, mesh), recipe, columnwise=columnwise)
        pieces = sharded_weight.wire_pieces(q)
        return tuple(pieces.values()), ("nvfp4", tuple(pieces), q.metadata(), q.amax_rowwise, mesh.size(),
                                        recipe, columnwise)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded parameter from the gathered bytes: an NVFP4GatheredWeight (or the gathered values);
        with `out` (FSDP's later steps) the gathered copy is written into out's tensors."""
        if metadata[0] == "values":
            if out is None:
                return all_gather_outputs[0], ()
            if isinstance(out, NVFP4GatheredWeight):
                raise RuntimeError("the layer's weight was gathered in NVFP4 before and in its parameter dtype now "
                                   "(its recipe changed to one that runs unquantized); FSDP2 keeps one unsharded "
                                   "form per parameter")
            return None  # out is a view of the all-gather output, which holds the new values
        _, names, shard_meta, amax, world_size, recipe, columnwise = metadata
        amax = amax.clone()  # the gathered weight's own: FSDP frees its storage with the weight's at reshard
        shard_q = dataclasses.replace(shard_meta, amax_rowwise=amax, amax_columnwise=amax)
        q = sharded_weight.assemble_gathered(shard_q, dict(zip(names, all_gather_outputs)), world_size,
                                             columnwise=columnwise)
        if out is None:
            inner = _own_storage_tensors(q, all_gather_outputs)
            return NVFP4GatheredWeight(q, param_dtype, recipe), inner
        if not isinstance(out, NVFP4GatheredWeight) or out.layout_of() != NVFP4GatheredWeight.layout(q):
            raise RuntimeError("the layer's weight is gathered in a different NVFP4 layout than at the first "
                               "gather (its recipe's weight_2d, 4over6 or backward mode changed); FSDP2 keeps one "
                               "unsharded form per parameter")
        out.refill(q, recipe)
        return None


def _own_storage_tensors(q: NVFP4Tensor, all_gather_outputs) -> list:
    """q's tensors that FSDP does not already free (those not in its all-gather outputs), one per storage."""
    gathered = {t.untyped_storage().data_ptr() for t in all_gather_outputs}
    inner, seen = [], set()
    for tensor in q.tensors():
        if tensor is None:
            continue
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in gathered and pointer not in seen:
            seen.add(pointer)
            inner.append(tensor)
    return inner


class NVFP4GatheredWeight(torch.Tensor):
    """The unsharded weight of an NVFP4 layer under FSDP2: the gathered NVFP4Tensor (`nvfp4`, both copies when
    backward needs the columnwise one) behind a tensor of the weight's shape and compute dtype. Autograd takes it
    as the layer's weight and gives it a plain gradient; only the NVFP4 layers read it (other ops raise)."""

    @staticmethod
    def __new__(cls, q: NVFP4Tensor, dtype: torch.dtype, recipe: NVFP4Recipe):
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=dtype, device=q.device)

    def __init__(self, q: NVFP4Tensor, dtype: torch.dtype, recipe: NVFP4Recipe):
        self.nvfp4, self.recipe = q, recipe

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], cls) else None
        if func in _GATHERED_VIEW_OPS and source is not None:
            shape = tuple(source.shape) if func in (aten.detach.default, aten.alias.default) else tuple(args[1])
            if shape == tuple(source.shape):
                return cls(source.nvfp4, source.dtype, source.recipe)
        if func in (aten.zeros_like.default, aten.empty_like.default) and source is not None:
            return torch.zeros(source.shape, dtype=source.dtype, device=source.device)
        raise RuntimeError(f"{func}: this weight is gathered in NVFP4 by FSDP2 (nvfp4_dist.parallel.fsdp) and only "
                           f"the NVFP4 layers read it; read the sharded parameter (outside forward and backward), "
                           f"or gather the layer in its parameter dtype (bf16_fallback or backward_mode "
                           f"'high_precision')")

    @staticmethod
    def layout(q: NVFP4Tensor) -> tuple:
        """Shapes, dtypes and flags of q's tensors: what must not change from one gather to the next."""
        return (tuple(q.shape), q.block_2d, q.e4m3_bound,
                tuple(None if t is None else (tuple(t.shape), t.dtype) for t in q.tensors()))

    def layout_of(self) -> tuple:
        return self.layout(self.nvfp4)

    def refill(self, q: NVFP4Tensor, recipe: NVFP4Recipe) -> None:
        """Write q's bytes into this weight's tensors (FSDP re-allocated their storage), keeping their version
        counters: backward's saved copies are these tensors, re-gathered before backward reads them."""
        targets = [t for t in self.nvfp4.tensors() if t is not None]
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
            for target, source in zip(self.nvfp4.tensors(), q.tensors()):
                if target is not None and target.data_ptr() != source.data_ptr():
                    target.copy_(source)
        self.recipe = recipe


class GatheredWeightCache(WeightCache):
    """A layer's WeightCache that hands out the NVFP4Tensor of an FSDP2-gathered weight (NVFP4GatheredWeight)
    instead of quantizing the weight; any other weight is quantized and cached as WeightCache does."""

    def get(self, weight: torch.Tensor, recipe: NVFP4Recipe, *, columnwise: bool = True) -> NVFP4Tensor:
        if not isinstance(weight, NVFP4GatheredWeight):
            return super().get(weight, recipe, columnwise=columnwise)
        if _weight_quantization(weight.recipe) != _weight_quantization(recipe):
            raise ValueError(f"recipe: the weight was gathered in NVFP4 with {_weight_quantization(weight.recipe)} "
                             f"but the layer now runs {_weight_quantization(recipe)}; resolve the layer's recipe "
                             f"the same way at the all-gather and in forward")
        if columnwise and not weight.nvfp4.has_columnwise:
            raise ValueError("columnwise=True: the weight was gathered without its columnwise copy (its gather "
                             "recipe's backward mode needs none)")
        return weight.nvfp4


def nvfp4_layers(model: torch.nn.Module) -> list:
    """(qualified name, module) of the NVFP4 layers in model: modules with a WeightCache, not bf16_fallback."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "weight_cache", None), WeightCache)
            and not getattr(module, "bf16_fallback", False)]


def enable_nvfp4_param_gather(model: torch.nn.Module, dp_size: int) -> list:
    """Make FSDP2 gather the weights of model's NVFP4 layers in NVFP4; call it before fully_shard(..., mesh) with
    dp_size the size of that mesh. Returns the qualified names of the layers it changed. ValueError (before any
    change) for a weight that does not split into dp_size shards cutting on 16x16 block boundaries."""
    layers = [(name, module) for name, module in nvfp4_layers(model)
              if not isinstance(module.weight, (NVFP4ShardedWeight, DTensor))]
    for name, module in layers:
        sharded_weight.check_weight_sharding(module.weight.shape, dp_size, name=f"{name or 'model'}.weight")
    for name, module in layers:
        old = module.weight
        new = torch.nn.Parameter(NVFP4ShardedWeight(old.detach()), requires_grad=old.requires_grad)
        for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel"):
            if hasattr(old, attribute):
                setattr(new, attribute, getattr(old, attribute))
        module.weight = new
        module.weight_cache = GatheredWeightCache()
        module.register_state_dict_post_hook(_plain_weight_in_state_dict)
    return [name for name, _ in layers]


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State dicts hold the weight as without NVFP4 gathers: the sharded DTensor (or the tensor) of the plain
    values, sharing their storage so that loading into the state dict in place writes the parameter."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, NVFP4ShardedWeight):
        state_dict[key] = DTensor.from_local(value._local_tensor._tensor, value.device_mesh, value.placements,
                                             run_check=False, shape=value.shape, stride=value.stride())
    elif isinstance(value, NVFP4ShardedWeight):
        state_dict[key] = value._tensor


def _sharded_weights(model: torch.nn.Module) -> list:
    """(FSDP mesh group, NVFP4ShardedWeight) of the NVFP4 weights FSDP2 holds sharded now, in module order."""
    found = []
    for _, module in nvfp4_layers(model):
        weight = module._parameters.get("weight")
        if isinstance(weight, DTensor) and isinstance(weight._local_tensor, NVFP4ShardedWeight):
            if weight.device_mesh.ndim != 1:
                raise ValueError(f"{describe_layer(module)}: precompute_weight_amaxes takes 1D FSDP meshes, the "
                                 f"weight is on {weight.device_mesh}")
            found.append((weight.device_mesh.get_group(), weight._local_tensor))
    return found


def precompute_weight_amaxes(model: torch.nn.Module) -> int:
    """After the optimizer step: every FSDP-sharded NVFP4 weight's amax, all-reduced in one collective per FSDP
    mesh, for the next all-gathers to use. Returns how many weights it covered."""
    by_group: dict = {}
    for group, weight in _sharded_weights(model):
        by_group.setdefault(group, []).append(weight)
    for group, weights in by_group.items():
        shards = [weight._tensor.to(weight.gather_dtype or weight.dtype) for weight in weights]
        amaxes = collectives.all_reduce_amax([sharded_weight.local_weight_amax(s) for s in shards], group)
        for weight, shard, amax in zip(weights, shards, amaxes):
            weight.precomputed_amax = (amax, shard.dtype, weight._tensor._version)
    return sum(len(weights) for weights in by_group.values())
