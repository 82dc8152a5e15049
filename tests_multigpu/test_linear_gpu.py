"""nvfp4_dist.Linear on one GPU (CUDA quantization kernels):

- with the reference GEMM backend the layer equals the reference emulation run on the same GPU, exactly
  (the kernels must produce the reference bytes; the GEMMs are then the same computation);
- with the default (Hopper emulated / Blackwell cuBLASLt) GEMM it is within the backends' difference of that
  emulation, element by element: both BF16 roundings plus the tensor cores' accumulation allowance on the sum of
  |terms| (tests/helpers/oracle.py, backend_difference_bound);
- each backward mode (recipe.backward_mode) against the float64 computation of tests/test_backward_modes.py;
- weight-cache invalidation, BF16 fallback vs nn.Linear, saved bytes, at realistic sizes.

    python -m pytest tests_multigpu/test_linear_gpu.py -q
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.linear import Linear
from tests.helpers import oracle as O
from tests.helpers.emulation import draw_seed_like_backward, emulate_linear, linear_magnitudes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

RECIPES = {
    "default": nv.NVFP4Recipe(),
    "no_rht": nv.NVFP4Recipe(rht=False),
    "no_sr": nv.NVFP4Recipe(stochastic_rounding=False),
    "1d_weight": nv.NVFP4Recipe(weight_2d=False),
    "row_scaled": nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False),
}


def layer_and_emulation(recipe, act_dtype=torch.bfloat16, param_dtype=torch.float32, tokens=(4, 64),
                        features=(256, 192)):
    torch.manual_seed(0)
    layer = Linear(*features, recipe=recipe, device="cuda", dtype=param_dtype)
    x = torch.randn(*tokens, features[0], device="cuda").to(act_dtype)
    dy = torch.randn(*tokens, features[1], device="cuda").to(act_dtype)
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    torch.manual_seed(9)
    y.backward(dy)
    got = (y.detach(), xg.grad, layer.weight.grad, layer.bias.grad)
    torch.manual_seed(9)
    seed = draw_seed_like_backward("cuda")
    expected = emulate_linear(x, layer.weight, layer.bias, dy, recipe, seed)
    return got, expected, (x, layer.weight.detach(), dy, seed)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_with_reference_gemm(name, act_dtype):
    recipe = RECIPES[name].replace(gemm_backend="reference")
    got, expected, _ = layer_and_emulation(recipe, act_dtype)
    for what, g, e in zip(("y", "dx", "dW", "db"), got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, what
        assert torch.equal(g, e), f"{name} {act_dtype} {what}: max diff {(g.float() - e.float()).abs().max().item()}"


@pytest.mark.parametrize("name", list(RECIPES))
def test_default_gemm_within_the_backends_difference(name):
    recipe = RECIPES[name]
    got, expected, (x, weight, dy, seed) = layer_and_emulation(recipe)
    magnitudes = linear_magnitudes(x, weight, dy, recipe, seed)
    for what, g, e in zip(("y", "dx", "dW"), got, expected):
        unit = O.FP32_UNIT_ROUNDOFF if e.dtype == torch.float32 else O.BF16_UNIT_ROUNDOFF
        value = O.as_float32(e).astype("float64")
        O.check_within(f"{name} {what}", g, value, O.backend_difference_bound(value, magnitudes[what], unit))
    assert torch.equal(got[3], expected[3]), f"{name} db"  # the same token sum on the same device


@pytest.mark.parametrize("mode", ["default", "high_precision", "dequantized"])
def test_backward_modes_against_float64(mode):
    """The kernels' copies, the GPU GEMMs (NVFP4 in default, BF16 otherwise) and the layer's plumbing of each mode
    within BF16 rounding of float64 arithmetic on the reference's copies."""
    from tests.test_backward_modes import assert_matches, expected_backward, expected_fprop
    recipe = nv.NVFP4Recipe(backward_mode=mode)
    torch.manual_seed(0)
    layer = Linear(256, 192, bias=False, recipe=recipe, device="cuda", dtype=torch.float32)
    x = torch.randn(512, 256, device="cuda").to(torch.bfloat16)
    dy = torch.randn(512, 192, device="cuda").to(torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    torch.manual_seed(9)
    y.backward(dy)
    torch.manual_seed(9)
    dx, dw = expected_backward(mode, recipe, x, dy, layer.weight.detach(), sr_seed=draw_seed_like_backward("cuda"))
    assert_matches(y.detach(), expected_fprop(recipe, x, layer.weight.detach()), f"{mode} y", torch.bfloat16)
    assert_matches(xg.grad, dx, f"{mode} dx", torch.bfloat16)
    assert_matches(layer.weight.grad, dw, f"{mode} dW", torch.bfloat16)


def test_weight_cache_invalidated_by_optimizer_step():
    torch.manual_seed(0)
    layer = Linear(512, 512, device="cuda")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        layer(x).float().sum().backward()
    assert layer.weight_cache.quantizations == 1
    optimizer.step()
    y = layer(x)
    assert layer.weight_cache.quantizations == 2
    fresh = Linear(512, 512, device="cuda")
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(y, fresh(x))


def test_bf16_fallback_matches_nn_linear():
    torch.manual_seed(0)
    reference = torch.nn.Linear(1024, 768, device="cuda", dtype=torch.bfloat16)
    layer = Linear(1024, 768, device="cuda", dtype=torch.bfloat16, bf16_fallback=True)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(8, 128, 768, device="cuda", dtype=torch.bfloat16)
    results = []
    for module in (reference, layer):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.backward(dy)
        results.append((y.detach(), xi.grad, module.weight.grad, module.bias.grad))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_saved_activation_bytes_at_most_030_of_bf16():
    layer = Linear(4096, 4096, device="cuda")
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = layer(x)
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    ratio = held / (x.numel() * 2)
    assert ratio <= 0.3, ratio


def test_lean_weight_layers_match_cached_and_hold_less_memory():
    """keep_quantized_weight=False (Megatron's unflagged micro-batches): identical outputs and gradients on the
    CUDA kernels, and at least one quantized weight copy less held between forward and backward."""
    from nvfp4_dist.parallel import ColumnParallelLinear
    in_features, out_features, tokens = 4096, 8192, 256
    x = torch.randn(tokens, 1, in_features, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, 1, out_features, device="cuda", dtype=torch.bfloat16)
    results, held = [], []
    for keep in (True, False):
        torch.manual_seed(0)
        layer = ColumnParallelLinear(in_features, out_features, recipe=nv.NVFP4Recipe(), device="cuda",
                                     params_dtype=torch.bfloat16)
        layer.keep_quantized_weight = keep
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        inp = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        out = layer(inp)[0]
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)  # output, saved tensors, cached weight copies
        out.backward(dy)
        results.append((out.detach(), inp.grad, layer.weight.grad))
        del layer, out, inp
    for lean, cached in zip(results[1], results[0]):
        assert torch.equal(lean, cached)
    one_copy = out_features * in_features // 2 + out_features * in_features // 16  # packed codes + E4M3 scales
    assert held[0] - held[1] >= one_copy, (held, one_copy)
    print(f"held between forward and backward: cached {held[0] / 2**20:.1f} MiB, lean {held[1] / 2**20:.1f} MiB")
