"""Fused producers on the CPU: the norm and activation definitions, the fused casts against the unfused chain
(the norm's / activation's BF16 output, then ops.quantize), their gradients, and LayerNormLinear / LayerNormMLP."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nvfp4_dist as nv
from nvfp4_dist import fused, ops
from nvfp4_dist.layernorm_linear import LayerNormLinear, LayerNormMLP, ProducerCast, ProducerInputComm
from nvfp4_dist.linear import LinearComm
from nvfp4_dist.reference import fused_producers as R
from tests.helpers.benchmarks import load_benchmark_module

RECIPES = {
    "rht": nv.NVFP4Recipe(),
    "no_rht": nv.NVFP4Recipe(rht=False),
    "plain_hadamard": nv.NVFP4Recipe(rht_random_sign=False),
    "row_scaled": nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False),
}


def spread_input(shape, seed, dtype=torch.bfloat16, offset=0.0):
    """Normal values with per-row scales over several octaves (and an offset, so LayerNorm's mean matters)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator)
    scale = torch.exp2(torch.randint(-4, 5, (*shape[:-1], 1), generator=generator).float())
    return (x * scale + offset).to(dtype)


def norm_parameters(hidden, normalization, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = 1 + 0.25 * torch.randn(hidden, generator=generator)
    bias = 0.1 * torch.randn(hidden, generator=generator) if normalization == "LayerNorm" else None
    return weight, bias


def assert_same_copies(q, r):
    for name in ("rowwise_data", "rowwise_scale", "amax_rowwise", "columnwise_data", "columnwise_scale",
                 "amax_columnwise"):
        got, expected = getattr(q, name), getattr(r, name)
        if expected is None:
            assert got is None, name
            continue
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
    assert (q.shape, q.dtype, q.rht, q.row_scaled) == (r.shape, r.dtype, r.rht, r.row_scaled)


# ------------------------------------------------------------------------------------------------------------
# The definitions

def float32_halving_tree(values):
    """Independent evaluation of the fixed order with numpy float32 scalars: per 16-block, then over blocks."""
    values = list(np.float32(v) for v in values) + [np.float32(0)] * (-len(values) % 16)

    def halving(items):
        while len(items) > 1:
            half = len(items) // 2
            items = [np.float32(items[i] + items[i + half]) for i in range(half)]
        return items[0]
    blocks = [halving(values[i:i + 16]) for i in range(0, len(values), 16)]
    blocks += [np.float32(0)] * ((1 << (len(blocks) - 1).bit_length()) - len(blocks))
    return halving(blocks)


@pytest.mark.parametrize("cols", [16, 48, 80, 256, 1000])
def test_fixed_order_row_sum_is_the_halving_tree(cols):
    v = spread_input((3, cols), seed=cols, dtype=torch.float32) ** 2
    got = R.fixed_order_row_sum(v)
    for row in range(3):
        expected = float32_halving_tree(v[row].tolist())
        assert got[row].item() == float(expected)


def test_fixed_order_differs_from_a_sequential_sum():
    # the order is part of the definition: a sequential FP32 sum of the same numbers rounds differently
    v = spread_input((64, 4096), seed=5, dtype=torch.float32) ** 2
    sequential = np.cumsum(v.numpy(), axis=1, dtype=np.float32)[:, -1]
    assert not np.array_equal(R.fixed_order_row_sum(v).numpy(), sequential)


@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("cols", [32, 100, 4096])
def test_norm_close_to_torch(normalization, cols):
    x = spread_input((8, cols), seed=cols, dtype=torch.float32, offset=3.0)
    weight, bias = norm_parameters(cols, normalization, seed=1)
    y, mean, rstd = R.norm_forward(x, weight, bias, normalization=normalization, eps=1e-5, out_dtype=torch.float32)
    if normalization == "LayerNorm":
        expected = F.layer_norm(x.double(), (cols,), weight.double(), bias.double(), 1e-5)
        torch.testing.assert_close(mean, x.double().mean(-1).float(), rtol=1e-6, atol=1e-6)
    else:
        expected = F.rms_norm(x.double(), (cols,), weight.double(), 1e-5)
        assert mean is None
    # x - mean loses the bits of the offset: FP32 rounding relative to |x| / std (up to 50 here)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_exp_and_erfc_within_a_few_ulp():
    x = torch.linspace(-103, 88.7, 400001)
    exact = torch.exp(x.double())
    normal = exact > torch.finfo(torch.float32).tiny
    error = ((R.exp(x).double() - exact).abs() / exact)[normal]
    assert error.max().item() < 2 * torch.finfo(torch.float32).eps
    z = torch.linspace(-4, 9, 200001)
    exact = torch.special.erfc(z.double())
    assert (((R.erfc(z).double() - exact) / exact).abs().max().item()) < 2e-5


def test_activations_close_to_torch():
    h = torch.linspace(-7, 7, 100001)
    torch.testing.assert_close(R.gelu(h).double(), F.gelu(h.double()), rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(R.silu(h).double(), F.silu(h.double()), rtol=2e-6, atol=1e-12)
    gate_up = spread_input((4, 64), seed=2, dtype=torch.float32)
    expected = F.silu(gate_up[:, :32].double()) * gate_up[:, 32:].double()
    torch.testing.assert_close(R.activated(gate_up, "swiglu").double(), expected, rtol=4e-6, atol=1e-12)


def test_special_values():
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 200.0, -200.0, 1e-30, float("nan")])
    e = R.exp(special)
    assert e[:7].tolist() == [1.0, 1.0, float("inf"), 0.0, float("inf"), 0.0, 1.0] and math.isnan(e[7].item())
    g = R.gelu(special)
    assert g[:3].tolist() == [0.0, 0.0, float("inf")] and g[4].item() == 200.0 and g[5].item() == 0.0
    assert math.isnan(g[7].item())
    s = R.silu(special)
    assert s[4].item() == 200.0 and s[5].item() == 0.0 and math.isnan(s[7].item())


# ------------------------------------------------------------------------------------------------------------
# The fused casts equal the unfused chain

COPIES = [(name, columnwise) for name in RECIPES for columnwise in (True, False)
          if not (columnwise and RECIPES[name].row_scaled_activation)]  # row-scaled: no columnwise copy


@pytest.mark.parametrize("recipe_name,columnwise", COPIES)
@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
def test_quantize_norm_output_equals_quantize_of_norm(recipe_name, columnwise, normalization):
    recipe = RECIPES[recipe_name]
    x = spread_input((2, 24, 96), seed=11, offset=0.5)
    weight, bias = norm_parameters(96, normalization, seed=3)
    got, mean, rstd = fused.quantize_norm_output(x, weight.bfloat16(), None if bias is None else bias.bfloat16(),
                                                 normalization=normalization, eps=1e-5, recipe=recipe,
                                                 columnwise=columnwise)
    y = fused.norm(x, weight.bfloat16(), None if bias is None else bias.bfloat16(), normalization=normalization)
    assert y.dtype == torch.bfloat16
    expected = ops.quantize(y, "activation", recipe=recipe, columnwise=columnwise)
    assert_same_copies(got, expected)
    _, ref_mean, ref_rstd = R.norm_forward(x, weight.bfloat16(), None if bias is None else bias.bfloat16(),
                                           normalization=normalization, eps=1e-5, out_dtype=torch.bfloat16)
    assert torch.equal(rstd, ref_rstd) and (mean is None) == (ref_mean is None)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", R.ACTIVATIONS)
def test_quantize_activation_output_equals_quantize_of_activation(recipe_name, name):
    recipe = RECIPES[recipe_name]
    columnwise = not recipe.row_scaled_activation
    h = spread_input((48, 128), seed=13)
    got = fused.quantize_activation_output(h, activation=name, recipe=recipe, columnwise=columnwise)
    a = fused.activation(h, activation=name)
    assert a.shape == (48, 64 if name == "swiglu" else 128) and a.dtype == torch.bfloat16
    assert_same_copies(got, ops.quantize(a, "activation", recipe=recipe, columnwise=columnwise))


def test_reduced_amaxes_are_the_ones_the_cast_uses():
    # a larger amax from another rank: the cast must use the reduced value, as quantizing the full tensor would
    x = spread_input((32, 64), seed=17)
    weight, bias = norm_parameters(64, "LayerNorm", seed=4)
    seen = []

    def reduce(amaxes):
        seen.append([a.clone() for a in amaxes])
        for amax in amaxes:
            amax.mul_(3.0)
    got, _, _ = fused.quantize_norm_output(x, weight, bias, normalization="LayerNorm", eps=1e-5,
                                           recipe=RECIPES["rht"], columnwise=True, reduce_amaxes=reduce)
    y = fused.norm(x, weight, bias, normalization="LayerNorm")
    local = ops.compute_amaxes(y, recipe=RECIPES["rht"])
    assert torch.equal(seen[0][0], local[0]) and torch.equal(seen[0][1], local[1])
    expected = ops.quantize(y, recipe=RECIPES["rht"], amax_rowwise=local[0] * 3, amax_columnwise=local[1] * 3)
    assert_same_copies(got, expected)


def test_row_scaled_amaxes_are_not_reduced():
    calls = []
    h = spread_input((16, 64), seed=19)
    fused.quantize_activation_output(h, activation="gelu", recipe=RECIPES["row_scaled"], columnwise=False,
                                     reduce_amaxes=calls.append)
    assert calls == []


def test_non_finite_input_is_rejected_unless_opted_out():
    x = spread_input((16, 32), seed=23)
    x[3, 5] = float("inf")
    weight, bias = norm_parameters(32, "RMSNorm", seed=5)
    with pytest.raises(nv.NonFiniteAmaxError):
        fused.quantize_norm_output(x, weight, bias, normalization="RMSNorm", eps=1e-5, recipe=RECIPES["rht"],
                                   columnwise=True)
    h = spread_input((16, 32), seed=23)
    h[0, 0] = float("nan")
    with pytest.raises(nv.NonFiniteAmaxError):
        fused.quantize_activation_output(h, activation="gelu", recipe=RECIPES["no_rht"], columnwise=False)
    fused.quantize_activation_output(h, activation="gelu", recipe=RECIPES["no_rht"].replace(check_finite=False),
                                     columnwise=False)


# ------------------------------------------------------------------------------------------------------------
# Gradients

@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_gradients_match_torch(normalization, dtype):
    x = spread_input((4, 6, 64), seed=29, dtype=dtype, offset=1.0).requires_grad_(True)
    weight, bias = norm_parameters(64, normalization, seed=6)
    weight = weight.to(dtype).requires_grad_(True)
    bias = None if bias is None else bias.to(dtype).requires_grad_(True)
    params = [p for p in (x, weight, bias) if p is not None]
    dy = spread_input((4, 6, 64), seed=31, dtype=dtype)
    got = torch.autograd.grad(fused.norm(x, weight, bias, normalization=normalization), params, dy)
    x64 = [p.detach().double().requires_grad_(True) for p in params]
    if normalization == "LayerNorm":
        expected = F.layer_norm(x64[0], (64,), x64[1], x64[2], 1e-5)
    else:
        expected = F.rms_norm(x64[0], (64,), x64[1], 1e-5)
    expected_grads = torch.autograd.grad(expected, x64, dy.double())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for g, e in zip(got, expected_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), e, rtol=tolerance, atol=tolerance * e.abs().max().item())


@pytest.mark.parametrize("name", R.ACTIVATIONS)
def test_activation_gradients_match_torch(name):
    h = spread_input((8, 64), seed=37, dtype=torch.float32).requires_grad_(True)
    a = fused.activation(h, activation=name)
    da = spread_input(tuple(a.shape), seed=41, dtype=torch.float32)
    (got,) = torch.autograd.grad(a, h, da)
    h64 = h.detach().double().requires_grad_(True)
    expected = F.gelu(h64) if name == "gelu" else F.silu(h64[:, :32]) * h64[:, 32:]
    (want,) = torch.autograd.grad(expected, h64, da.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_norm_output_takes_the_autocast_dtype():
    x = spread_input((4, 32), seed=43, dtype=torch.float32)
    weight, bias = norm_parameters(32, "LayerNorm", seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_dtype = fused.norm_output_dtype(x)
    assert out_dtype == torch.bfloat16 and fused.norm_output_dtype(x) == torch.float32
    y = fused.norm(x, weight, bias, out_dtype=out_dtype)
    assert torch.equal(y, fused.norm(x, weight, bias).to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------------------
# Layers

def run(module, x, dy, seed=3):
    x = x.clone().requires_grad_(True)
    y = module(x)
    torch.manual_seed(seed)
    y.backward(dy)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = None
    return y.detach(), x.grad, grads


def assert_runs_equal(a, b):
    assert torch.equal(a[0], b[0]), "output"
    assert torch.equal(a[1], b[1]), "input gradient"
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts of the fused casts the layers run (a fused == unfused check means nothing if neither fused)."""
    import nvfp4_dist.layernorm_linear as module
    calls = {"norm": 0, "activation": 0}
    for kind, name in (("norm", "quantize_norm_output"), ("activation", "quantize_activation_output")):
        original = getattr(module, name)

        def counted(*args, _original=original, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("normalization", R.NORMALIZATIONS)
def test_layernorm_linear_fused_equals_unfused(recipe_name, normalization, fused_calls):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    layer = LayerNormLinear(64, 48, normalization=normalization, recipe=recipe)
    with torch.no_grad():
        layer.layer_norm_weight.normal_(1.0, 0.2)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.normal_(0.0, 0.1)
    x = spread_input((2, 16, 64), seed=47, offset=0.3)
    dy = spread_input((2, 16, 48), seed=53)
    fused_run = run(layer, x, dy)
    expected = 1 if fused.fusion_applies(recipe, torch.bfloat16) else 0  # row-scaled: the unfused chain
    assert fused_calls["norm"] == expected
    layer.recipe = recipe.replace(fused_producers=False)
    assert_runs_equal(fused_run, run(layer, x, dy))
    assert fused_calls["norm"] == expected


@pytest.mark.parametrize("recipe_name", ["rht", "row_scaled"])
@pytest.mark.parametrize("name", R.ACTIVATIONS)
def test_layernorm_mlp_fused_equals_unfused(recipe_name, name, fused_calls):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(1)
    mlp = LayerNormMLP(64, 32, activation=name, normalization="RMSNorm", recipe=recipe)
    x = spread_input((32, 64), seed=59)
    dy = spread_input((32, 64), seed=61)
    fused_run = run(mlp, x, dy)
    expected = 1 if fused.fusion_applies(recipe, torch.bfloat16) else 0  # row-scaled: the unfused chain
    assert fused_calls == {"norm": expected, "activation": expected}
    mlp.fc1.recipe = mlp.fc2.recipe = recipe.replace(fused_producers=False)
    assert_runs_equal(fused_run, run(mlp, x, dy))


def test_layernorm_linear_is_the_norm_then_a_linear():
    torch.manual_seed(2)
    layer = LayerNormLinear(64, 32, normalization="LayerNorm", zero_centered_gamma=True)
    with torch.no_grad():
        layer.layer_norm_weight.normal_(0.0, 0.2)
        layer.layer_norm_bias.normal_(0.0, 0.1)
    linear = nv.Linear(64, 32)
    linear.load_state_dict({"weight": layer.weight, "bias": layer.bias})
    x = spread_input((16, 64), seed=67)
    weight = (layer.layer_norm_weight + 1).bfloat16()
    expected = linear(fused.norm(x, weight, layer.layer_norm_bias.bfloat16(), normalization="LayerNorm"))
    assert torch.equal(layer(x), expected)


def test_fused_mlp_backward_keeps_fc1_output_not_the_activation():
    torch.manual_seed(3)
    mlp = LayerNormMLP(64, 48, activation="gelu")
    x = spread_input((32, 64), seed=71).requires_grad_(True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mlp(x)
    high_precision = [t for t in saved if t.is_floating_point() and t.element_size() >= 2 and t.numel() >= 32 * 48]
    # the norm's input and fc1's output, nothing else: neither the norm's nor the activation's output
    assert len(high_precision) == 2
    assert any(t.data_ptr() == x.data_ptr() for t in high_precision)
    assert {tuple(t.shape) for t in high_precision} == {(32, 64), (32, 48)}
    out.sum().backward()


def test_switches_turn_the_fusion_on_and_off(monkeypatch, fused_calls):
    assert nv.NVFP4Recipe().fused_producers  # on by default (docs/fused_producers.md)
    x = spread_input((16, 32), seed=73)
    LayerNormMLP(32, 32, activation="swiglu")(x)
    assert fused_calls == {"norm": 1, "activation": 1}
    LayerNormMLP(32, 32, activation="swiglu", recipe=nv.NVFP4Recipe(fused_producers=False))(x)
    assert fused_calls == {"norm": 1, "activation": 1}
    mlp = LayerNormMLP(32, 32, activation="swiglu")
    mlp(x.float())  # the norm's output is FP32: nothing to fuse
    assert fused_calls == {"norm": 1, "activation": 1}
    monkeypatch.setenv("NVFP4_DISABLE_FUSED_PRODUCERS", "1")
    assert not nv.NVFP4Recipe.from_env().fused_producers
    mlp(x)  # no recipe given: the environment's
    assert fused_calls == {"norm": 1, "activation": 1}
    monkeypatch.delenv("NVFP4_DISABLE_FUSED_PRODUCERS")
    mlp(x)
    assert fused_calls == {"norm": 2, "activation": 2}


def test_bf16_fallback_and_disabled_autocast_run_unquantized():
    torch.manual_seed(4)
    mlp = LayerNormMLP(32, 32, activation="gelu", bf16_fallback=True)
    x = spread_input((16, 32), seed=79)
    h = F.linear(fused.norm(x, mlp.fc1.layer_norm_weight.bfloat16(), mlp.fc1.layer_norm_bias.bfloat16()),
                 mlp.fc1.weight.bfloat16(), mlp.fc1.bias.bfloat16())
    expected = F.linear(fused.activation(h, activation="gelu"), mlp.fc2.weight.bfloat16(), mlp.fc2.bias.bfloat16())
    assert torch.equal(mlp(x), expected)
    mlp.fc1.bf16_fallback = mlp.fc2.bf16_fallback = False
    with nv.autocast(enabled=False):
        assert torch.equal(mlp(x), expected)


def test_producer_comm_refuses_missing_copies():
    cast = ProducerCast(recipe=nv.NVFP4Recipe(), columnwise=False)
    comm = ProducerInputComm(LinearComm(), cast)
    with pytest.raises(RuntimeError, match="fused producer"):
        comm.quantize_input(torch.zeros(16, 16), cast.recipe, columnwise=False)
    cast.quantized = ops.quantize(torch.randn(16, 16), columnwise=False)
    with pytest.raises(RuntimeError, match="columnwise=True"):
        comm.quantize_input(torch.zeros(16, 16), cast.recipe, columnwise=True)


def test_bad_arguments_raise_value_error():
    x = torch.randn(16, 32)
    w = torch.ones(32)
    with pytest.raises(ValueError, match="normalization"):
        fused.norm(x, w, normalization="BatchNorm")
    with pytest.raises(ValueError, match="bias=None"):
        fused.norm(x, w, None, normalization="LayerNorm")
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        fused.norm(x, w, w, normalization="RMSNorm")
    with pytest.raises(ValueError, match="weight"):
        fused.norm(x, torch.ones(16), normalization="RMSNorm")
    with pytest.raises(ValueError, match="eps"):
        fused.norm(x, w, normalization="RMSNorm", eps=0.0)
    with pytest.raises(ValueError, match="activation="):
        fused.activation(x, activation="relu")
    with pytest.raises(ValueError, match="multiple of 32"):
        fused.activation(torch.randn(4, 48), activation="swiglu")
    with pytest.raises(ValueError, match="multiple of 16"):
        fused.quantize_norm_output(torch.randn(16, 40), torch.ones(40), None, normalization="RMSNorm", eps=1e-5,
                                   recipe=nv.NVFP4Recipe(), columnwise=False)
    with pytest.raises(ValueError, match="multiple of 16"):
        fused.quantize_activation_output(torch.randn(8, 32), activation="gelu", recipe=nv.NVFP4Recipe(),
                                         columnwise=True)
    with pytest.raises(ValueError, match="row-scaled"):
        fused.quantize_activation_output(torch.randn(16, 32), activation="gelu", recipe=RECIPES["row_scaled"],
                                         columnwise=True)
    with pytest.raises(ValueError, match="normalization"):
        LayerNormLinear(32, 32, normalization="GroupNorm")
    with pytest.raises(ValueError, match="activation"):
        LayerNormMLP(32, 32, activation="relu")
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        LayerNormMLP(32, 40)


# ------------------------------------------------------------------------------------------------------------
# The benchmark's arithmetic (its timings need a GPU)

@pytest.fixture(scope="module")
def bench():
    return load_benchmark_module("fused_producers")


def test_benchmark_bytes(bench):
    # SwiGLU, 8 tokens, ffn 32: input [8, 64] BF16 = 1024 bytes, output [8, 32]: two copies of 8*32/2 + 8*32/16
    moved = bench.chain_bytes(8, 64, 32, copies=2, fused_input_reads=2)
    assert moved == dict(needed=1024 + 2 * (128 + 16), unfused=1024 + 3 * 512 + 288, fused=2 * 1024 + 288)
    # a norm with the RHT copy (input and output of one width): 8 + 1.125 bytes per element unfused (x read, y
    # written and read twice, the copies written), 6 + 1.125 fused (x read for the statistics, the post-RHT amax and
    # the cast)
    norm = bench.chain_bytes(65536, 8192, 8192, copies=2, fused_input_reads=3)
    assert norm["unfused"] / norm["fused"] == pytest.approx((8 + 1.125) / (6 + 1.125))


def test_benchmark_speedups_pair_the_chains_of_each_case(bench):
    results = [dict(producer="RMSNorm", copies="c", width=4096, tokens=8192, chain="unfused", ms=3.0),
               dict(producer="RMSNorm", copies="c", width=4096, tokens=8192, chain="fused", ms=2.0),
               dict(producer="gelu", copies="c", width=14336, tokens=8192, chain="fused", ms=1.0)]
    assert bench.speedups(results) == [dict(producer="RMSNorm", copies="c", width=4096, tokens=8192, speedup=1.5)]


# ------------------------------------------------------------------------------------------------------------
# Parallel layers on gloo ranks: the norm in front of a column-parallel layer (SP: the amax all-reduce between
# its passes, its copies into the NVFP4 all-gather) and the activation in front of a row-parallel one

PARALLEL_RECIPES = {  # the reference GEMM, so that the outputs can be compared with the emulation on any device
    "rht": nv.NVFP4Recipe(gemm_backend="reference"),
    "row_scaled": RECIPES["row_scaled"].replace(gemm_backend="reference"),
    "overlap_keep_input": nv.NVFP4Recipe(gemm_backend="reference", overlap=True, overlap_min_chunk_gflops=0),
}


def _parallel_run(layer, x, dy, **forward_kwargs):
    x = x.clone().requires_grad_(True)
    y, _ = layer(x, **forward_kwargs)
    torch.manual_seed(9)
    y.backward(dy)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    return y.detach(), x.grad, grads


def check_parallel_producers(rank, world_size, device="cpu", hidden=64, local=32, seq_per_rank=16):
    """Each rank: the fused layers equal the unfused ones byte for byte, and the column-parallel output is the
    GEMM of the full norm output's copies (the amax all-reduce between the passes makes the gathered copies
    those of the full tensor) with this rank's weight shard."""
    from tests.helpers.emulation import fprop, quantize_weight
    from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
    generator = torch.Generator().manual_seed(5)
    seq, batch = seq_per_rank * world_size, 2
    tensors = [torch.randn(seq, batch, hidden, generator=generator) + 0.5,
               torch.randn(seq, batch, local * world_size, generator=generator),
               torch.randn(seq, batch, 2 * local * world_size, generator=generator),
               torch.randn(seq, batch, hidden, generator=generator)]
    x_full, dy_column, h_full, dy_row = (t.bfloat16().to(device) for t in tensors)
    column_weight = (torch.randn(local * world_size, hidden, generator=generator) * 0.1).to(device)
    row_weight = (torch.randn(hidden, local * world_size, generator=generator) * 0.1).to(device)
    norm_weight = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(device)
    norm_bias = (0.1 * torch.randn(hidden, generator=generator)).to(device)
    for name, recipe in PARALLEL_RECIPES.items():
        for sequence_parallel in (True, False):
            what = f"{name} sp={sequence_parallel} rank={rank}"
            column = ColumnParallelLinear(hidden, local * world_size, sequence_parallel=sequence_parallel,
                                          recipe=recipe, input_norm="LayerNorm", device=device,
                                          init_method=lambda w: w.copy_(column_weight),
                                          keep_input_columnwise=recipe.overlap)
            with torch.no_grad():
                column.layer_norm_weight.copy_(norm_weight)
                column.layer_norm_bias.copy_(norm_bias)
            assert column.layer_norm_weight.sequence_parallel == sequence_parallel
            x_in = x_full.chunk(world_size)[rank] if sequence_parallel else x_full
            dy_in = dy_column.chunk(world_size, dim=-1)[rank]
            fused_run = _parallel_run(column, x_in, dy_in)
            column.recipe = recipe.replace(fused_producers=False)
            assert_runs_equal(fused_run, _parallel_run(column, x_in, dy_in))
            # the gathered copies are those of the full norm output (docs/numerics.md §9)
            y_norm = fused.norm(x_full, norm_weight.bfloat16(), norm_bias.bfloat16()).reshape(-1, hidden)
            xq = R.quantize_tensor(y_norm, columnwise=False, row_scaled=recipe.row_scaled_activation)
            wq = quantize_weight(column_weight.chunk(world_size)[rank], recipe)
            expected = fprop(xq, wq, column.bias, torch.bfloat16).reshape(seq, batch, local)
            assert torch.equal(fused_run[0], expected), what + " column output"

            row = RowParallelLinear(local * world_size, hidden, sequence_parallel=sequence_parallel, recipe=recipe,
                                    device=device, init_method=lambda w: w.copy_(row_weight))
            h_in = torch.cat([half.chunk(world_size, dim=-1)[rank] for half in h_full.chunk(2, dim=-1)], dim=-1)
            dy_in = dy_row.chunk(world_size)[rank] if sequence_parallel else dy_row
            fused_run = _parallel_run(row, h_in, dy_in, activation="swiglu")
            row.recipe = recipe.replace(fused_producers=False)
            assert_runs_equal(fused_run, _parallel_run(row, h_in, dy_in, activation="swiglu"))


def test_parallel_layers_fuse_their_producers():
    from tests.helpers.distributed import run_distributed
    run_distributed(check_parallel_producers, 2)
