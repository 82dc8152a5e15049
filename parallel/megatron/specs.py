"""Layer and decoder-block specs: Megatron's local GPT spec with its linears and norms swapped for NVFP4 ones."""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping, Optional, Union

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe import experts as megatron_experts
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from nvfp4_dist.parallel.megatron.adapters import (NVFP4ColumnParallelLinear, NVFP4LayerNormColumnParallelLinear,
                                                   NVFP4RowParallelLinear)
from nvfp4_dist.parallel.megatron.attention import SDPACoreAttention
from nvfp4_dist.parallel.megatron.mlp import NVFP4MLP
from nvfp4_dist.parallel.megatron.moe import NVFP4GroupedMLP, NVFP4MoELayer
from nvfp4_dist.parallel.megatron.norm import NVFP4Norm
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.recipe_map import RecipeMap, as_recipe_map

logger = logging.getLogger("nvfp4_dist")

_MEGATRON_NORMS: tuple = (WrappedTorchNorm,)
try:  # Megatron's local spec picks apex's FusedLayerNorm when apex is installed.
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    _MEGATRON_NORMS += (FusedLayerNorm,)
except ImportError:  # pragma: no cover
    pass

# Submodule fields of Megatron's attention / MLP submodule dataclasses that hold the linears.
_LINEAR_FIELDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# Megatron's MoE experts modules, replaced by NVFP4GroupedMLP in the field MoESubmodules.experts.
# (GroupedMLP is gone from megatron-core 0.19; TEGroupedMLP exists without Transformer Engine installed.)
_MEGATRON_EXPERTS = tuple(getattr(megatron_experts, name) for name in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")
                          if hasattr(megatron_experts, name))


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
    experts = ModuleSpec(module=NVFP4GroupedMLP, params=params)

    def replace(field: str, value):
        if field == "experts" and isinstance(value, ModuleSpec) and value.module in _MEGATRON_EXPERTS:
            return experts
        if isinstance(value, ModuleSpec) and value.module is MoELayer:  # NVFP4 dispatch where the recipe asks
            return dataclasses.replace(value, module=NVFP4MoELayer, submodules=_swap_submodules(value.submodules,
                                                                                              replace))
        if field in _LINEAR_FIELDS and value is megatron_layers.ColumnParallelLinear:
            return column
        if field in _LINEAR_FIELDS and value is megatron_layers.RowParallelLinear:
            return row
        if isinstance(value, type) and issubclass(value, _MEGATRON_NORMS):
            return NVFP4Norm
        return value

    return replace


def _norms_into_linears(layer_spec: ModuleSpec, recipe: Optional[NVFP4Recipe], bf16: bool) -> ModuleSpec:
    """The layer with its input_layernorm inside linear_qkv and its pre_mlp_layernorm inside linear_fc1
    (NVFP4LayerNormColumnParallelLinear, IdentityOp in the norms' places), its MLP an NVFP4MLP: the structure of
    Megatron's Transformer Engine spec. Attention without a linear_qkv (multi-latent) and MLPs that are not
    Megatron's MLP (MoE) keep their norm."""
    params = {"recipe": recipe, "bf16_fallback": bf16}
    fused_column = ModuleSpec(module=NVFP4LayerNormColumnParallelLinear, params=params)
    layer = layer_spec.submodules
    changes = {}
    attention = layer.self_attention
    if (isinstance(attention, ModuleSpec) and attention.submodules is not None
            and getattr(attention.submodules, "linear_qkv", None) is megatron_layers.ColumnParallelLinear):
        changes["input_layernorm"] = IdentityOp
        changes["self_attention"] = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, linear_qkv=fused_column))
    mlp = layer.mlp
    if (isinstance(mlp, ModuleSpec) and mlp.module is MLP and mlp.submodules is not None
            and mlp.submodules.linear_fc1 is megatron_layers.ColumnParallelLinear):
        changes["pre_mlp_layernorm"] = IdentityOp
        changes["mlp"] = dataclasses.replace(mlp, module=NVFP4MLP,
                                             submodules=dataclasses.replace(mlp.submodules, linear_fc1=fused_column))
    keys_map = {old: new for old, new in getattr(layer, "sharded_state_dict_keys_map", {}).items()
                if old.rstrip(".") not in changes}  # the moved norms' checkpoint keys are already the mapped ones
    if hasattr(layer, "sharded_state_dict_keys_map"):
        changes["sharded_state_dict_keys_map"] = keys_map
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer, **changes))


def _named_linears(spec, path: tuple, recipe, names: list):
    """Copy of a Megatron spec whose NVFP4 linears get layer_name = their module name (`path` joined with the
    submodule fields that lead to them, which are Megatron's attribute names) and, unless None, `recipe`; each
    name is appended to `names`."""
    if isinstance(spec, ModuleSpec):
        if isinstance(spec.module, type) and issubclass(spec.module, (NVFP4ColumnParallelLinear,
                                                                      NVFP4RowParallelLinear, NVFP4GroupedMLP)):
            name = ".".join(path)
            grouped = issubclass(spec.module, NVFP4GroupedMLP)
            names.extend([f"{name}.linear_fc1", f"{name}.linear_fc2"] if grouped else [name])
            params = dict(spec.params, layer_name=name)
            if recipe is not None:
                params["recipe"] = recipe
            return dataclasses.replace(spec, params=params)
        if spec.submodules is None:
            return spec
        return dataclasses.replace(spec, submodules=_named_linears(spec.submodules, path, recipe, names))
    if isinstance(spec, functools.partial) and "submodules" in spec.keywords:
        keywords = dict(spec.keywords, submodules=_named_linears(spec.keywords["submodules"], path, recipe, names))
        return functools.partial(spec.func, *spec.args, **keywords)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            named = _named_linears(value, path + (field.name,), recipe, names)
            if named is not value:
                changes[field.name] = named
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec


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


def get_gpt_layer_nvfp4_spec(*, recipe: Optional[Union[NVFP4Recipe, RecipeMap]] = None, bf16: bool = False,
                             sdpa_attention: bool = True, fused_producers: bool = True,
                             **local_spec_kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec with linear_qkv/proj/fc1/fc2 in NVFP4 and SP-capable norms.

    local_spec_kwargs go to Megatron's get_gpt_layer_local_spec (num_experts, qk_layernorm,
    normalization, ...). recipe: the layers' NVFP4Recipe, or a RecipeMap (its globs match each linear's
    layer_name: call nvfp4_dist.name_layers(model) on the built model, or use get_gpt_decoder_block_nvfp4_spec,
    which names them); None: nvfp4_dist.autocast, then environment.
    bf16: build the same layer with the adapters in their BF16 fallback.
    sdpa_attention (default True): core attention on torch's scaled_dot_product_attention (SDPACoreAttention: the
    same function as Megatron's DotProductAttention, without materialising the [b, heads, s, s] scores); False:
    Megatron's DotProductAttention (needed for context parallelism, packed sequences or attention bias).
    fused_producers (default True): the norms inside linear_qkv and linear_fc1 and the activation inside
    linear_fc2 (_norms_into_linears, the structure of Megatron's Transformer Engine spec), so that each is fused
    into the NVFP4 cast of the linear's input where recipe.fused_producers allows (docs/fused_producers.md;
    NVFP4_DISABLE_FUSED_PRODUCERS=1 turns the fusion off at run time; the same bytes either way). Distributed
    checkpoints keep the local spec's keys (Megatron maps its norms there); False: the local spec's structure and
    state_dict keys.
    With sequence parallelism use get_gpt_decoder_block_nvfp4_spec: given a layer spec, GPTModel
    builds the final norm from Megatron's local norm, which refuses sequence parallelism.
    """
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    if fused_producers:
        spec = _norms_into_linears(spec, recipe, bf16)
    spec = _swap_submodules(spec, _nvfp4_replacements(recipe, bf16))
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


def moe_layer_pattern(config) -> list[bool]:
    """Which transformer layers are MoE layers: none without config.num_moe_experts, else config.moe_layer_freq as
    Megatron reads it (an int N: every N-th layer from the first; a list of 0/1 per layer)."""
    if not getattr(config, "num_moe_experts", None):
        return [False] * config.num_layers
    frequency = config.moe_layer_freq
    if isinstance(frequency, int) and not isinstance(frequency, bool) and frequency >= 1:
        return [index % frequency == 0 for index in range(config.num_layers)]
    if isinstance(frequency, list) and len(frequency) == config.num_layers and set(frequency) <= {0, 1}:
        return [bool(flag) for flag in frequency]
    raise ValueError(f"config.moe_layer_freq={frequency!r}: allowed are an int >= 1 or a list of "
                     f"{config.num_layers} zeros and ones")


def get_gpt_decoder_block_nvfp4_spec(config, *, recipe: Optional[NVFP4Recipe] = None,
                                     recipe_map: Optional[Union[RecipeMap, Mapping]] = None,
                                     bf16_first_layers: Optional[int] = None,
                                     bf16_last_layers: Optional[int] = None,
                                     sdpa_attention: Optional[bool] = None, fused_producers: bool = True,
                                     vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                                     **local_spec_kwargs) -> TransformerBlockSubmodules:
    """Decoder-block spec: NVFP4 layers except the first/last ones (see bf16_layer_counts) in BF16.

    Pass it to GPTModel(transformer_layer_spec=...). Only this pipeline stage's layers are listed
    (vp_stage / pp_rank as in Megatron's get_gpt_decoder_block_spec). local_spec_kwargs default to
    the config's normalization, qk_layernorm and multi_latent_attention. MoE configs (config.num_moe_experts): the
    layers moe_layer_pattern marks are MoE layers (Megatron's MoELayer with its router in the model's precision and
    its token dispatcher, NVFP4GroupedMLP experts named "decoder.layers.<n>.mlp.experts" with their linear_fc1 /
    linear_fc2, NVFP4 shared experts), the others dense. sdpa_attention (None: SDPA unless
    config.context_parallel_size > 1), fused_producers: see get_gpt_layer_nvfp4_spec.
    Each linear is named as GPTModel's module, "decoder.layers.<n>.self_attention.linear_qkv" (n: the global,
    0-based layer number), in its layer_name. recipe_map: per-layer recipes by glob over those names (a RecipeMap
    or a mapping; nvfp4_dist/recipe_map.py), resolved at each forward with `recipe` as the base of its dict entries
    and the recipe of the linears it does not match (None: autocast, then environment). Layers kept in BF16 by
    the counts stay BF16 whatever the map says. Globs that match no linear of this stage are logged as warnings.
    """
    first, last = bf16_layer_counts(config, recipe, bf16_first_layers, bf16_last_layers)
    if sdpa_attention is None:
        sdpa_attention = getattr(config, "context_parallel_size", 1) == 1
    local_spec_kwargs.setdefault("normalization", config.normalization)
    local_spec_kwargs.setdefault("qk_layernorm", config.qk_layernorm)
    local_spec_kwargs.setdefault("multi_latent_attention", config.multi_latent_attention)
    moe_pattern = moe_layer_pattern(config)

    def layer_spec(moe: bool, bf16: bool):
        kwargs = dict(local_spec_kwargs, num_experts=config.num_moe_experts) if moe else local_spec_kwargs
        return get_gpt_layer_nvfp4_spec(recipe=recipe, bf16=bf16, sdpa_attention=sdpa_attention,
                                        fused_producers=fused_producers, **kwargs)
    layer_specs = {(moe, bf16): layer_spec(moe, bf16) for moe in set(moe_pattern) for bf16 in (False, True)}
    recipe_map = as_recipe_map(recipe_map, "recipe_map")
    layer_recipe = recipe
    if recipe_map is not None:
        recipe_map.check(recipe)
        layer_recipe = recipe_map if recipe is None else recipe_map.with_base(recipe)
    num_layers = config.num_layers
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType
        local_ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    names, local_specs = [], []
    for index in local_ids:
        spec = layer_specs[(moe_pattern[index], index < first or index >= num_layers - last)]
        local_specs.append(_named_linears(spec, ("decoder", "layers", str(index)), layer_recipe, names))
    for pattern in recipe_map.unmatched(names) if recipe_map is not None else ():
        logger.warning("recipe_map: %r matches none of this pipeline stage's NVFP4 linears (%s, ...)", pattern,
                       names[0] if names else "none")
    logger.info("NVFP4 decoder block: %d layers, first %d and last %d in BF16", num_layers, first, last)
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=NVFP4Norm)
