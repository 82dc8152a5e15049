"""Bad and unusual input to the single-process API: each case gives a clear error naming the problem, or the
correct result. Never a crash inside torch, a silent wrong answer or stale weights.

Cases: recipe field types, recipe passed as a dict, quantize's flags, seeds and given amaxes, autograd history
of quantized tensors, empty batches, shapes that are not multiples of 16, dtypes, devices, non-contiguous
inputs, NaN/Inf in the input, weight and gradient of nv.Linear, finite inputs whose RHT overflows, and every
way of changing a weight while its quantized copy is cached.
"""
import copy

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.recipe import RecipeTypeError

NAN, INF = float("nan"), float("inf")


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# Recipes

@pytest.mark.parametrize("field,value", [("rht", "False"), ("check_finite", None), ("stochastic_rounding", 1),
                                         ("weight_2d", "yes"), ("bf16_first_layers", 1.5),
                                         ("bf16_last_layers", True), ("overlap_min_chunk_gflops", "256"),
                                         ("gemm_backend", 3), ("overlap", None)])
def test_recipe_field_of_the_wrong_type_is_refused_naming_it(field, value):
    with pytest.raises(TypeError, match=f"^{field}={value!r} .*must be of type"):
        nv.NVFP4Recipe(**{field: value})
    with pytest.raises(ValueError):  # also a ValueError, the package's error for bad arguments
        nv.NVFP4Recipe(**{field: value})


def test_recipe_as_a_dict_is_refused_with_the_way_to_build_one():
    for build in (lambda: nv.Linear(64, 32, recipe={"rht": False}),
                  lambda: nv.quantize(bf16(16, 64), recipe={"rht": False}),
                  lambda: nv.autocast({"rht": False}).__enter__()):
        with pytest.raises(RecipeTypeError, match=r"recipe=\{'rht': False\} \(dict\).*NVFP4Recipe\(\*\*recipe\)"):
            build()


def test_recipe_fingerprint_is_stable_and_tells_recipes_apart():
    assert nv.NVFP4Recipe().fingerprint() == nv.NVFP4Recipe().fingerprint()
    fingerprints = {nv.NVFP4Recipe(**change).fingerprint() for change in
                    ({}, {"rht": False}, {"stochastic_rounding": False}, {"bf16_first_layers": 1},
                     {"gemm_backend": "reference"}, {"check_finite": False})}
    assert len(fingerprints) == 6


# ---------------------------------------------------------------------------------------------------------
# quantize / dequantize arguments

@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(rowwise="yes"), TypeError, "rowwise='yes'"),
    (dict(columnwise=1), TypeError, "columnwise=1"),
    (dict(role="gradient", sr_seed=1.5), TypeError, "sr_seed=1.5"),
    (dict(role="gradient", sr_seed=-1), ValueError, r"sr_seed=-1: must be in \[0, 2\*\*64\)"),
    (dict(role="gradient", sr_seed=2 ** 64), ValueError, "sr_seed="),
    (dict(sr_row_offset=True), ValueError, "sr_row_offset=True"),
    (dict(role="bias"), ValueError, "role='bias'"),
    (dict(check_finite="no"), TypeError, "check_finite='no'"),
    (dict(amax_rowwise=torch.tensor([-1.0])), ValueError, "amax_rowwise: the given amax has a negative value"),
    (dict(amax_columnwise=torch.tensor([-0.5])), ValueError, "amax_columnwise: the given amax has a negative"),
    (dict(amax_rowwise=torch.tensor([NAN])), nv.NonFiniteAmaxError, "amax_rowwise: the given amax is not finite"),
    (dict(amax_rowwise=torch.tensor([INF])), nv.NonFiniteAmaxError, "amax_rowwise: the given amax is not finite"),
    (dict(amax_rowwise=torch.tensor([[1.0]])), ValueError, r"amax_rowwise.shape=\(1, 1\)"),
    (dict(amax_rowwise=torch.tensor([1.0, 2.0])), ValueError, r"amax_rowwise.shape=\(2,\)"),
    (dict(amax_rowwise=torch.tensor([1.0], dtype=torch.float64)), ValueError, "amax_rowwise must be a float32"),
    (dict(amax_rowwise=1.0), ValueError, "amax_rowwise must be a float32 tensor"),
])
def test_bad_quantize_arguments_are_named(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        nv.quantize(bf16(32, 64), **kwargs)


def test_non_finite_given_amax_is_accepted_when_the_check_is_off():
    q = nv.quantize(bf16(32, 64), amax_rowwise=torch.tensor([INF]), columnwise=False,
                    recipe=nv.NVFP4Recipe(check_finite=False))
    assert q.amax_rowwise.isinf().all()


def test_a_valid_given_amax_is_used():
    x = bf16(32, 64)
    amax = x.float().abs().amax().reshape(1) * 2
    q = nv.quantize(x, amax_rowwise=amax, columnwise=False)
    assert torch.equal(q.amax_rowwise, amax)


def test_quantized_tensors_carry_no_autograd_history():
    x = bf16(32, 64).requires_grad_()
    amax = x.detach().float().abs().amax().reshape(1).requires_grad_()
    for q in (nv.quantize(x), nv.quantize(x, "gradient"), nv.quantize(x, "weight"),
              nv.quantize(x, amax_rowwise=amax, columnwise=False)):
        assert all(t is None or (t.grad_fn is None and not t.requires_grad) for t in q.tensors())
        assert not nv.dequantize(q).requires_grad
    assert all(a is None or not a.requires_grad for a in nv.compute_amaxes(x))
    with pytest.raises(RuntimeError, match="does not require grad"):  # no gradient flows back to x
        nv.dequantize(nv.quantize(x)).float().sum().backward()


@pytest.mark.parametrize("shape,pattern", [
    ((16, 0), r"x.shape=\(16, 0\): the last dim \(0\) must be a positive multiple of 16"),
    ((16, 40), r"x.shape=\(16, 40\): the last dim \(40\)"),
    ((64,), r"x.shape=\(64,\): need at least 2 dims"),
    ((24, 64), r"a columnwise copy needs the leading dims' product \(24\)"),
])
def test_shapes_that_cannot_be_quantized_are_named(shape, pattern):
    with pytest.raises(ValueError, match=pattern):
        nv.quantize(torch.zeros(shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_unsupported_input_dtypes_are_named(dtype):
    with pytest.raises(ValueError, match=f"x.dtype={dtype}"):
        nv.quantize(torch.zeros(16, 64).to(dtype))


def test_empty_tensors_quantize_to_empty_nvfp4_tensors():
    for rows, columnwise in ((0, False), (0, True)):
        x = torch.empty(rows, 64, dtype=torch.bfloat16)
        q = nv.quantize(x, columnwise=columnwise)
        assert q.shape == x.shape and q.rowwise_data.shape == (0, 32) and q.rowwise_scale.shape == (0, 4)
        assert q.has_columnwise == columnwise
        if columnwise:
            assert q.columnwise_data.shape == (64, 0)
            assert nv.dequantize(q, copy="columnwise").shape == (0, 64)
        assert nv.dequantize(q).shape == (0, 64)
        assert torch.equal(q.amax_rowwise, torch.zeros(1))
    q = nv.quantize(torch.empty(2, 0, 64, dtype=torch.bfloat16), "gradient")
    assert q.shape == (2, 0, 64) and nv.dequantize(q).shape == (2, 0, 64)
    assert [a.tolist() for a in nv.compute_amaxes(torch.empty(0, 64, dtype=torch.bfloat16))] == [[0.0], [0.0]]


def test_non_contiguous_input_quantizes_like_its_contiguous_copy():
    x = bf16(64, 32)
    strided = x.t()  # [32, 64], not contiguous
    assert not strided.is_contiguous()
    for role in ("activation", "weight", "gradient"):
        a = nv.quantize(strided, role, sr_seed=7)
        b = nv.quantize(strided.contiguous(), role, sr_seed=7)
        assert all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a.tensors(), b.tensors())
                   if u is not None)


# ---------------------------------------------------------------------------------------------------------
# NaN / Inf

def test_nan_or_inf_input_names_x():
    for bad in (NAN, INF, -INF):
        x = bf16(32, 64)
        x[3, 5] = bad
        with pytest.raises(nv.NonFiniteAmaxError,
                           match=r"^x: amax_rowwise is not finite \(amax_rowwise=.*\): the tensor holds NaN or Inf"):
            nv.quantize(x)


def test_finite_input_whose_rht_overflows_says_so():
    x = torch.full((16, 64), -3.38e38).to(torch.bfloat16)  # finite BF16; its Hadamard sums exceed FP32
    assert bool(torch.isfinite(x).all())
    with pytest.raises(nv.NonFiniteAmaxError, match="the tensor is finite, but its random Hadamard transform"):
        nv.quantize(x)
    with pytest.raises(nv.NonFiniteAmaxError, match="or its random Hadamard transform"):  # no rowwise amax to tell
        nv.quantize(x, rowwise=False)
    q = nv.quantize(x, recipe=nv.NVFP4Recipe(rht=False))  # without the RHT it quantizes
    assert bool(torch.isfinite(q.amax_columnwise).all())


def test_linear_names_the_tensor_and_the_layer_that_holds_nan():
    torch.manual_seed(0)
    layer = nv.Linear(64, 32)
    nv.linear.name_layers(torch.nn.ModuleDict({"fc1": layer}))
    x = bf16(16, 64)
    with torch.no_grad():
        layer.weight[1, 2] = NAN
    with pytest.raises(nv.NonFiniteAmaxError, match=r"^the weight of fc1: .*the tensor holds NaN or Inf"):
        layer(x)
    with torch.no_grad():
        layer.weight[1, 2] = 0.0
    bad = x.clone()
    bad[0, 0] = INF
    with pytest.raises(nv.NonFiniteAmaxError, match=r"^the input of fc1: "):
        layer(bad)
    y = layer(x.requires_grad_())
    dy = torch.ones_like(y)
    dy[2, 3] = NAN
    with pytest.raises(nv.NonFiniteAmaxError, match=r"^the gradient of fc1: "):
        y.backward(dy)
    unnamed = nv.Linear(64, 32)
    with torch.no_grad():
        unnamed.weight.fill_(NAN)
    with pytest.raises(nv.NonFiniteAmaxError, match=r"^the weight of Linear\(in_features=64, out_features=32\)"):
        unnamed(x)


def test_check_finite_false_lets_nan_through_without_error():
    layer = nv.Linear(64, 32, recipe=nv.NVFP4Recipe(check_finite=False))
    x = bf16(16, 64)
    x[0, 0] = NAN
    assert bool(layer(x).isnan().any())


# ---------------------------------------------------------------------------------------------------------
# Layer arguments

def test_float64_layer_blames_its_dtype_not_the_input():
    with pytest.raises(ValueError, match=r"^dtype=torch.float64: NVFP4 layers take parameters"):
        nv.Linear(64, 32, dtype=torch.float64)
    layer = nv.Linear(64, 32).double()
    with pytest.raises(ValueError, match=r"^weight.dtype=torch.float64 \(the layer's parameters\)"):
        layer(torch.zeros(16, 64, dtype=torch.float64))
    fallback = nv.Linear(64, 32, dtype=torch.float64, bf16_fallback=True)  # the BF16 path takes any float dtype
    assert fallback.weight.dtype == torch.float64


@pytest.mark.parametrize("build,pattern", [
    (lambda: nv.Linear(40, 32), "in_features=40"),
    (lambda: nv.Linear(64, 24), "out_features=24"),
    (lambda: nv.Linear(0, 32), "in_features=0"),
    (lambda: nv.Linear(64.0, 32), "in_features=64.0"),
])
def test_layer_sizes_that_are_not_multiples_of_16_are_named(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


@pytest.mark.parametrize("x,pattern", [
    (torch.zeros(16, 48), r"input.shape=\(16, 48\): the last dim must be in_features=64"),
    (torch.zeros(16, 0), r"input.shape=\(16, 0\)"),
    (torch.zeros(16, 64, dtype=torch.float64), "input.dtype=torch.float64"),
    (torch.zeros(16, 64, dtype=torch.int64), "input.dtype=torch.int64"),
    (torch.zeros(16, 64, device="meta"), "input.device=meta"),
    ([[0.0] * 64] * 16, "input must be a torch.Tensor"),
])
def test_bad_layer_inputs_are_named(x, pattern):
    with pytest.raises(ValueError, match=pattern):
        nv.Linear(64, 32)(x)


def test_token_count_not_a_multiple_of_16_trains_only_when_padded_or_runs_without_grad():
    layer = nv.Linear(64, 32)
    with pytest.raises(ValueError, match=r"input.shape=\(3, 5, 64\): training needs the token count"):
        layer(torch.zeros(3, 5, 64))
    with torch.no_grad():
        assert layer(torch.zeros(3, 5, 64)).shape == (3, 5, 32)


def test_empty_batch_works_like_nn_linear():
    torch.manual_seed(0)
    layer = nv.Linear(64, 32)
    plain = torch.nn.Linear(64, 32)
    plain.load_state_dict(layer.state_dict())
    for shape in ((0, 64), (0, 4, 64), (4, 0, 64)):
        outputs = []
        for module in (layer, plain):
            module.zero_grad(set_to_none=True)
            x = torch.empty(shape, requires_grad=True)
            y = module(x)
            y.sum().backward()
            outputs.append((y, x.grad, module.weight.grad, module.bias.grad))
        for got, expected in zip(*outputs):
            assert got.shape == expected.shape and torch.equal(got, expected)
        assert layer.weight.grad.abs().sum() == 0


def test_non_contiguous_layer_input_gives_the_contiguous_result():
    torch.manual_seed(0)
    layer = nv.Linear(64, 32)
    x = bf16(64, 32).t()
    assert torch.equal(layer(x), layer(x.contiguous()))


# ---------------------------------------------------------------------------------------------------------
# No stale weights: every way of writing a weight is seen, and unchanged weights are reused

def _fresh_output(layer, x):
    fresh = nv.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=layer.weight.dtype)
    fresh.load_state_dict(layer.state_dict())
    return fresh(x)


def _changes():
    """(name, change(layer)) for each way of writing a layer's weight."""
    def in_place(layer):
        with torch.no_grad():
            layer.weight.mul_(0.5)

    def data_in_place(layer):
        layer.weight.data.mul_(0)

    def data_assign(layer):
        layer.weight.data = torch.randn_like(layer.weight)

    def held_data_alias(layer):  # a .data view taken before the forward that cached the copy
        layer.held_alias.add_(1.0)

    def storage_alias(layer):  # another tensor on the same storage (no shared version counter)
        alias = torch.empty(0, dtype=layer.weight.dtype).set_(layer.weight.untyped_storage(), 0, layer.weight.shape)
        alias.neg_()

    def view_data(layer):
        layer.weight[0].data.fill_(3.0)

    def load_state_dict(layer):
        layer.load_state_dict({**layer.state_dict(), "weight": torch.randn_like(layer.weight)})

    def load_state_dict_assign(layer):
        layer.load_state_dict({**layer.state_dict(), "weight": torch.randn_like(layer.weight)}, assign=True)

    def vector_to_parameters(layer):
        torch.nn.utils.vector_to_parameters(torch.randn(layer.weight.numel()), [layer.weight])

    def optimizer(kind):
        def step(layer):
            layer.weight.grad = torch.randn_like(layer.weight)
            kind([layer.weight], lr=0.5).step()
        return step

    def init(layer):
        torch.nn.init.normal_(layer.weight)

    return [("in_place", in_place), ("data_in_place", data_in_place), ("data_assign", data_assign),
            ("held_data_alias", held_data_alias), ("storage_alias", storage_alias), ("view_data", view_data),
            ("load_state_dict", load_state_dict), ("load_state_dict_assign", load_state_dict_assign),
            ("vector_to_parameters", vector_to_parameters), ("init", init),
            ("adamw_fused", optimizer(lambda p, lr: torch.optim.AdamW(p, lr=lr, fused=True))),
            ("adamw_foreach", optimizer(lambda p, lr: torch.optim.AdamW(p, lr=lr, foreach=True))),
            ("sgd_loop", optimizer(lambda p, lr: torch.optim.SGD(p, lr=lr, foreach=False)))]


@pytest.mark.parametrize("name,change", _changes(), ids=[name for name, _ in _changes()])
def test_a_changed_weight_is_never_served_from_the_cache(name, change):
    torch.manual_seed(0)
    layer = nv.Linear(64, 32, bias=False)
    layer.held_alias = layer.weight.data
    x = bf16(16, 64)
    layer(x)
    layer(x)
    assert layer.weight_cache.quantizations == 1  # unchanged: reused
    before = layer(x)
    change(layer)
    after = layer(x)
    assert torch.equal(after, _fresh_output(layer, x)), name
    assert not torch.equal(after, before), name


def test_unchanged_weight_is_quantized_once_per_step_across_micro_batches():
    torch.manual_seed(0)
    layer = nv.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)
    x = bf16(32, 64)
    for step in range(3):
        for _ in range(4):
            layer(x).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert layer.weight_cache.quantizations == step + 1
    layer(x)
    assert layer.weight_cache.quantizations == 4


def test_weight_parameter_survives_copies_and_conversions():
    layer = nv.Linear(64, 32)
    assert isinstance(layer.weight, torch.nn.Parameter)
    clone = copy.deepcopy(layer)
    assert torch.equal(clone.weight, layer.weight) and isinstance(clone.weight, nv.linear.WeightParameter)
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and isinstance(layer.weight, nv.linear.WeightParameter)
    x = bf16(16, 64)
    assert torch.equal(layer(x), _fresh_output(layer, x))


def test_dtype_change_of_the_weight_is_seen():
    torch.manual_seed(0)
    layer = nv.Linear(64, 32)
    x = bf16(16, 64)
    layer(x)
    layer.to(torch.float16)
    assert torch.equal(layer(x), _fresh_output(layer, x))


def test_gemm_of_empty_operands_gives_empty_or_zero_results():
    empty = nv.quantize(torch.empty(0, 64, dtype=torch.bfloat16))
    weight = nv.quantize(bf16(32, 64), "weight")
    assert nv.gemm(empty, weight).shape == (0, 32)
    gradient = nv.quantize(torch.empty(0, 32, dtype=torch.bfloat16), "gradient")
    wgrad = nv.gemm(gradient, empty, a_copy="columnwise", b_copy="columnwise")  # a sum over no tokens
    assert wgrad.shape == (32, 64) and not wgrad.any()
