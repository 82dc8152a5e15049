"""nvfp4_dist.Linear against an emulation built from the reference functions (exact), plus its contracts."""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.autocast import autocast
from nvfp4_dist.linear import Linear
from tests.helpers.emulation import draw_seed_like_backward, emulate_linear

RECIPES = {
    "default": nv.NVFP4Recipe(),
    "no_rht": nv.NVFP4Recipe(rht=False),
    "no_sr": nv.NVFP4Recipe(stochastic_rounding=False),
    "1d_weight": nv.NVFP4Recipe(weight_2d=False),
    "plain_hadamard": nv.NVFP4Recipe(rht_random_sign=False),
    "row_scaled": nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False),
    "row_scaled_rht_sr": nv.NVFP4Recipe(row_scaled_activation=True),
    "4over6_weights": nv.NVFP4Recipe(nvfp4_4over6="weights"),
    "4over6_all_mse_fast": nv.NVFP4Recipe(rht=False, nvfp4_4over6="all", nvfp4_4over6_err_mode="MSE",
                                          nvfp4_4over6_err_use_fast_math=True),
    "4over6_all_448": nv.NVFP4Recipe(rht=False, nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="none"),
}


def run_layer(layer, x, dy, seed):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    torch.manual_seed(seed)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def emulate(layer, x, dy, recipe, seed):
    torch.manual_seed(seed)
    return emulate_linear(x, layer.weight, layer.bias, dy, recipe, draw_seed_like_backward())


def assert_same(got, expected):
    for name, g, e in zip(("y", "dx", "dW", "db"), got, expected):
        if e is None:
            assert g is None, name
            continue
        assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, e.dtype, g.shape, e.shape)
        assert torch.equal(g, e), f"{name}: max diff {(g.float() - e.float()).abs().max().item()}"


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_matches_reference_emulation(recipe_name):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    layer = Linear(64, 48, recipe=recipe)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    dy = torch.randn(2, 16, 48, dtype=torch.bfloat16)
    assert_same(run_layer(layer, x, dy, seed=7), emulate(layer, x, dy, recipe, seed=7))


@pytest.mark.parametrize("act_dtype,param_dtype", [(torch.float16, torch.float32), (torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("bias", [True, False])
def test_dtypes_and_bias_match_emulation(act_dtype, param_dtype, bias):
    recipe = nv.NVFP4Recipe()
    torch.manual_seed(1)
    layer = Linear(32, 16, bias=bias, dtype=param_dtype, recipe=recipe)
    x = torch.randn(32, 32, dtype=act_dtype)
    dy = torch.randn(32, 16, dtype=act_dtype)
    got = run_layer(layer, x, dy, seed=3)
    assert got[0].dtype == act_dtype and got[2].dtype == param_dtype
    assert_same(got, emulate(layer, x, dy, recipe, seed=3))


def test_stochastic_rounding_seed_comes_from_torch_generator():
    torch.manual_seed(0)
    layer = Linear(32, 32, bias=False, recipe=nv.NVFP4Recipe())
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    dy = torch.randn(32, 32, dtype=torch.bfloat16)
    first = run_layer(layer, x, dy, seed=5)[1]
    layer.weight.grad = None
    again = run_layer(layer, x, dy, seed=5)[1]
    layer.weight.grad = None
    other = run_layer(layer, x, dy, seed=6)[1]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_weight_cache_reused_across_micro_batches_and_invalidated_by_update():
    torch.manual_seed(0)
    recipe = nv.NVFP4Recipe()
    layer = Linear(32, 32, recipe=recipe)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    for _ in range(3):  # gradient accumulation: three micro-batches, one quantization
        layer(x).float().sum().backward()
    assert layer.weight_cache.quantizations == 1
    optimizer.step()
    y = layer(x)
    assert layer.weight_cache.quantizations == 2
    fresh = Linear(32, 32, recipe=recipe)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(y, fresh(x))
    with torch.no_grad():  # a manual in-place update is also seen
        layer.weight.mul_(0.5)
    layer(x)
    assert layer.weight_cache.quantizations == 3
    layer.weight.data.mul_(2.0)  # a write through .data is seen too
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x), fresh(x))
    assert layer.weight_cache.quantizations == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_fallback_matches_nn_linear(dtype):
    torch.manual_seed(0)
    reference = torch.nn.Linear(40, 24, dtype=dtype)  # not multiples of 16: fine in the fallback
    torch.manual_seed(0)
    layer = Linear(40, 24, dtype=dtype, bf16_fallback=True)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), layer.parameters()))
    x = torch.randn(3, 5, 40, dtype=dtype)
    dy = torch.randn(3, 5, 24, dtype=dtype)
    results = []
    for module in (reference, layer):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.backward(dy)
        results.append((y, xi.grad, module.weight.grad, module.bias.grad))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_autocast_disabled_runs_bf16_and_autocast_recipe_applies():
    torch.manual_seed(0)
    layer = Linear(32, 32, dtype=torch.bfloat16)
    plain = torch.nn.Linear(32, 32, dtype=torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    with autocast(enabled=False):
        assert torch.equal(layer(x), plain(x))
    recipe = nv.NVFP4Recipe(weight_2d=False, rht=False)
    explicit = Linear(32, 32, dtype=torch.bfloat16, recipe=recipe)
    explicit.load_state_dict(layer.state_dict())
    with autocast(recipe):
        inside = layer(x)
    assert torch.equal(inside, explicit(x))
    assert not torch.equal(layer(x), inside)  # outside the block the default (2D weight) recipe is back


def test_state_dict_and_init_compatible_with_nn_linear():
    torch.manual_seed(3)
    reference = torch.nn.Linear(32, 16)
    torch.manual_seed(3)
    layer = Linear(32, 16)
    assert reference.state_dict().keys() == layer.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(value, layer.state_dict()[key])
    no_bias = Linear(32, 16, bias=False)
    no_bias.load_state_dict(torch.nn.Linear(32, 16, bias=False).state_dict())


def test_saved_activation_bytes_at_most_030_of_bf16():
    torch.manual_seed(0)
    layer = Linear(256, 256, recipe=nv.NVFP4Recipe())
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    layer(x)  # fill the weight cache
    cache_pointers = {t.data_ptr() for t in layer.weight_cache.quantized.tensors() if t is not None}
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    activation_bytes = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in cache_pointers)
    ratio = activation_bytes / (x.numel() * 2)
    assert ratio <= 0.3, ratio
    assert ratio >= 0.28  # the columnwise copy (0.5625 bytes per element) is what is saved


def test_accumulate_into_main_grad_and_delayed_wgrad():
    recipe = nv.NVFP4Recipe()
    torch.manual_seed(0)
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    dy = torch.randn(32, 16, dtype=torch.bfloat16)
    plain = Linear(32, 16, recipe=recipe)
    expected = run_layer(plain, x, dy, seed=2)

    fused = Linear(32, 16, recipe=recipe, accumulate_into_main_grad=True)
    fused.load_state_dict(plain.state_dict())
    fused.weight.main_grad = torch.ones(16, 32)
    fused.weight.grad_added_to_main_grad = False
    fused.weight.zero_out_wgrad = True
    got = run_layer(fused, x, dy, seed=2)
    assert fused.weight.grad_added_to_main_grad is True
    assert torch.equal(got[2], torch.zeros(16, 32))
    wgrad_fp32 = fused.weight.main_grad - 1
    torch.testing.assert_close(wgrad_fp32, expected[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[3], expected[3])

    delayed = Linear(32, 16, recipe=recipe, delay_wgrad=True)
    delayed.load_state_dict(plain.state_dict())
    got = run_layer(delayed, x, dy, seed=2)
    assert got[2] is None and len(delayed.wgrad_store) == 1
    assert torch.equal(got[1], expected[1])
    delayed.backward_dw()
    assert torch.equal(delayed.weight.grad, expected[2]) and not delayed.wgrad_store


def test_inference_accepts_any_token_count_training_needs_multiple_of_16():
    layer = Linear(32, 16)
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert layer(x).shape == (3, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        layer(x)  # training needs the columnwise (wgrad) copy of x


def test_bad_sizes_and_inputs_raise_value_error():
    with pytest.raises(ValueError, match="in_features=24"):
        Linear(24, 32)
    with pytest.raises(ValueError, match="out_features=40"):
        Linear(32, 40)
    layer = Linear(32, 16)
    with pytest.raises(ValueError, match="in_features=32"):
        layer(torch.randn(16, 48))
    with pytest.raises(ValueError, match="dtype"):
        layer(torch.randint(0, 3, (16, 32)))
