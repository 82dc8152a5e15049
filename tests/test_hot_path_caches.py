"""The per-call work the layers skip by caching, and the changes that must still take effect at the next call:
recipes built from the environment, the quantized weight, NVFP4Tensor copies."""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.recipe import NVFP4Recipe


def run(layer, rows=32):
    x = torch.randn(rows, layer.in_features, requires_grad=True)
    layer(x).square().mean().backward()
    return layer.last_recipe


def test_an_environment_change_takes_effect_at_the_next_call(monkeypatch):
    monkeypatch.delenv("NVFP4_DISABLE_SR", raising=False)
    monkeypatch.delenv("NVFP4_BACKWARD_MODE", raising=False)
    layer = nv.Linear(64, 32)  # no recipe: the environment's, read at every forward
    assert run(layer).stochastic_rounding
    monkeypatch.setenv("NVFP4_DISABLE_SR", "1")
    assert not run(layer).stochastic_rounding
    monkeypatch.setenv("NVFP4_BACKWARD_MODE", "dequantized")
    assert run(layer).backward_mode == "dequantized"
    monkeypatch.setenv("NVFP4_DISABLE_SR", "0")
    recipe = run(layer)
    assert recipe.stochastic_rounding and recipe.backward_mode == "dequantized"
    monkeypatch.setenv("NVFP4_DISABLE_SR", "yes")
    with pytest.raises(ValueError, match="NVFP4_DISABLE_SR"):
        run(layer)


def test_recipes_from_the_same_settings_are_shared_and_overrides_are_part_of_the_key(monkeypatch):
    monkeypatch.delenv("NVFP4_OVERLAP", raising=False)
    assert NVFP4Recipe.from_env() is NVFP4Recipe.from_env()
    overlapped = NVFP4Recipe.from_env(overlap=True)
    assert overlapped.overlap and not NVFP4Recipe.from_env().overlap
    assert NVFP4Recipe.from_env(overlap=True) is overlapped
    monkeypatch.setenv("NVFP4_OVERLAP", "1")
    assert NVFP4Recipe.from_env().overlap
    with pytest.raises(ValueError):
        NVFP4Recipe.from_env(backward_mode="fast")


def test_the_weight_is_quantized_again_when_it_or_the_recipe_changes():
    layer = nv.Linear(64, 32, recipe=NVFP4Recipe(stochastic_rounding=False))
    x = torch.randn(16, 64)
    with torch.no_grad():
        first = layer(x)
        assert layer.weight_cache.quantizations == 1
        layer(x)
        assert layer.weight_cache.quantizations == 1  # reused while nothing changed
        layer.weight.mul_(2)  # an in-place update
        assert not torch.equal(layer(x), first)
        assert layer.weight_cache.quantizations == 2
        layer.recipe = NVFP4Recipe(stochastic_rounding=False, weight_2d=False)
        layer(x)
        assert layer.weight_cache.quantizations == 3
        layer.to(torch.bfloat16)  # a new dtype: a new storage
        y = layer(x.to(torch.bfloat16))
        assert layer.weight_cache.quantizations == 4 and y.dtype == torch.bfloat16
        layer.weight = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16))  # re-assigned
        layer(x.to(torch.bfloat16))
        assert layer.weight_cache.quantizations == 5


def test_nvfp4_tensor_copies_share_nothing_mutable_and_refuse_unknown_fields():
    q = nv.quantize(torch.randn(32, 64), "activation", recipe=NVFP4Recipe(rht=False))
    row = q.rowwise_only()
    assert row.columnwise_data is None and q.columnwise_data is not None
    assert row.rowwise_data is q.rowwise_data and row.shape == q.shape
    changed = q.replace(dtype=torch.float16)
    assert changed.dtype == torch.float16 and q.dtype == torch.float32
    with pytest.raises(TypeError, match="bogus"):
        q.replace(bogus=1)
