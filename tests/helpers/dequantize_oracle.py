"""Dequantization written again from docs/numerics.md (§1, §2.2, §2.6, §5, §6, §6b, §12.7), in numpy FP32: no code
shared with nvfp4_dist's dequantize, only tests/helpers/oracle.py's format tables and global scale."""
from __future__ import annotations

import numpy as np
import torch

from tests.helpers import oracle as O

F32 = np.float32


def dequantize_copy(data: np.ndarray, scale_bytes: np.ndarray, amax: np.ndarray, bound: int = O.E4M3_LARGEST):
    """x' = fp4value(q) * fp32(s_b) * S_dec per element of one copy [R, C] (§2.6), FP32; amax (1,) or one per
    row (§6, 6b); S_dec = 1 / min(6 B / A, FLT_MAX) (§2.2, §12.7)."""
    values = O.E2M1[O.unpack(data)].astype(F32)
    rows, cols = values.shape
    block_scales = O.E4M3[scale_bytes].astype(F32)
    s_dec = O.decode_scale(np.asarray(amax, dtype=F32).reshape(-1), bound).reshape(-1, 1)
    scaled = (values.reshape(rows, cols // O.BLOCK, O.BLOCK) * block_scales[:, :, None]).reshape(rows, cols)
    return (scaled * s_dec).astype(F32)


def inverse_rht(y_t: np.ndarray, random_sign: bool) -> np.ndarray:
    """Undo the RHT of a columnwise copy (§5 "Dequantizing"): each 16-chunk along a row of x^T: terms y_j * 1/4
    rounded to FP32, plus 0; butterflies (a, b) -> (a + b, a - b) on pairs (i, i + h) for h = 1, 2, 4, 8; then
    s_i applied as 0 - sum where s_i = -1 (all +1 without random signs). [K, M] in, x [M, K] out."""
    signs = O.RHT_SIGNS if random_sign else np.ones(O.BLOCK)
    cols, rows = y_t.shape
    t = (y_t.astype(F32).reshape(cols, rows // O.BLOCK, O.BLOCK) * F32(0.25) + F32(0)).astype(F32)
    h = 1
    while h < O.BLOCK:
        out = t.copy()
        for i in range(O.BLOCK):
            if i & h == 0:
                out[..., i], out[..., i + h] = t[..., i] + t[..., i + h], t[..., i] - t[..., i + h]
        t, h = out, 2 * h
    t = np.where(signs < 0, F32(0) - t, t).astype(F32)
    return t.reshape(cols, rows).T


def dequantize(q, copy: str) -> np.ndarray:
    """One copy of an NVFP4Tensor back to FP32, shaped as the tensor's 2D view [M, K]."""
    data = getattr(q, f"{copy}_data").cpu().numpy()
    scale = getattr(q, f"{copy}_scale").cpu().view(torch.uint8).numpy()
    amax = getattr(q, f"amax_{copy}").cpu().numpy()
    values = dequantize_copy(data, scale, amax, q.e4m3_bound)
    if copy == "rowwise":
        return values
    return inverse_rht(values, q.rht_random_sign) if q.rht else values.T
