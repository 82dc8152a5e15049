"""GroupedLinear on CPU: bit-identical to a loop of per-expert NVFP4 linears (nvfp4_dist/grouped_linear.py).

The loop twin runs each expert's rows through nv.Linear's own autograd Function (nvfp4_linear) with expert e's
output gradient quantized with the grouped call's stochastic-rounding seed at row offset o_e, the definition in
the module docstring; with stochastic rounding off the twin is a plain list of nv.Linear modules.
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import grouped_linear, ops
from nvfp4_dist.linear import LinearComm, nvfp4_linear, quantize_operand

IN, OUT = 64, 32
RECIPES = {
    "default": nv.NVFP4Recipe(),
    "no_rht": nv.NVFP4Recipe(rht=False),
    "no_sr": nv.NVFP4Recipe(stochastic_rounding=False),
    "1x16_weights": nv.NVFP4Recipe(weight_2d=False),
    "row_scaled": nv.NVFP4Recipe(row_scaled_activation=True),
}


class PinnedSeedComm(LinearComm):
    """TP=1 comm whose output gradient is quantized with a given SR seed at a given row offset."""

    def __init__(self, seed, row_offset):
        self.seed, self.row_offset = seed, row_offset

    def quantize_grad_output(self, dy2d, recipe, *, sr_seed, rowwise, columnwise):
        return quantize_operand(dy2d, "gradient", recipe, rowwise=rowwise, columnwise=columnwise,
                                sr_seed=self.seed if recipe.stochastic_rounding else None,
                                sr_row_offset=self.row_offset)


def _layers(experts, bias, seed=3):
    torch.manual_seed(seed)
    grouped = nv.GroupedLinear(experts, IN, OUT, bias=bias)
    torch.manual_seed(seed)
    loop = [nv.Linear(IN, OUT, bias=bias) for _ in range(experts)]
    return grouped, loop


def _inputs(rows, seed=5):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, IN, generator=generator) * 2).to(torch.bfloat16)
    dy = torch.randn(rows, OUT, generator=generator).to(torch.bfloat16)
    return x, dy


def _grouped_run(layer, x, dy, sizes, grad_seed=11):
    x = x.clone().requires_grad_()
    y = layer(x, sizes)
    torch.manual_seed(grad_seed)
    y.backward(dy)
    return y, x.grad, [w.grad for w in layer.weights()], [None if b is None else b.grad for b in layer.biases()]


def _loop_run(loop, x, dy, sizes, recipe, grad_seed=11):
    """Per-expert nv.Linear Functions; SR seed: the one the grouped backward draws first after manual_seed."""
    torch.manual_seed(grad_seed)
    seed = ops.draw_sr_seed()
    x = x.clone().requires_grad_()
    outputs, start = [], 0
    for layer, size in zip(loop, sizes):
        piece = x[start:start + size]
        if size:
            weight_q = layer.weight_cache.get(layer.weight, recipe)
            outputs.append(nvfp4_linear(piece, layer.weight, layer.bias, recipe, weight_q=weight_q,
                                        comm=PinnedSeedComm(seed, start)))
        else:
            with nv.autocast(recipe):
                outputs.append(layer(piece))
        start += size
    y = torch.cat(outputs)
    y.backward(dy)
    return y, x.grad, [layer.weight.grad for layer in loop], [layer.bias.grad if layer.bias is not None else None
                                                            for layer in loop]


def _assert_identical(got, expected):
    names = ("output", "input gradient", "weight gradients", "bias gradients")
    for name, a, b in zip(names, got, expected):
        if isinstance(a, list):
            for e, (ga, gb) in enumerate(zip(a, b)):
                if ga is None and gb is None:
                    continue
                assert ga is not None and gb is not None, f"{name}[{e}]: one side has no gradient"
                assert ga.dtype == gb.dtype, f"{name}[{e}]"
                assert torch.equal(ga, gb), f"{name}[{e}] differs (max {float((ga - gb).abs().max())})"
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs"


@pytest.mark.parametrize("name", list(RECIPES))
def test_bit_identical_to_per_expert_loop(name):
    recipe = RECIPES[name]
    sizes = [32, 0, 48, 16]  # uneven, one expert without tokens
    grouped, loop = _layers(len(sizes), bias=True)
    grouped.recipe = recipe
    x, dy = _inputs(sum(sizes))
    got = _grouped_run(grouped, x, dy, sizes)
    expected = _loop_run(loop, x, dy, sizes, recipe)
    _assert_identical(got, expected)
    assert torch.count_nonzero(got[2][1]) == 0 and torch.count_nonzero(got[3][1]) == 0  # the expert without tokens
    assert grouped.last_recipe == recipe


def test_plain_nv_linear_loop_without_stochastic_rounding():
    """Without SR, the twin is literally E nv.Linear modules built with the same seed."""
    recipe = nv.NVFP4Recipe(stochastic_rounding=False)
    sizes = [16, 64, 0, 0, 32]
    grouped, loop = _layers(len(sizes), bias=False)
    for e, layer in enumerate(loop):
        assert torch.equal(layer.weight, grouped.weights()[e])
    x, dy = _inputs(sum(sizes), seed=8)
    with nv.autocast(recipe):
        got = _grouped_run(grouped, x, dy, torch.tensor(sizes))
        xl = x.clone().requires_grad_()
        y = torch.cat([layer(piece) for layer, piece in zip(loop, torch.split(xl, sizes))])
        y.backward(dy)
    _assert_identical(got, (y, xl.grad, [layer.weight.grad for layer in loop], [None] * len(sizes)))


def test_seed_is_one_per_call_with_row_offsets():
    """A different per-expert seed (the same seed without the row offset) gives other gradient bytes: the test above
    therefore pins the documented rule, not any rule."""
    recipe = nv.NVFP4Recipe(rht=False)
    sizes = [32, 32]
    grouped, loop = _layers(2, bias=False)
    grouped.recipe = recipe
    x, dy = _inputs(64, seed=9)
    got = _grouped_run(grouped, x, dy, sizes)
    torch.manual_seed(11)
    seed = ops.draw_sr_seed()
    xl = x.clone().requires_grad_()
    y = torch.cat([nvfp4_linear(xl[32 * e:32 * (e + 1)], layer.weight, None, recipe,
                                weight_q=layer.weight_cache.get(layer.weight, recipe), comm=PinnedSeedComm(seed, 0))
                   for e, layer in enumerate(loop)])
    y.backward(dy)
    assert torch.equal(loop[0].weight.grad, got[2][0])  # expert 0's offset is 0 either way
    assert not torch.equal(loop[1].weight.grad, got[2][1])


def test_all_tokens_on_one_expert_and_empty_input():
    recipe = nv.NVFP4Recipe()
    grouped, loop = _layers(3, bias=True)
    grouped.recipe = recipe
    x, dy = _inputs(48, seed=4)
    _assert_identical(_grouped_run(grouped, x, dy, [0, 48, 0]), _loop_run(loop, x, dy, [0, 48, 0], recipe))
    empty = torch.zeros(0, IN, dtype=torch.bfloat16, requires_grad=True)
    y = grouped(empty, [0, 0, 0])
    assert y.shape == (0, OUT) and grouped.last_recipe is None
    grouped.zero_grad()
    y.sum().backward()
    assert all(torch.count_nonzero(w.grad) == 0 for w in grouped.weights())


def test_main_grad_and_delayed_wgrad():
    recipe = nv.NVFP4Recipe(stochastic_rounding=False)
    sizes = [16, 0, 32]
    x, dy = _inputs(48, seed=6)
    reference, _ = _layers(3, bias=True)
    reference.recipe = recipe
    _, _, expected_grads, _ = _grouped_run(reference, x, dy, sizes)

    fused, _ = _layers(3, bias=True)
    fused.recipe, fused.accumulate_into_main_grad = recipe, True
    for weight in fused.weights():
        weight.main_grad = torch.ones(weight.shape, dtype=torch.float32)
    _grouped_run(fused, x, dy, sizes)
    for weight, grad in zip(fused.weights(), expected_grads):
        assert torch.equal(weight.main_grad, 1 + grad.float())

    delayed, _ = _layers(3, bias=True)
    delayed.recipe, delayed.delay_wgrad = recipe, True
    _grouped_run(delayed, x, dy, sizes)
    assert all(w.grad is None for w in delayed.weights()) and len(delayed.wgrad_store) == 1
    delayed.backward_dw()
    for weight, grad in zip(delayed.weights(), expected_grads):
        assert torch.equal(weight.grad, grad)


def _partial_grouped_gemm(done: int, calls: list):
    """A stand-in for hot_path.grouped_gemm (the C++ call runs on CUDA only) that does the first `done` operand
    pairs with gemm() and reports them done, recording (pairs, accumulate) per call."""
    def grouped_gemm(a_ops, a_copy, b_ops, b_copy, outs, *, recipe, biases=None, accumulate=False):
        calls.append((len(a_ops), accumulate))
        for i in range(min(done, len(a_ops))):
            nv.gemm(a_ops[i], b_ops[i], a_copy=a_copy, b_copy=b_copy, out_dtype=outs[i].dtype,
                    bias=None if biases is None else biases[i], recipe=recipe,
                    **({"accumulate_into": outs[i]} if accumulate else {"out": outs[i]}))
        return min(done, len(a_ops))
    return grouped_gemm


@pytest.mark.parametrize("done", [0, 1, 3])
@pytest.mark.parametrize("main_grad", ["none", "all", "some"])
def test_grouped_gemm_call_and_loop_share_the_experts(monkeypatch, done, main_grad):
    """Each GEMM stage hands its experts to one grouped call (fprop, dgrad, wgrad: three calls) and runs the ones it
    did not take by gemm(): results equal the loop whatever the split, with the weight gradients accumulated into
    main_grad by the call where every expert has one, and wgrad left to the loop where only some have."""
    recipe = nv.NVFP4Recipe(stochastic_rounding=False)
    sizes = [32, 0, 16, 48]
    x, dy = _inputs(sum(sizes), seed=12)
    reference, _ = _layers(4, bias=True)
    reference.recipe, reference.grouped_gemm = recipe, False
    expected = _grouped_run(reference, x, dy, sizes)
    layer, _ = _layers(4, bias=True)
    layer.recipe = recipe
    if main_grad != "none":
        layer.accumulate_into_main_grad = True
        for e, weight in enumerate(layer.weights()):
            if main_grad == "all" or e % 2:
                weight.main_grad = torch.ones(weight.shape, dtype=torch.float32)
    calls = []
    monkeypatch.setattr(grouped_linear.hot_path, "grouped_gemm", _partial_grouped_gemm(done, calls))
    got = _grouped_run(layer, x, dy, sizes)
    wgrad_calls = [] if main_grad == "some" else [(3, main_grad == "all")]
    assert calls == [(3, False), (3, False)] + wgrad_calls  # the three experts with tokens
    for a, b in zip(got[:2], expected[:2]):
        assert torch.equal(a, b)
    for grad, bias_grad, weight, expected_grad, expected_bias in zip(got[2], got[3], layer.weights(), expected[2],
                                                                     expected[3]):
        assert torch.equal(bias_grad, expected_bias)
        if getattr(weight, "main_grad", None) is not None:
            assert torch.equal(weight.main_grad, 1 + expected_grad.float())
        else:
            assert torch.equal(grad, expected_grad)


@pytest.mark.parametrize("sizes, message", [
    ([16, 16], "num_experts=3"),
    ([16, 16, -16], "split_sizes[2]=-16"),
    ([16, 16, 32], "sum to 64"),
    ([16, 16.0, 16], "split_sizes[1]=16.0"),
    (torch.tensor([16.0, 16.0, 16.0]), "1D of integers"),
    ("16,16,16", "must be a list"),
    ([8, 24, 16], "split_sizes[0]=8"),
])
def test_bad_split_sizes_are_refused(sizes, message):
    layer = nv.GroupedLinear(3, IN, OUT)
    x = torch.randn(48, IN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layer(x, sizes)
    with torch.no_grad():  # without training any size is fine
        assert layer(x, [8, 24, 16]).shape == (48, OUT)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_experts=0"):
        nv.GroupedLinear(0, IN, OUT)
    with pytest.raises(ValueError, match="in_features=40"):
        nv.GroupedLinear(2, 40, OUT)
    layer = nv.GroupedLinear(2, IN, OUT, recipe=nv.NVFP4Recipe(backward_mode="high_precision"))
    with pytest.raises(ValueError, match="backward_mode='high_precision'"):
        layer(torch.randn(32, IN), [16, 16])
    assert [name for name, _ in layer.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]


def test_bf16_fallback_is_the_unquantized_loop():
    sizes = [16, 0, 16]
    torch.manual_seed(1)
    layer = nv.GroupedLinear(3, IN, OUT, bf16_fallback=True)
    x, dy = _inputs(32, seed=2)
    y, _, grads, _ = _grouped_run(layer, x, dy, sizes)
    expected = torch.cat([torch.nn.functional.linear(piece, w.to(x.dtype), b.to(x.dtype))
                          for piece, w, b in zip(torch.split(x, sizes), layer.weights(), layer.biases())])
    assert torch.equal(y, expected) and layer.last_recipe is None
    assert torch.count_nonzero(grads[1]) == 0


def test_skip_bias_add_returns_the_biases():
    sizes = [16, 32]
    torch.manual_seed(2)
    plain = nv.GroupedLinear(2, IN, OUT, recipe=nv.NVFP4Recipe(stochastic_rounding=False))
    torch.manual_seed(2)
    skipping = nv.GroupedLinear(2, IN, OUT, recipe=nv.NVFP4Recipe(stochastic_rounding=False), skip_bias_add=True)
    x, _ = _inputs(48, seed=3)
    output, biases = skipping(x, sizes)
    assert biases == skipping.biases()
    with torch.no_grad():
        without = nv.GroupedLinear(2, IN, OUT, bias=False, recipe=plain.recipe)
        for source, target in zip(plain.weights(), without.weights()):
            target.copy_(source)
    assert torch.equal(output, without(x, sizes))
    assert not torch.equal(output, plain(x, sizes))


def test_rowwise_input_feeds_fprop_and_x_feeds_wgrad():
    """A given rowwise copy (NVFP4 MoE dispatch: one amax per token) is fprop's operand as it is; the wgrad copy is
    quantized from x per expert (docs/numerics.md §13)."""
    recipe = nv.NVFP4Recipe(stochastic_rounding=False)
    sizes = [32, 0, 16]
    x, dy = _inputs(48, seed=14)
    given = ops.quantize(x, "activation", rowwise=True, columnwise=False,
                         recipe=recipe.replace(row_scaled_activation=True))
    x_hat = ops.dequantize(given, dtype=torch.bfloat16)
    grouped, loop = _layers(3, bias=True)
    grouped.recipe = recipe
    xg = x_hat.clone().requires_grad_()
    y = grouped(xg, sizes, rowwise_input=given)
    y.backward(dy)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            weight_q = loop[e].weight_cache.get(loop[e].weight, recipe)
            expected = nv.gemm(given.rowwise_rows(start, start + size), weight_q, out_dtype=torch.bfloat16,
                               bias=loop[e].bias)
            assert torch.equal(y[start:start + size], expected)
            dyq = quantize_operand(dy[start:start + size], "gradient", recipe, rowwise=False, columnwise=True)
            xq = quantize_operand(x_hat[start:start + size], "activation", recipe, rowwise=False, columnwise=True)
            assert torch.equal(grouped.weights()[e].grad,
                               nv.gemm(dyq, xq, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32))
        start += size
    plain = _layers(3, bias=True)[0]
    plain.recipe = recipe
    assert not torch.equal(plain(x_hat, sizes), y)  # x_hat requantized per expert is another operand
    with pytest.raises(ValueError, match="rowwise_input"):
        grouped(x_hat, sizes, rowwise_input=given.rowwise_rows(0, 16))


def test_name_layers_names_grouped_linears():
    model = torch.nn.Sequential(nv.Linear(32, 32), torch.nn.Sequential(nv.GroupedLinear(4, 32, 32)))
    nv.name_layers(model)
    assert model[0].layer_name == "0" and model[1][0].layer_name == "1.0"


def test_delayed_wgrad_takes_the_grouped_call_when_run(monkeypatch):
    """delay_wgrad: backward hands fprop's and dgrad's experts to the grouped call, backward_dw the wgrad's; the
    weight gradients equal the loop's."""
    recipe = nv.NVFP4Recipe(stochastic_rounding=False)
    sizes = [16, 32, 0]
    x, dy = _inputs(sum(sizes), seed=13)
    reference, _ = _layers(3, bias=False)
    reference.recipe, reference.grouped_gemm = recipe, False
    expected = _grouped_run(reference, x, dy, sizes)
    layer, _ = _layers(3, bias=False)
    layer.recipe, layer.delay_wgrad = recipe, True
    calls = []
    monkeypatch.setattr(grouped_linear.hot_path, "grouped_gemm", _partial_grouped_gemm(2, calls))
    got = _grouped_run(layer, x, dy, sizes)
    assert calls == [(2, False), (2, False)] and all(w.grad is None for w in layer.weights())
    layer.backward_dw()
    assert calls[2:] == [(2, False)]
    assert torch.equal(got[1], expected[1])
    for weight, grad in zip(layer.weights(), expected[2]):
        assert torch.equal(weight.grad, grad)
