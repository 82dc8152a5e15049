"""nvfp4_dist.GroupedLinear on one GPU (CUDA quantization kernels), the twin of tests/test_grouped_linear.py:

- grouped_gemm=False: bit-identical to the per-expert loop of nv.Linear's Function (output, input gradient, every
  weight and bias gradient), each expert's output gradient quantized with the call's SR seed at its row offset;
  recipes default, no RHT, no SR, 1x16 weights, row-scaled; zero-token experts and uneven splits;
- grouped_gemm=True (the default; one C++ call per GEMM stage on the Hopper emulation): bit-identical to the loop,
  main_grad accumulation included;
- bad split sizes refused.

    python -m pytest tests_multigpu/test_grouped_linear_gpu.py -q
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import grouped_linear, ops
from nvfp4_dist.linear import nvfp4_linear
from tests.test_grouped_linear import PinnedSeedComm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

IN, OUT = 256, 192
SIZES = [128, 0, 64, 320, 16]
RECIPES = {
    "default": nv.NVFP4Recipe(),
    "no_rht": nv.NVFP4Recipe(rht=False),
    "no_sr": nv.NVFP4Recipe(stochastic_rounding=False),
    "1x16_weights": nv.NVFP4Recipe(weight_2d=False),
    "row_scaled": nv.NVFP4Recipe(row_scaled_activation=True),
}


def _data(rows, seed=5):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, IN, device="cuda", generator=generator) * 2).to(torch.bfloat16)
    dy = torch.randn(rows, OUT, device="cuda", generator=generator).to(torch.bfloat16)
    return x, dy


def _grouped(recipe, grouped_gemm, sizes, x, dy):
    torch.manual_seed(3)
    layer = nv.GroupedLinear(len(sizes), IN, OUT, recipe=recipe, device="cuda", grouped_gemm=grouped_gemm)
    xg = x.clone().requires_grad_()
    y = layer(xg, sizes)
    torch.manual_seed(11)
    y.backward(dy)
    return (y, xg.grad, [w.grad for w in layer.weights()], [b.grad for b in layer.biases()])


def _loop(recipe, sizes, x, dy):
    torch.manual_seed(3)
    loop = [nv.Linear(IN, OUT, recipe=recipe, device="cuda") for _ in sizes]
    torch.manual_seed(11)
    seed = ops.draw_sr_seed(dy)
    xl = x.clone().requires_grad_()
    outputs, start = [], 0
    for layer, size in zip(loop, sizes):
        piece = xl[start:start + size]
        if size:
            outputs.append(nvfp4_linear(piece, layer.weight, layer.bias, recipe,
                                        weight_q=layer.weight_cache.get(layer.weight, recipe),
                                        comm=PinnedSeedComm(seed, start)))
        else:
            outputs.append(layer(piece))
        start += size
    y = torch.cat(outputs)
    y.backward(dy)
    return (y, xl.grad, [layer.weight.grad for layer in loop], [layer.bias.grad for layer in loop])


def _flat(result):
    y, dx, dws, dbs = result
    return [("output", y), ("input gradient", dx)] + [(f"weight{e} gradient", g) for e, g in enumerate(dws)] + \
        [(f"bias{e} gradient", g) for e, g in enumerate(dbs)]


@pytest.mark.parametrize("name", list(RECIPES))
def test_loop_gemm_is_bit_identical_to_per_expert_linears(name):
    recipe = RECIPES[name]
    x, dy = _data(sum(SIZES))
    got = _flat(_grouped(recipe, False, SIZES, x, dy))
    expected = _flat(_loop(recipe, SIZES, x, dy))
    for (label, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {label} differs"
    assert torch.count_nonzero(got[2 + 1][1]) == 0  # expert 1 has no tokens


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_gemm_is_bit_identical_to_the_loop(name, monkeypatch):
    """grouped_gemm=True (one C++ call per GEMM stage on the Hopper emulation) gives the loop's bytes. The grouped
    call takes dgrad and wgrad (with per-tensor amaxes; wgrad of the row-scaled recipe has per-row ones) and leaves
    fprop to gemm() here: the layer's FP32 biases are added by gemm()'s epilogue to the BF16 output, cuBLASLt's bias
    epilogue takes a bias of the output's dtype only (a BF16 layer's fprop: test_grouped_gemm_takes_bf16_fprop)."""
    recipe = RECIPES[name]
    x, dy = _data(sum(SIZES), seed=7)
    expected = _flat(_grouped(recipe, False, SIZES, x, dy))
    done = []
    original = grouped_linear.hot_path.grouped_gemm
    monkeypatch.setattr(grouped_linear.hot_path, "grouped_gemm",
                        lambda *args, **kwargs: done.append(original(*args, **kwargs)) or done[-1])
    got = _flat(_grouped(recipe, True, SIZES, x, dy))
    if torch.cuda.get_device_capability() < (10, 0):
        active = sum(1 for size in SIZES if size)
        assert done == ([0, active, 0] if name == "row_scaled" else [0, active, active]), done
    for (label, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {label} differs"


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_gemm_takes_bf16_fprop(bias, monkeypatch):
    """BF16 parameters (biases of the output's dtype, or none): all three stages in the grouped call, the loop's
    bytes; an uneven split (rows not on 256-byte boundaries) falls back to gemm() with the same results."""
    recipe = RECIPES["no_sr"]
    done = []
    original = grouped_linear.hot_path.grouped_gemm
    monkeypatch.setattr(grouped_linear.hot_path, "grouped_gemm",
                        lambda *args, **kwargs: done.append(original(*args, **kwargs)) or done[-1])
    for sizes in (SIZES, [48, 0, 80, 13, 3]):
        x, dy = _data(sum(sizes), seed=9)
        results = {}
        done.clear()
        for grouped_gemm in (False, True):
            torch.manual_seed(3)
            layer = nv.GroupedLinear(len(sizes), IN, OUT, bias=bias, recipe=recipe, device="cuda",
                                     dtype=torch.bfloat16, grouped_gemm=grouped_gemm)
            if sizes == SIZES:
                xg = x.clone().requires_grad_()
                y = layer(xg, sizes)
                y.backward(dy)
                results[grouped_gemm] = [y, xg.grad, *[w.grad for w in layer.weights()]]
            else:  # inference: splits of any size
                with torch.no_grad():
                    results[grouped_gemm] = [layer(x, sizes)]
        for a, b in zip(results[True], results[False]):
            assert torch.equal(a, b)
        if torch.cuda.get_device_capability() < (10, 0):
            active = sum(1 for size in sizes if size)
            assert done[0] == (active if sizes == SIZES else 0), done


def test_grouped_gemm_accumulates_into_main_grad_as_the_loop():
    recipe = RECIPES["no_sr"]
    x, dy = _data(sum(SIZES), seed=8)
    grads = {}
    for grouped_gemm in (False, True):
        torch.manual_seed(3)
        layer = nv.GroupedLinear(len(SIZES), IN, OUT, recipe=recipe, device="cuda", grouped_gemm=grouped_gemm,
                                 accumulate_into_main_grad=True)
        for weight in layer.weights():
            weight.main_grad = torch.full(weight.shape, 0.25, device="cuda")
        layer(x.clone().requires_grad_(), SIZES).backward(dy)
        grads[grouped_gemm] = [weight.main_grad for weight in layer.weights()]
    for e, (a, b) in enumerate(zip(grads[True], grads[False])):
        assert torch.equal(a, b), f"expert {e}'s main_grad differs"


def test_bad_split_sizes_are_refused():
    layer = nv.GroupedLinear(3, IN, OUT, device="cuda")
    x = torch.randn(48, IN, device="cuda", dtype=torch.bfloat16)
    for sizes in ([16, 16], [16, 16, 32], [16, -16, 48], [8, 24, 16]):
        with pytest.raises(ValueError, match="split_sizes"):
            layer(x, sizes)
