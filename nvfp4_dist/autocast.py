"""nvfp4_dist.autocast: choose the recipe of every NVFP4 layer run inside a `with` block.

A layer's recipe is resolved at each forward call, first match wins:
  1. the layer's own `recipe=` argument (explicit per-layer control),
  2. the innermost enclosing `nvfp4_dist.autocast(recipe)` block,
  3. NVFP4Recipe.from_env() (defaults plus NVFP4_* environment variables).
`autocast(enabled=False)` runs every NVFP4 layer inside it in its BF16 fallback (higher precision
baseline), whatever its recipe says.
"""
from __future__ import annotations

import contextlib
import contextvars

from nvfp4_dist.recipe import NVFP4Recipe, check_recipe

_ACTIVE = contextvars.ContextVar("nvfp4_dist_autocast", default=(True, None))


@contextlib.contextmanager
def autocast(recipe: NVFP4Recipe | None = None, enabled: bool = True):
    """Within the block, layers without their own recipe use `recipe`; enabled=False runs all in BF16."""
    check_recipe(recipe)
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r} ({type(enabled).__name__}): must be True or False")
    token = _ACTIVE.set((enabled, recipe))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def nvfp4_enabled() -> bool:
    """False inside an `autocast(enabled=False)` block."""
    return _ACTIVE.get()[0]


def resolve_recipe(layer_recipe: NVFP4Recipe | None) -> NVFP4Recipe:
    """The recipe a layer runs with: its own, else the enclosing autocast's, else from the environment."""
    if layer_recipe is not None:
        return layer_recipe
    autocast_recipe = _ACTIVE.get()[1]
    return autocast_recipe if autocast_recipe is not None else NVFP4Recipe.from_env()
