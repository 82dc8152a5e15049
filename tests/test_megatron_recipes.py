"""Per-layer recipes in a Megatron-Core GPTModel at TP=2 with sequence parallelism (gloo, CPU).

The decoder-block spec names each linear as GPTModel does ("decoder.layers.<n>.self_attention.linear_qkv") and
gives it the recipe map; each layer records the recipe its forward ran with (last_recipe, None for BF16), which
the test compares with the map's rules: the first and last layers BF16, the attention projections on 4over6
(docs/numerics.md §12), one MLP on the high-precision backward, the other linears on the base recipe.
"""
import logging
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from tests.test_megatron import TP, _config, _gpt, _gpt_loss, _init_megatron  # noqa: E402

LAYERS = 4
ATTENTION = {"nvfp4_4over6": "all", "rht": False}
MLP_2 = {"backward_mode": "high_precision"}


def _linears(model) -> dict:
    """{qualified module name: module} of the NVFP4 linears."""
    from nvfp4_dist.parallel.megatron import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear
    return {name: module for name, module in model.named_modules()
            if isinstance(module, (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear))}


def _expected(name: str, base, bf16_layers=(0, LAYERS - 1)):
    if int(name.split(".")[2]) in bf16_layers:
        return None
    if ".self_attention." in name:
        return base.replace(**ATTENTION)
    return base.replace(**MLP_2) if name.startswith("decoder.layers.2.mlp.") else base


def _recipes_worker(rank, world_size):
    import nvfp4_dist as nv
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec, get_gpt_layer_nvfp4_spec
    _init_megatron(TP)
    config = _config(num_layers=LAYERS, gated_linear_unit=True, sequence_parallel=True)
    base = nv.NVFP4Recipe(stochastic_rounding=False)
    recipe_map = {"decoder.layers.0.*": "bf16", f"decoder.layers.{LAYERS - 1}.*": "bf16",
                  "*.self_attention.linear_qkv": ATTENTION, "*.self_attention.linear_proj": ATTENTION,
                  "decoder.layers.2.mlp.*": MLP_2, "*.cross_attention.*": "bf16"}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("nvfp4_dist").addHandler(handler)
    try:
        spec = get_gpt_decoder_block_nvfp4_spec(config, recipe=base, recipe_map=recipe_map)
    finally:
        logging.getLogger("nvfp4_dist").removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno == logging.WARNING] == [
        "recipe_map: '*.cross_attention.*' matches none of this pipeline stage's NVFP4 linears "
        "(decoder.layers.0.self_attention.linear_qkv, ...)"]
    model = _gpt(config, spec, seed=11)
    linears = _linears(model)
    assert len(linears) == 4 * LAYERS
    for name, layer in linears.items():  # the spec's names are the model's module names
        assert layer.layer_name == name
    loss = _gpt_loss(model)
    assert torch.isfinite(loss)
    for name, layer in linears.items():
        assert layer.last_recipe == _expected(name, base), (name, layer.last_recipe)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    reference = _gpt_loss(_gpt(config, get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=LAYERS), seed=11))
    assert abs(float(loss) - float(reference)) < 0.05 * float(reference)

    # Layers kept in BF16 by the counts stay BF16 whatever the map says; without a base the map's dict entries
    # change the enclosing autocast's recipe.
    spec = get_gpt_decoder_block_nvfp4_spec(config, recipe_map={"*": {"weight_2d": False}}, bf16_first_layers=2)
    model = _gpt(config, spec, seed=11)
    autocast_recipe = nv.NVFP4Recipe(rht=False)
    with nv.autocast(autocast_recipe):
        _gpt_loss(model)
    changed = autocast_recipe.replace(weight_2d=False)
    for name, layer in _linears(model).items():
        assert layer.last_recipe == (None if int(name.split(".")[2]) < 2 else changed), (name, layer.last_recipe)

    # A layer spec with a RecipeMap as its recipe: the model is named once with nv.name_layers.
    model = _gpt(_config(num_layers=LAYERS, gated_linear_unit=True, sequence_parallel=False),
                 get_gpt_layer_nvfp4_spec(recipe=nv.RecipeMap(recipe_map, base=base)), seed=11)
    nv.name_layers(model)
    _gpt_loss(model)
    for name, layer in _linears(model).items():
        assert layer.last_recipe == _expected(name, base), (name, layer.last_recipe)

    # A dict entry that the base refuses is reported when the spec is built, naming the key.
    with pytest.raises(ValueError, match=r"recipe_map: key '\*': nvfp4_4over6='all' cannot be combined with rht"):
        get_gpt_decoder_block_nvfp4_spec(config, recipe=base, recipe_map={"*": {"nvfp4_4over6": "all"}})


def test_megatron_gpt_per_layer_recipes_at_tp2_sp():
    run_distributed(_recipes_worker, TP)


def test_the_gpu_runs_recipe_file_resolves_as_intended():
    """tests_multigpu/megatron_recipes.yaml (the TP=2 SP GPU run's file) on the 8-layer model's linear names."""
    import pathlib
    import nvfp4_dist as nv
    path = pathlib.Path(__file__).resolve().parents[1] / "tests_multigpu" / "megatron_recipes.yaml"
    recipes = nv.RecipeMap.from_file(path)
    base = nv.NVFP4Recipe()
    recipes.check(base)
    names = [f"decoder.layers.{n}.{sub}" for n in range(8) for sub in
             ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert recipes.unmatched(names) == []
    four_over_six = base.replace(nvfp4_4over6="all", rht=False)
    for name in names:
        layer = int(name.split(".")[2])
        expected = ("bf16" if layer in (0, 7) else four_over_six if ".self_attention." in name else base)
        assert recipes.resolve(name, base) == expected, name


def _whole_recipe_worker(rank, world_size):
    """The decoder-block spec with a 4over6 recipe (and the row-scaled recipe in both backwards) as its `recipe`:
    every linear runs it, the losses are finite and near BF16's, and differ from the default recipe's (the recipe
    reaches the quantization); the row-scaled recipe's two backwards give the same loss and other gradients."""
    import nvfp4_dist as nv
    from nvfp4_dist.parallel.megatron import get_gpt_decoder_block_nvfp4_spec
    _init_megatron(TP)
    config = _config(num_layers=2, gated_linear_unit=True, sequence_parallel=True)
    plain = nv.NVFP4Recipe(stochastic_rounding=False, rht=False)
    recipes = {"default": plain, "4over6 weights": plain.replace(nvfp4_4over6="weights"),
               "4over6 all": plain.replace(nvfp4_4over6="all", nvfp4_4over6_err_mode="MSE"),
               "row-scaled": plain.replace(row_scaled_activation=True),
               "row-scaled, BF16 backward": plain.replace(row_scaled_activation=True, backward_mode="dequantized")}
    reference = float(_gpt_loss(_gpt(config, get_gpt_decoder_block_nvfp4_spec(config, bf16_first_layers=2), seed=11)))
    losses, weight_grads = {}, {}
    for name, recipe in recipes.items():
        model = _gpt(config, get_gpt_decoder_block_nvfp4_spec(config, recipe=recipe), seed=11)
        losses[name] = float(_gpt_loss(model))
        linears = _linears(model)
        weight_grads[name] = linears["decoder.layers.1.mlp.linear_fc1"].weight.grad
        assert len(linears) == 8 and all(layer.last_recipe == recipe for layer in linears.values()), name
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()), name
        assert abs(losses[name] - reference) < 0.05 * reference, (name, losses[name], reference)
    assert losses["4over6 weights"] != losses["default"] and losses["4over6 all"] != losses["4over6 weights"]
    assert losses["row-scaled"] != losses["default"]
    assert losses["row-scaled, BF16 backward"] == losses["row-scaled"]
    assert not torch.equal(weight_grads["row-scaled, BF16 backward"], weight_grads["row-scaled"])


def test_decoder_block_spec_with_a_4over6_or_row_scaled_recipe_at_tp2_sp():
    run_distributed(_whole_recipe_worker, TP)
