"""RecipeMap: per-layer recipes chosen by module-name globs (docs/numerics.md §10).

An ordered mapping from fnmatch globs over module names ("decoder.layers.0.*", "*.self_attention.linear_qkv";
case-sensitive, and `*` also matches dots) to what a matching layer runs; the first matching glob wins:
  - an NVFP4Recipe: that recipe;
  - a dict of NVFP4Recipe fields ({"nvfp4_4over6": "all", "rht": False}; {} is the base itself): the layer's base
    recipe with those fields changed. The base is the map's own `base` when it has one, else the recipe the layer
    would run without the map (the enclosing nvfp4_dist.autocast's, else NVFP4Recipe.from_env());
  - "bf16": the layer's BF16 fallback (unquantized, in the activation dtype).
A layer that no glob matches runs its base recipe. The map is given to nvfp4_dist.autocast(recipes=...), to a
layer as its recipe= (nv.Linear, the parallel layers, the Megatron adapters) or to the Megatron specs
(recipe_map=...). Layers match their `layer_name`: nvfp4_dist.name_layers(model) sets it to the module's
qualified name in `model`; the Megatron specs set Megatron's names ("decoder.layers.<n>.mlp.linear_fc1").
bf16_first_layers / bf16_last_layers are model-level settings (they choose which layers are built in BF16), so
a dict entry may not set them: map those layers to "bf16" instead.

Files (RecipeMap.from_file): YAML (.yaml, .yml; needs PyYAML) or JSON (.json) holding one mapping of globs to
entries in the forms above, in order, e.g.

    "decoder.layers.0.*": bf16
    "*.self_attention.linear_*": {nvfp4_4over6: all, rht: false}

(quote globs in YAML: a leading `*` is YAML syntax). Errors name the file, the key and the problem.
"""
from __future__ import annotations

import fnmatch
import json
import pathlib
from typing import Iterable, Mapping

from nvfp4_dist.recipe import NVFP4Recipe, RecipeTypeError, check_field

BF16 = "bf16"
# Model-level fields: which layers exist in BF16 is decided when the model is built, not per layer.
MODEL_LEVEL_FIELDS = ("bf16_first_layers", "bf16_last_layers")
FILE_SUFFIXES = (".yaml", ".yml", ".json")


class RecipeConfigError(ValueError):
    """A recipe map, or a recipe config file, that cannot be used; the message names the source and the key."""


def _check_entry(entry, where: str):
    """The entry in its stored form (NVFP4Recipe, dict of fields, or BF16), or RecipeConfigError naming `where`."""
    if isinstance(entry, NVFP4Recipe):
        return entry
    if isinstance(entry, str):
        if entry.lower() != BF16:
            raise RecipeConfigError(f"{where}: {entry!r} is not a recipe; allowed: \"bf16\", a mapping of "
                                    f"NVFP4Recipe fields, or an NVFP4Recipe")
        return BF16
    if isinstance(entry, Mapping):
        fields = {}
        for name, value in entry.items():
            if name in MODEL_LEVEL_FIELDS:
                raise RecipeConfigError(f"{where} -> {name!r}: a model-level setting (which layers are built in "
                                        f"BF16), not a per-layer one; map those layers to \"bf16\" instead")
            try:
                check_field(name, value)
            except ValueError as error:
                raise RecipeConfigError(f"{where} -> {name!r}: {error}") from None
            fields[name] = value
        return fields
    raise RecipeConfigError(f"{where}: {entry!r} ({type(entry).__name__}) is not a recipe; allowed: \"bf16\", a "
                            f"mapping of NVFP4Recipe fields, or an NVFP4Recipe")


class RecipeMap:
    """Per-layer recipes by module-name glob, first match wins (this module's docstring has the rules).

    entries: a mapping {glob: entry} (in order) or (glob, entry) pairs. base: the recipe that dict entries
    change and that unmatched layers run (None: the layer's, from autocast or the environment). source: what the
    entries came from, in error messages (a file name).
    """

    def __init__(self, entries: Mapping | Iterable, *, base: NVFP4Recipe | None = None, source: str = "recipes"):
        if isinstance(entries, RecipeMap):
            entries = entries.entries
        pairs = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
        if base is not None and not isinstance(base, NVFP4Recipe):
            raise RecipeConfigError(f"base={base!r} ({type(base).__name__}): must be an NVFP4Recipe or None")
        checked, seen = [], set()
        for index, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise RecipeConfigError(f"{source}: entry {index} = {pair!r}: expected a (glob, recipe) pair")
            pattern, entry = pair
            if not isinstance(pattern, str) or not pattern:
                raise RecipeConfigError(f"{source}: key {pattern!r}: a glob over module names must be a non-empty "
                                        f"string")
            if pattern in seen:
                raise RecipeConfigError(f"{source}: key {pattern!r} appears twice (the first would always win)")
            seen.add(pattern)
            checked.append((pattern, _check_entry(entry, f"{source}: key {pattern!r}")))
        self.entries: tuple = tuple(checked)
        self.base, self.source = base, source
        self._resolved: dict = {}

    @classmethod
    def from_file(cls, path, *, base: NVFP4Recipe | None = None) -> "RecipeMap":
        """The map in a YAML or JSON file (this module's docstring shows the form)."""
        path = pathlib.Path(path)
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise RecipeConfigError(f"{path}: unknown recipe config format {path.suffix!r}; allowed suffixes: "
                                    f"{', '.join(FILE_SUFFIXES)}")
        try:
            text = path.read_text()
        except OSError as error:
            raise RecipeConfigError(f"{path}: cannot read the recipe config ({error.strerror or error})") from None
        data = _load_json(text, path) if path.suffix.lower() == ".json" else _load_yaml(text, path)
        if not isinstance(data, Mapping):
            raise RecipeConfigError(f"{path}: the recipe config must be a mapping of module-name globs to recipes, "
                                    f"got {type(data).__name__}")
        return cls(data, base=base, source=str(path))

    def with_base(self, base: NVFP4Recipe | None) -> "RecipeMap":
        """The same entries with another base recipe."""
        return RecipeMap(self.entries, base=base, source=self.source)

    def lookup(self, name: str):
        """(glob, entry) of the first glob matching `name`, or None."""
        for pattern, entry in self.entries:
            if fnmatch.fnmatchcase(name, pattern):
                return pattern, entry
        return None

    def resolve(self, name: str, base: NVFP4Recipe | None = None):
        """What layer `name` runs: an NVFP4Recipe, or BF16. base: the recipe without the map (used when this map
        has none; NVFP4Recipe.from_env() when neither)."""
        base = self._base(base)
        key = (name, base)
        if key not in self._resolved:
            hit = self.lookup(name)
            self._resolved[key] = base if hit is None else self._apply(hit, base, f"layer {name}")
        return self._resolved[key]

    def check(self, base: NVFP4Recipe | None = None) -> None:
        """Apply every dict entry to the base (this map's, else `base`, else from the environment), so that a
        combination NVFP4Recipe refuses is reported now, naming its key, instead of at a layer's first forward."""
        base = self._base(base)
        for hit in self.entries:
            self._apply(hit, base, "")

    def unmatched(self, names: Iterable[str]) -> list:
        """The globs that match none of `names` (a misspelt module name matches nothing, silently otherwise)."""
        names = list(names)
        return [pattern for pattern, _ in self.entries
                if not any(fnmatch.fnmatchcase(name, pattern) for name in names)]

    def _base(self, base: NVFP4Recipe | None) -> NVFP4Recipe:
        for candidate in (self.base, base):
            if candidate is not None:
                return candidate
        return NVFP4Recipe.from_env()

    def _apply(self, hit, base: NVFP4Recipe, layer: str):
        pattern, entry = hit
        if not isinstance(entry, dict):
            return entry
        try:
            return base.replace(**entry)
        except ValueError as error:
            on = f" (for {layer})" if layer else ""
            raise RecipeConfigError(f"{self.source}: key {pattern!r}{on}: {error}") from None

    def __repr__(self) -> str:
        shown = ", ".join(f"{pattern!r}: {entry!r}" for pattern, entry in self.entries)
        base = "" if self.base is None else f", base={self.base!r}"
        return f"RecipeMap({{{shown}}}{base})"


def check_layer_recipe(recipe, name: str = "recipe") -> None:
    """Raise RecipeTypeError unless `recipe` is what a layer takes: an NVFP4Recipe, a RecipeMap or None."""
    if recipe is None or isinstance(recipe, (NVFP4Recipe, RecipeMap)):
        return
    hint = (f"; build one with NVFP4Recipe(**{name}) from fields, or RecipeMap({name}) from module-name globs"
            if isinstance(recipe, Mapping) else "")
    raise RecipeTypeError(f"{name}={recipe!r} ({type(recipe).__name__}): must be an NVFP4Recipe, a RecipeMap or "
                          f"None{hint}")


def as_recipe_map(recipes, name: str = "recipes") -> RecipeMap | None:
    """None, a RecipeMap, or a mapping / (glob, entry) pairs made into one."""
    if recipes is None or isinstance(recipes, RecipeMap):
        return recipes
    if isinstance(recipes, (Mapping, list, tuple)):
        return RecipeMap(recipes, source=name)
    raise RecipeConfigError(f"{name}={recipes!r} ({type(recipes).__name__}): must be a RecipeMap, a mapping of "
                            f"module-name globs to recipes, or None")


def _no_duplicate_keys(path: pathlib.Path):
    def pairs_to_dict(pairs):
        result = {}
        for key, value in pairs:
            if key in result:
                raise RecipeConfigError(f"{path}: key {key!r} appears twice")
            result[key] = value
        return result
    return pairs_to_dict


def _load_json(text: str, path: pathlib.Path):
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys(path))
    except json.JSONDecodeError as error:
        raise RecipeConfigError(f"{path}: not valid JSON: {error}") from None


def _load_yaml(text: str, path: pathlib.Path):
    try:
        import yaml
    except ImportError:
        raise RecipeConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the recipe "
                                f"config as JSON") from None

    class Loader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        pairs = [(loader.construct_object(key, deep=deep), loader.construct_object(value, deep=deep))
                 for key, value in node.value]
        return _no_duplicate_keys(path)(pairs)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    try:
        data = yaml.load(text, Loader=Loader)
    except yaml.YAMLError as error:
        raise RecipeConfigError(f"{path}: not valid YAML: {error}") from None
    if data is None:
        raise RecipeConfigError(f"{path}: the recipe config is empty")
    return data
