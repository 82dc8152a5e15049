"""The reference reproduces Transformer Engine's golden vectors byte for byte (tests/data)."""
import numpy as np
import pytest
import torch

from nvfp4_dist.reference import quantize_tensor

CASES = ["bf16_1d_256x272", "fp32_2d_128x128", "fp16_1d_64x512_small", "bf16_rht_128x256", "bf16_rowscaled_64x128"]


def _raw(t: torch.Tensor) -> np.ndarray:
    return (t if t.dtype == torch.float32 else t.view(torch.uint8)).numpy()


@pytest.mark.parametrize("case", CASES)
def test_golden_case_bytes(golden, case):
    dtype = getattr(torch, str(golden[f"{case}/input_dtype"]).split(".")[1])
    x = torch.from_numpy(golden[f"{case}/input_f32"]).to(dtype)
    assert torch.equal(x.float(), torch.from_numpy(golden[f"{case}/input_f32"])), "input not exact in its dtype"
    has_columnwise = f"{case}/data_t" in golden.files
    q = quantize_tensor(x, rowwise=True, columnwise=has_columnwise, block_2d="2d" in case, rht="rht" in case,
                        row_scaled="rowscaled" in case)
    expected = {"data": q.rowwise_data, "scale": q.rowwise_scale, "amax_row": q.amax_rowwise}
    if has_columnwise:
        expected.update(data_t=q.columnwise_data, scale_t=q.columnwise_scale, amax_col=q.amax_columnwise)
    for key, ours in expected.items():
        theirs = golden[f"{case}/{key}"]
        ours = _raw(ours)
        assert ours.shape == theirs.shape, f"{case}/{key}: shape {ours.shape} vs {theirs.shape}"
        mismatches = int((ours != theirs).sum())
        assert mismatches == 0, f"{case}/{key}: {mismatches} bytes differ"
    if not has_columnwise:  # row-scaled: golden's amax_col repeats the per-row amaxes
        assert np.array_equal(_raw(q.amax_rowwise), golden[f"{case}/amax_col"])


def test_golden_covers_every_case(golden):
    assert sorted({k.split("/")[0] for k in golden.files}) == sorted(CASES)
