"""nvfp4_dist/grouped_quantize.py on CPU: the per-segment loop it falls back to (the reference), segment
bookkeeping, the chunk-amax expansion, and the errors for bad splits. The kernels' byte-for-byte match with the
loop is tests_multigpu/test_grouped_quantize_gpu.py."""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.grouped_quantize import (check_segments, chunk_amaxes, quantize_segments, segment_offsets,
                                         segmented_kernels_apply)
from nvfp4_dist.linear import quantize_operand

DEFAULT = nv.NVFP4Recipe()


def _x(rows, cols=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * 3).to(torch.bfloat16)


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return all((s is None and t is None) or torch.equal(s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s,
                                                         t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
               for s, t in zip(a.tensors(), b.tensors())) and (a.shape, a.rht, a.block_2d) == (b.shape, b.rht,
                                                                                               b.block_2d)


def test_offsets():
    assert segment_offsets([]) == [0]
    assert segment_offsets([16, 0, 32]) == [0, 16, 16, 48]


@pytest.mark.parametrize("role", ["activation", "gradient", "weight"])
def test_cpu_is_the_per_segment_loop(role):
    sizes = [32, 0, 16, 48]
    x = _x(sum(sizes))
    got = quantize_segments(x, sizes, role, DEFAULT, sr_seed=123, sr_row_offset=16)
    offsets = segment_offsets(sizes)
    for e, size in enumerate(sizes):
        expected = None if size == 0 else quantize_operand(
            x[offsets[e]:offsets[e + 1]], role, DEFAULT, sr_seed=123, sr_row_offset=16 + offsets[e])
        assert _same(got[e], expected), e


def test_cpu_rowwise_only_any_sizes_and_fp32_rht():
    sizes = [3, 0, 13]
    x = _x(16).float()
    got = quantize_segments(x, sizes, "activation", DEFAULT, columnwise=False)
    assert got[1] is None and got[0].rows == 3 and not got[0].has_columnwise
    both = quantize_segments(x, [16], "gradient", DEFAULT, sr_seed=5)
    assert _same(both[0], quantize_operand(x, "gradient", DEFAULT, sr_seed=5))
    assert both[0].rht and both[0].dtype == torch.float32


def test_all_empty_and_no_rows():
    assert quantize_segments(_x(0), [0, 0], "activation", DEFAULT) == [None, None]


def test_chunk_amax_expansion():
    amaxes = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    rows = chunk_amaxes(amaxes, [2, 0, 1, 3], 1)
    expected = torch.tensor([1.0, 1.0, float("nan"), 4.0, 4.0, 4.0])
    assert torch.equal(rows.view(torch.int32), expected.view(torch.int32))
    chunks = chunk_amaxes(amaxes, [32, 0, 16, 48], 16)
    assert chunks.tolist()[:2] == [1.0, 1.0] and chunks.tolist()[3:] == [4.0, 4.0, 4.0]


@pytest.mark.parametrize("sizes, kwargs, message", [
    ([16, 8], dict(columnwise=True), "split_sizes[1]=8: a columnwise copy"),
    ([8, 16], dict(columnwise=False, block_2d=True), "split_sizes[0]=8: 16x16 blocks"),
    ([16, -16, 32], dict(columnwise=False), "split_sizes[1]=-16"),
    ([16, 16.0], dict(columnwise=False), "split_sizes[1]=16.0"),
    ([16, 32], dict(columnwise=False), "sum to 48"),
    ("16,16", dict(columnwise=False), "must be a list"),
    (torch.tensor([16.0, 16.0]), dict(columnwise=False), "1D of integers"),
])
def test_bad_splits_are_refused(sizes, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_segments(sizes, 32, **kwargs)


def test_bad_calls_through_quantize_segments():
    x = _x(32)
    with pytest.raises(ValueError, match="at least one copy"):
        quantize_segments(x, [32], "activation", DEFAULT, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="sr_row_offset"):
        quantize_segments(x, [32], "gradient", DEFAULT, sr_row_offset=-1)
    with pytest.raises(ValueError, match="equal segment sizes"):
        quantize_segments(x, [16, 16, 0], "weight", DEFAULT, contiguous_columnwise=True)
    with pytest.raises(ValueError, match=r"split_sizes\[0\]=8"):
        quantize_segments(x, [8, 24], "activation", DEFAULT)
    assert torch.equal(torch.tensor(check_segments(torch.tensor([16, 16]), 32, columnwise=True)),
                       torch.tensor([16, 16]))


def test_kernels_apply_only_on_cuda_with_the_default_family(monkeypatch):
    from nvfp4_dist import ops
    x = _x(16)
    assert not segmented_kernels_apply(x, "activation", DEFAULT)  # CPU: the loop
    monkeypatch.setattr(ops, "use_kernels", lambda tensor: True)  # as on CUDA: the recipe decides
    assert segmented_kernels_apply(x, "activation", DEFAULT)
    assert segmented_kernels_apply(x, "weight", nv.NVFP4Recipe(weight_2d=False))
    assert not segmented_kernels_apply(x, "activation", nv.NVFP4Recipe(row_scaled_activation=True))
    assert segmented_kernels_apply(x, "gradient", nv.NVFP4Recipe(row_scaled_activation=True))
    assert not segmented_kernels_apply(x, "weight", nv.NVFP4Recipe(nvfp4_4over6="weights"))
    assert segmented_kernels_apply(x, "gradient", nv.NVFP4Recipe(nvfp4_4over6="weights"))
