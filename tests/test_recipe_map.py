"""Per-layer recipes (nvfp4_dist/recipe_map.py, docs/numerics.md §10): glob precedence, dict entries on a base,
"bf16" entries, where maps come from (autocast, a layer's recipe=), and recipe config files that are refused with
the file, the key and the problem named."""
import json

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.recipe_map import BF16, RecipeConfigError, RecipeMap

CHANGES = {"weight_2d": False, "stochastic_rounding": False}  # a per-layer change to look for


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.ModuleDict({"qkv": nv.Linear(32, 48), "proj": nv.Linear(16, 32)})
        self.mlp = torch.nn.ModuleDict({"fc1": nv.Linear(32, 64), "fc2": nv.Linear(64, 32)})

    def forward(self, x):
        q = self.attention["qkv"](x)[..., :16]
        x = x + self.attention["proj"](q)
        return x + self.mlp["fc2"](torch.relu(self.mlp["fc1"](x)))


class Model(torch.nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def used(model) -> dict:
    """{layer name: the recipe its last forward ran with, or None for BF16}."""
    return {module.layer_name: module.last_recipe for module in model.modules() if isinstance(module, nv.Linear)}


def test_first_matching_glob_wins_and_unmatched_layers_run_the_base():
    recipes = RecipeMap({"layers.1.attention.qkv": "bf16", "layers.1.*": {"weight_2d": False},
                         "*.qkv": {"stochastic_rounding": False}, "*": {}})
    base = nv.NVFP4Recipe(rht=False)
    assert recipes.resolve("layers.1.attention.qkv", base) == BF16
    assert recipes.resolve("layers.1.mlp.fc1", base) == base.replace(weight_2d=False)
    assert recipes.resolve("layers.0.attention.qkv", base) == base.replace(stochastic_rounding=False)
    assert recipes.resolve("layers.0.mlp.fc1", base) == base  # "*": {} is the base itself
    assert RecipeMap({"x": {}}).resolve("y", base) is base
    assert recipes.lookup("layers.1.mlp.fc2") == ("layers.1.*", {"weight_2d": False})
    # Globs are case-sensitive and `*` spans dots, so "layers.1*" would also take layers 10-19.
    assert RecipeMap({"layers.1*": "bf16"}).lookup("layers.12.mlp.fc1") is not None
    assert RecipeMap({"*.QKV": "bf16"}).lookup("layers.0.attention.qkv") is None
    assert recipes.unmatched(["layers.0.attention.qkv"]) == ["layers.1.attention.qkv", "layers.1.*"]


def test_a_maps_own_base_and_recipe_entries():
    explicit = nv.NVFP4Recipe(weight_2d=False, rht=False)
    base = nv.NVFP4Recipe(stochastic_rounding=False)
    recipes = RecipeMap([("*.fc1", explicit), ("*.fc2", {"rht": False})], base=base)
    assert recipes.resolve("a.fc1", nv.NVFP4Recipe()) is explicit
    assert recipes.resolve("a.fc2", nv.NVFP4Recipe()) == base.replace(rht=False)  # the map's base wins
    assert recipes.resolve("a.qkv", nv.NVFP4Recipe()) is base
    assert recipes.with_base(None).resolve("a.qkv", explicit) is explicit


def test_autocast_recipes_choose_per_layer_and_bf16_entries_run_unquantized():
    torch.manual_seed(0)
    model = Model()
    nv.name_layers(model)
    base = nv.NVFP4Recipe(rht=False)
    recipes = {"layers.0.*": "bf16", "layers.2.*": "BF16", "*.attention.*": CHANGES}
    x = torch.randn(16, 32)
    with nv.autocast(base, recipes=recipes):
        y = model(x)
    y.sum().backward()
    changed = base.replace(**CHANGES)
    assert used(model) == {
        "layers.0.attention.qkv": None, "layers.0.attention.proj": None, "layers.0.mlp.fc1": None,
        "layers.0.mlp.fc2": None,
        "layers.1.attention.qkv": changed, "layers.1.attention.proj": changed, "layers.1.mlp.fc1": base,
        "layers.1.mlp.fc2": base,
        "layers.2.attention.qkv": None, "layers.2.attention.proj": None, "layers.2.mlp.fc1": None,
        "layers.2.mlp.fc2": None}
    # A "bf16" layer is the unquantized linear: the same output as torch's.
    fc1 = model.layers[0].mlp["fc1"]
    x0 = torch.randn(16, 32)
    with nv.autocast(base, recipes=recipes):
        torch.testing.assert_close(fc1(x0), torch.nn.functional.linear(x0, fc1.weight, fc1.bias), rtol=0, atol=0)
    # Outside the block: the environment's recipe everywhere, no map.
    model(x)
    assert set(used(model).values()) == {nv.NVFP4Recipe.from_env()}


def test_a_layers_own_recipe_wins_and_its_own_map_comes_before_autocasts():
    own = nv.NVFP4Recipe(weight_2d=False)
    with_recipe = nv.Linear(32, 32, recipe=own)
    with_map = nv.Linear(32, 32, recipe=RecipeMap({"mine": {"rht": False}}))
    unmatched_map = nv.Linear(32, 32, recipe=RecipeMap({"other": "bf16"}))
    plain = nv.Linear(32, 32)
    model = torch.nn.ModuleDict({"explicit": with_recipe, "mine": with_map, "unmatched": unmatched_map,
                                 "plain": plain})
    nv.name_layers(model)
    autocast_recipe = nv.NVFP4Recipe(stochastic_rounding=False)
    x = torch.randn(16, 32)
    with nv.autocast(autocast_recipe, recipes={"*": "bf16", "plain": {}}):
        for layer in model.values():
            layer(x)
    assert with_recipe.last_recipe is own
    assert with_map.last_recipe == autocast_recipe.replace(rht=False)  # its own map; dict on autocast's recipe
    assert unmatched_map.last_recipe is None  # no match in its own map: autocast's map ("*": bf16)
    assert plain.last_recipe is None  # first match "*" wins over "plain"
    with nv.autocast(enabled=False, recipes={"*": {}}):
        with_recipe(x)
    assert with_recipe.last_recipe is None


def test_unnamed_layers_under_a_map_are_refused_with_the_fix():
    layer = nv.Linear(32, 32)
    with nv.autocast(recipes={"*": "bf16"}):
        with pytest.raises(ValueError, match=r"Linear\(in_features=32, out_features=32\) has no module name.*"
                                             r"nvfp4_dist.name_layers\(model\)"):
            layer(torch.randn(16, 32))
    layer(torch.randn(16, 32))  # no map: no name needed


def test_a_dict_entry_that_the_base_refuses_names_the_key_and_the_layer():
    layer = nv.Linear(32, 32, recipe=RecipeMap({"*": {"nvfp4_4over6": "all"}}))
    layer.layer_name = "fc"
    with pytest.raises(RecipeConfigError, match=r"recipes: key '\*' \(for layer fc\): nvfp4_4over6='all' cannot be "
                                                r"combined with rht=True"):
        layer(torch.randn(16, 32))
    with pytest.raises(RecipeConfigError, match=r"key '\*': nvfp4_4over6='all' cannot be combined with rht=True"):
        RecipeMap({"*": {"nvfp4_4over6": "all"}}).check(nv.NVFP4Recipe())
    RecipeMap({"*": {"nvfp4_4over6": "all"}}).check(nv.NVFP4Recipe(rht=False))


@pytest.mark.parametrize("entries,message", [
    ({"*": "fp8"}, r"key '\*': 'fp8' is not a recipe; allowed: \"bf16\""),
    ({"*": None}, r"key '\*': None \(NoneType\) is not a recipe"),
    ({"*": {"rht": "no"}}, r"key '\*' -> 'rht': rht='no' \(str\): must be of type bool"),
    ({"*": {"backward_mode": "bf16"}}, r"key '\*' -> 'backward_mode': .*one of \('default'"),
    ({"*": {"rhtt": False}}, r"key '\*' -> 'rhtt': 'rhtt' is not an NVFP4Recipe field; the fields are rht,"),
    ({"*": {"bf16_first_layers": 1}}, r"key '\*' -> 'bf16_first_layers': a model-level setting"),
    ({"": "bf16"}, r"key '': a glob over module names must be a non-empty string"),
    ([("a", "bf16"), ("a", {})], r"key 'a' appears twice"),
    ([("a", "bf16", 1)], r"entry 0 = \('a', 'bf16', 1\): expected a \(glob, recipe\) pair"),
])
def test_bad_entries_are_refused_with_the_key_and_the_problem(entries, message):
    with pytest.raises(RecipeConfigError, match=message):
        RecipeMap(entries)


def test_layers_and_autocast_refuse_what_is_not_a_recipe():
    with pytest.raises(TypeError, match=r"recipe=\['x'\] \(list\): must be an NVFP4Recipe, a RecipeMap or None"):
        nv.Linear(32, 32, recipe=["x"])
    with pytest.raises(ValueError, match=r"recipes=3 \(int\): must be a RecipeMap, a mapping"):
        nv.autocast(recipes=3).__enter__()


def test_recipe_config_files_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "recipes.yaml"
    yaml_file.write_text('"decoder.layers.0.*": bf16\n"*.self_attention.linear_*": {backward_mode: dequantized}\n')
    json_file = tmp_path / "recipes.json"
    json_file.write_text(json.dumps({"decoder.layers.0.*": "bf16",
                                     "*.self_attention.linear_*": {"backward_mode": "dequantized"}}))
    for path in (yaml_file, json_file):
        recipes = RecipeMap.from_file(path)
        assert recipes.entries == (("decoder.layers.0.*", BF16),
                                   ("*.self_attention.linear_*", {"backward_mode": "dequantized"}))
        assert recipes.resolve("decoder.layers.1.self_attention.linear_qkv", nv.NVFP4Recipe()).backward_mode == \
            "dequantized"


@pytest.mark.parametrize("name,text,message", [
    ("r.yaml", '"*.linear_qkv": {rht: maybe}\n', r"r.yaml: key '\*.linear_qkv' -> 'rht': rht='maybe' \(str\)"),
    ("r.yaml", '"*.linear_qkv": bf16\n"*.linear_qkv": {}\n', r"r.yaml: key '\*.linear_qkv' appears twice"),
    ("r.json", '{"a": "bf16", "a": {}}', r"r.json: key 'a' appears twice"),
    ("r.yaml", '"*": {weight_2d: false, weight_2d: true}\n', r"r.yaml: key 'weight_2d' appears twice"),
    ("r.yaml", "- a\n- b\n", r"r.yaml: the recipe config must be a mapping of module-name globs to recipes, got list"),
    ("r.yaml", "", r"r.yaml: the recipe config is empty"),
    ("r.yaml", "*.fc1: bf16\n", r"r.yaml: not valid YAML"),
    ("r.json", '{"a": bf16}', r"r.json: not valid JSON"),
    ("r.json", '{"*": {"nvfp4_4over6x": "all"}}', r"r.json: key '\*' -> 'nvfp4_4over6x': .*not an NVFP4Recipe field"),
    ("r.toml", "", r"r.toml: unknown recipe config format '.toml'; allowed suffixes: .yaml, .yml, .json"),
])
def test_bad_recipe_config_files_name_the_file_the_key_and_the_problem(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(RecipeConfigError, match=message):
        RecipeMap.from_file(path)


def test_a_missing_recipe_config_file_is_named(tmp_path):
    with pytest.raises(RecipeConfigError, match=r"missing.yaml: cannot read the recipe config"):
        RecipeMap.from_file(tmp_path / "missing.yaml")


def test_layernorm_layers_follow_the_map():
    mlp = nv.LayerNormMLP(32, 32, activation="gelu")
    model = torch.nn.ModuleDict({"mlp": mlp})
    nv.name_layers(model)
    assert (mlp.fc1.layer_name, mlp.fc2.layer_name) == ("mlp.fc1", "mlp.fc2")
    base = nv.NVFP4Recipe(rht=False)
    with nv.autocast(base, recipes={"*.fc1": "bf16", "*.fc2": CHANGES}):
        mlp(torch.randn(16, 32, dtype=torch.bfloat16))
    assert mlp.fc1.last_recipe is None and mlp.fc2.last_recipe == base.replace(**CHANGES)


def test_one_map_resolves_each_base_anew(monkeypatch):
    """A map without a base of its own applies its entries to whatever base each call brings, in any order: nothing
    resolved under one base is reused under another (autocast's recipe, the environment's, a layer's own map)."""
    recipes = RecipeMap({"*.fc1": {"weight_2d": False}, "*.fc2": "bf16"})
    bases = [nv.NVFP4Recipe(), nv.NVFP4Recipe(rht=False), nv.NVFP4Recipe(rht=False, stochastic_rounding=False)]
    for base in bases + bases[::-1]:
        assert recipes.resolve("layers.0.fc1", base) == base.replace(weight_2d=False)
        assert recipes.resolve("layers.0.qkv", base) is base
        assert recipes.resolve("layers.0.fc2", base) == BF16
    # The environment's recipe is the base when nothing else gives one: a change of the environment is seen.
    assert recipes.resolve("layers.0.fc1") == nv.NVFP4Recipe(weight_2d=False)
    monkeypatch.setenv("NVFP4_DISABLE_RHT", "1")
    assert recipes.resolve("layers.0.fc1") == nv.NVFP4Recipe(rht=False, weight_2d=False)
    monkeypatch.delenv("NVFP4_DISABLE_RHT")
    # Through the layers: the same map object under autocasts of different recipes, as autocast's map and as a
    # layer's own map.
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"fc1": nv.Linear(32, 32), "qkv": nv.Linear(32, 32),
                                 "own": nv.Linear(32, 32, recipe=RecipeMap({"*.own": {"stochastic_rounding": False}}))})
    nv.name_layers(torch.nn.ModuleDict({"block": model}))
    x = torch.randn(16, 32)
    for base in bases + bases[::-1]:
        with nv.autocast(base, recipes=recipes):
            for layer in model.values():
                layer(x)
        assert model["fc1"].last_recipe == base.replace(weight_2d=False)
        assert model["qkv"].last_recipe is base
        assert model["own"].last_recipe == base.replace(stochastic_rounding=False)
