"""Byte comparison of a quantized tensor with Transformer Engine's reference vectors (tests/data, README there)."""
import numpy as np
import torch


def assert_golden_bytes(golden, name: str, q, columnwise: bool = True) -> None:
    """Every byte of q's copies, scales and amaxes equals case `name` of the vectors (the rowwise copy alone where
    not `columnwise`). TE pads its scale arrays with columns that carry no block: those are not compared."""
    pairs = {"data": q.rowwise_data, "scale": q.rowwise_scale, "amax_row": q.amax_rowwise}
    if columnwise:
        pairs.update(data_t=q.columnwise_data, scale_t=q.columnwise_scale, amax_col=q.amax_columnwise)
    for key, ours in pairs.items():
        ours = (ours if ours.dtype == torch.float32 else ours.view(torch.uint8)).numpy()
        theirs = golden[f"{name}/{key}"]
        theirs = theirs[:, :ours.shape[1]] if key.startswith("scale") else theirs
        assert ours.shape == theirs.shape, f"{name}/{key}: shape {ours.shape} vs {theirs.shape}"
        differing = int(np.count_nonzero(ours != theirs))
        assert differing == 0, f"{name}/{key}: {differing} bytes differ"
