"""Grouped (segmented) NVFP4 quantization on one GPU (nvfp4_dist/grouped_quantize.py, csrc/amax.cu's
amax_rht_chunks / segment_amaxes, the segmented cast of csrc/quantize_tile.cuh):

- quantize_segments == the per-segment loop of quantize_operand byte for byte (codes, scales, amax bits, both
  copies, tensor flags): activations and gradients (RHT, stochastic rounding with a device seed and row offsets),
  BF16 / FP16 / FP32 input, zero-row segments, one segment, E = 8 and E = 64, rowwise-only segments of any size,
  NaN / Inf segments; stacked weights with 16x16 and 1x16 blocks (contiguous columnwise copies);
- the number of kernels it launches does not grow with the number of segments;
- nv.GroupedLinear forward + backward with the grouped quantization == the same layer with the per-expert loop.

    python -m pytest tests_multigpu/test_grouped_quantize_gpu.py -q
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import grouped_linear, grouped_quantize
from nvfp4_dist.grouped_quantize import quantize_segments, segment_offsets
from nvfp4_dist.linear import quantize_operand, quantize_weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

K = 128
DEFAULT = nv.NVFP4Recipe()
NO_RHT = nv.NVFP4Recipe(rht=False)


def _data(rows, cols=K, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=generator)
    # segments of different magnitudes, so that their amaxes differ
    x = x * torch.linspace(0.1, 40.0, rows, device="cuda")[:, None] if rows else x
    return x.to(dtype)


def _loop(x, sizes, role, recipe, *, rowwise=True, columnwise=True, sr_seed=None, sr_row_offset=0):
    offsets = segment_offsets(sizes)
    return [None if size == 0 else
            quantize_operand(x[offsets[e]:offsets[e + 1]], role, recipe, rowwise=rowwise, columnwise=columnwise,
                             sr_seed=sr_seed, sr_row_offset=sr_row_offset + offsets[e])
            for e, size in enumerate(sizes)]


def _bits(t):
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t.contiguous().view(torch.uint8)


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for e, (g, q) in enumerate(zip(got, expected)):
        if q is None:
            assert g is None, f"segment {e}"
            continue
        assert (tuple(g.shape), g.dtype, g.block_2d, g.rht, g.rht_random_sign, g.row_scaled, g.e4m3_bound) == \
            (tuple(q.shape), q.dtype, q.block_2d, q.rht, q.rht_random_sign, q.row_scaled, q.e4m3_bound), f"segment {e}"
        for name in ("rowwise_data", "rowwise_scale", "amax_rowwise", "columnwise_data", "columnwise_scale",
                     "amax_columnwise"):
            a, b = getattr(g, name), getattr(q, name)
            assert (a is None) == (b is None), f"segment {e} {name}"
            if a is not None:
                assert a.shape == b.shape, f"segment {e} {name}"
                assert torch.equal(_bits(a), _bits(b)), f"segment {e} {name}"


def _sizes(experts, seed, choices):
    generator = torch.Generator().manual_seed(seed)
    return [choices[i] for i in torch.randint(0, len(choices), (experts,), generator=generator).tolist()]


SPLITS = {
    "uneven_with_empty": [64, 0, 32, 160, 16],
    "one_expert": [256],
    "leading_and_trailing_empty": [0, 48, 0, 0, 80, 0],
    "e8": _sizes(8, 1, [0, 16, 32, 64, 128]),
    "e64": _sizes(64, 2, [0, 16, 32]),
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("role, recipe", [("activation", DEFAULT), ("gradient", DEFAULT), ("activation", NO_RHT),
                                          ("gradient", NO_RHT)], ids=["act", "grad_sr_rht", "act_no_rht",
                                                                      "grad_sr_no_rht"])
def test_activation_and_gradient_segments_match_the_loop(split, role, recipe):
    sizes = SPLITS[split]
    x = _data(sum(sizes), seed=len(sizes))
    seed = torch.tensor([0x5EED1234], dtype=torch.int64, device="cuda") if role == "gradient" else None
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        got = quantize_segments(x, sizes, role, recipe, rowwise=rowwise, columnwise=columnwise, sr_seed=seed)
        _assert_same(got, _loop(x, sizes, role, recipe, rowwise=rowwise, columnwise=columnwise, sr_seed=seed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", [DEFAULT, NO_RHT], ids=["rht", "no_rht"])
def test_fp16_fp32_inputs(dtype, recipe):
    """FP16/FP32: the RHT columnwise copy comes from the BF16 cast, the rowwise copy from x itself."""
    sizes = [32, 0, 96, 16]
    x = _data(sum(sizes), dtype=dtype, seed=3)
    seed = torch.tensor([77], dtype=torch.int64, device="cuda")
    for role in ("activation", "gradient"):
        got = quantize_segments(x, sizes, role, recipe, sr_seed=seed)
        _assert_same(got, _loop(x, sizes, role, recipe, sr_seed=seed))


def test_stochastic_rounding_row_offset_and_int_seed():
    """A shard's row offset shifts every segment's SR bits as the loop's; an int seed as a device one."""
    sizes = [48, 16, 0, 64]
    x = _data(sum(sizes), seed=4)
    for seed in (12345, 2 ** 63 + 5, torch.tensor([99], dtype=torch.int64, device="cuda")):
        for offset in (0, 16, 40):
            got = quantize_segments(x, sizes, "gradient", DEFAULT, sr_seed=seed, sr_row_offset=offset)
            _assert_same(got, _loop(x, sizes, "gradient", DEFAULT, sr_seed=seed, sr_row_offset=offset))


def test_rowwise_only_segments_of_any_size():
    sizes = [5, 0, 27, 1, 33]
    x = _data(sum(sizes), seed=6)
    for role in ("activation", "gradient"):
        got = quantize_segments(x, sizes, role, DEFAULT, rowwise=True, columnwise=False, sr_seed=7)
        _assert_same(got, _loop(x, sizes, role, DEFAULT, rowwise=True, columnwise=False, sr_seed=7))


def test_nan_and_inf_segments():
    """A segment holding NaN or Inf gets the loop's amax bits (NaN wins, as in the amax kernels)."""
    sizes = [32, 32, 16, 48]
    x = _data(sum(sizes), seed=8)
    x[3, 5] = float("nan")
    x[40, 7] = float("inf")
    x[70, 1] = -float("inf")
    x[71, 2] = float("nan")
    for role in ("activation", "gradient"):
        got = quantize_segments(x, sizes, role, DEFAULT, sr_seed=3)
        _assert_same(got, _loop(x, sizes, role, DEFAULT, sr_seed=3))


@pytest.mark.parametrize("recipe", [DEFAULT, nv.NVFP4Recipe(weight_2d=False)], ids=["2d", "1x16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stacked_weights(recipe, dtype):
    experts, out = 6, 48
    weights = [_data(out, 96, dtype=dtype, seed=10 + e) * (e + 1) for e in range(experts)]
    got = quantize_segments(torch.cat(weights), [out] * experts, "weight", recipe, contiguous_columnwise=True)
    expected = [quantize_weight(w, recipe) for w in weights]
    _assert_same(got, expected)
    assert all(q.columnwise_data.is_contiguous() and q.columnwise_scale.is_contiguous() for q in got)


def _kernels_launched(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def test_launches_do_not_grow_with_the_segments():
    counts = {}
    for experts in (2, 64):
        sizes = [32] * experts
        x = _data(sum(sizes), seed=9)
        seed = torch.tensor([5], dtype=torch.int64, device="cuda")
        counts[experts] = _kernels_launched(lambda: quantize_segments(x, sizes, "gradient", DEFAULT, sr_seed=seed))
    assert counts[2] == counts[64] and counts[2] <= 8, counts


def _layer_run(sizes, recipe, grouped_gemm, seed=3):
    torch.manual_seed(seed)
    layer = nv.GroupedLinear(len(sizes), 128, 64, bias=True, device="cuda", dtype=torch.bfloat16, recipe=recipe,
                             grouped_gemm=grouped_gemm)
    x = _data(sum(sizes), seed=11).requires_grad_()
    dy = _data(sum(sizes), 64, seed=12)
    y = layer(x, sizes)
    torch.manual_seed(21)
    y.backward(dy)
    return [y, x.grad, *[w.grad for w in layer.weights()], *[b.grad for b in layer.biases()]]


@pytest.mark.parametrize("grouped_gemm", [False, True], ids=["gemm_loop", "grouped_gemm"])
@pytest.mark.parametrize("recipe", [DEFAULT, NO_RHT, nv.NVFP4Recipe(weight_2d=False, stochastic_rounding=False)],
                         ids=["default", "no_rht", "1x16_no_sr"])
def test_grouped_linear_equals_its_per_expert_quantization(monkeypatch, recipe, grouped_gemm):
    sizes = [64, 0, 32, 16, 128]
    got = _layer_run(sizes, recipe, grouped_gemm)
    monkeypatch.setattr(grouped_quantize, "segmented_kernels_apply", lambda *args: False)
    monkeypatch.setattr(grouped_linear, "segmented_kernels_apply", lambda *args: False)
    expected = _layer_run(sizes, recipe, grouped_gemm)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
