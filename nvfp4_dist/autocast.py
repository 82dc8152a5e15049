"""nvfp4_dist.autocast: choose the recipe of every NVFP4 layer run inside a `with` block.

A layer's recipe is resolved at each forward call, first match wins:
  1. the layer's own `recipe=` argument when it is an NVFP4Recipe (explicit per-layer control),
  2. the layer's own `recipe=` when it is a RecipeMap: the entry of the first glob matching the layer's name, else
     the map's own base recipe when it has one,
  3. the innermost enclosing autocast's `recipes=` map, when one of its globs matches the layer's name,
  4. the innermost enclosing `nvfp4_dist.autocast(recipe)` block,
  5. NVFP4Recipe.from_env() (defaults plus NVFP4_* environment variables).
A map's dict entries change the recipe of steps 4-5 (or the map's own base); its "bf16" entries run the layer in
its BF16 fallback (nvfp4_dist/recipe_map.py). Layers are matched by their `layer_name`
(nvfp4_dist.name_layers(model)). `autocast(enabled=False)` runs every NVFP4 layer inside it in its BF16 fallback
(higher precision baseline), whatever its recipe says.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Mapping

from nvfp4_dist.recipe import NVFP4Recipe, check_recipe
from nvfp4_dist.recipe_map import RecipeMap, as_recipe_map

_ACTIVE = contextvars.ContextVar("nvfp4_dist_autocast", default=(True, None, None))


@contextlib.contextmanager
def autocast(recipe: NVFP4Recipe | None = None, enabled: bool = True, recipes: RecipeMap | Mapping | None = None):
    """Within the block, layers without their own recipe use `recipe`; enabled=False runs all in BF16.

    recipes: per-layer recipes by module-name glob (a RecipeMap, or a mapping {glob: recipe | dict of fields |
    "bf16"} made into one), for layers without an NVFP4Recipe of their own; dict entries change `recipe`.
    """
    check_recipe(recipe)
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r} ({type(enabled).__name__}): must be True or False")
    recipes = as_recipe_map(recipes)
    token = _ACTIVE.set((enabled, recipe, recipes))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def nvfp4_enabled() -> bool:
    """False inside an `autocast(enabled=False)` block."""
    return _ACTIVE.get()[0]


def resolve_recipe(layer_recipe: NVFP4Recipe | None) -> NVFP4Recipe:
    """The recipe a layer without a name runs with: its own, else the enclosing autocast's, else from the
    environment (no recipe maps: see resolve_layer_recipe)."""
    if layer_recipe is not None:
        return layer_recipe
    autocast_recipe = _ACTIVE.get()[1]
    return autocast_recipe if autocast_recipe is not None else NVFP4Recipe.from_env()


def resolve_layer_recipe(layer_recipe: NVFP4Recipe | RecipeMap | None, layer_name: str | None,
                         describe: str) -> NVFP4Recipe | None:
    """The recipe layer `layer_name` runs with (this module's docstring has the order), None for its BF16 fallback.

    describe: the layer in the error raised when a recipe map applies but the layer has no name to match."""
    if isinstance(layer_recipe, NVFP4Recipe):
        return layer_recipe
    _, autocast_recipe, autocast_map = _ACTIVE.get()
    base = resolve_recipe(autocast_recipe)
    if layer_recipe is not None:  # a RecipeMap: its match, else its own base (the layer's explicit recipe)
        name = _name_for(layer_name, describe)
        if layer_recipe.lookup(name) is not None or layer_recipe.base is not None or autocast_map is None:
            return _layer_recipe(layer_recipe.resolve(name, base))
    if autocast_map is not None:
        return _layer_recipe(autocast_map.resolve(_name_for(layer_name, describe), base))
    return base


def _name_for(layer_name: str | None, describe: str) -> str:
    if layer_name is None:
        raise ValueError(f"{describe} has no module name to match against the recipe map's globs: call "
                         f"nvfp4_dist.name_layers(model) once after building the model (the Megatron specs name "
                         f"their layers)")
    return layer_name


def _layer_recipe(resolved) -> NVFP4Recipe | None:
    """A map's answer as the layers take it: the recipe, or None for BF16."""
    return resolved if isinstance(resolved, NVFP4Recipe) else None
