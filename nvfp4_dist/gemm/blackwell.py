"""Blackwell (sm_100+) NVFP4 GEMM through cuBLASLt block-scaled FP4, via torch._scaled_mm (docs/numerics.md §8).

The call, valid for torch 2.11 and 2.13 (the single-scale NVFP4 recipe of the v1 API):
    torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    a: float4_e2m1fn_x2 [Mp, Kp/2], row-major      (A padded, a view of its uint8 codes)
    b: float4_e2m1fn_x2 [Kp/2, Np], column-major   (the transpose view of B [Np, Kp/2])
    scale_a / scale_b: float8_e4m3fn, flat, Mp * Kp/16 and Np * Kp/16 values, 128x4 swizzled
The two global scales are not passed: alpha = S_dec(a) * S_dec(b) (per row of A when A is
row-scaled) multiplies the FP32 output. M and N are padded to multiples of 128 and K to a
multiple of 64 with zero codes and zero scales (exact: padded blocks add zero), so that the
swizzled scale tensors need no further padding.

Everything but the cuBLASLt call itself runs on the CPU as well: scaled_mm_arguments builds the
exact arguments, emulate_scaled_mm reproduces cuBLASLt's block-scaled math from them, and
finish_scaled_mm undoes the padding and applies alpha, so tests check the argument logic
against the reference GEMM without a Blackwell GPU.
"""
from __future__ import annotations

import dataclasses

import torch

from nvfp4_dist.formats import BLOCK_SIZE, SCALE_DTYPE
from nvfp4_dist.reference.gemm import block_values
from nvfp4_dist.reference.quantize import decode_scale
from nvfp4_dist.reference.swizzle import swizzle_offset, swizzle_scales

ROW_MULTIPLE = 128      # M and N padding: the 128-row tiles of the swizzled scale layout
K_MULTIPLE = 64         # K padding: 4 scale columns of 16 elements
FP4_DTYPE = torch.float4_e2m1fn_x2


@dataclasses.dataclass
class ScaledMMArguments:
    """The arguments of torch._scaled_mm for one NVFP4 GEMM, and what undoes its padding."""

    a: torch.Tensor          # float4_e2m1fn_x2 [Mp, Kp/2], row-major
    b: torch.Tensor          # float4_e2m1fn_x2 [Kp/2, Np], column-major
    scale_a: torch.Tensor    # float8_e4m3fn [Mp * Kp/16], swizzled
    scale_b: torch.Tensor    # float8_e4m3fn [Np * Kp/16], swizzled
    alpha: torch.Tensor      # float32 [M, 1] or [1, 1]: S_dec(a) * S_dec(b)
    rows: int                # M before padding
    cols: int                # N before padding


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def check_operand(data: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """Raise ValueError unless data is uint8 [R, K/2] and scale E4M3 [R, K/16] of one K."""
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"{name}_data: expected a 2D uint8 tensor of packed FP4 codes, got "
                         f"{data.dtype} {tuple(data.shape)}")
    if scale.dtype != SCALE_DTYPE or scale.dim() != 2:
        raise ValueError(f"{name}_scale: expected a 2D {SCALE_DTYPE} tensor, got {scale.dtype} {tuple(scale.shape)}")
    k = data.shape[1] * 2
    if k == 0 or k % BLOCK_SIZE or tuple(scale.shape) != (data.shape[0], k // BLOCK_SIZE):
        raise ValueError(f"{name}_scale.shape={tuple(scale.shape)} does not fit {name}_data.shape="
                         f"{tuple(data.shape)}: expected ({data.shape[0]}, K/{BLOCK_SIZE}) with K = "
                         f"{k}, a positive multiple of {BLOCK_SIZE}")


def pad_operand(data: torch.Tensor, scale: torch.Tensor, padded_rows: int, padded_k: int):
    """Zero-pad codes [R, K/2] -> [Rp, Kp/2] and scales [R, K/16] -> [Rp, Kp/16] (no copy if aligned)."""
    rows, k = data.shape[0], data.shape[1] * 2
    if (rows, k) == (padded_rows, padded_k):
        return data.contiguous(), scale
    padded_data = torch.zeros(padded_rows, padded_k // 2, dtype=torch.uint8, device=data.device)
    padded_data[:rows, :k // 2] = data
    padded_scale = torch.zeros(padded_rows, padded_k // BLOCK_SIZE, dtype=torch.uint8, device=scale.device)
    padded_scale[:rows, :k // BLOCK_SIZE] = scale.view(torch.uint8)
    return padded_data, padded_scale.view(SCALE_DTYPE)


def scaled_mm_arguments(a_data, a_scale, a_amax, b_data, b_scale, b_amax) -> ScaledMMArguments:
    """The torch._scaled_mm arguments for y = A . B^T, A [M, K] and B [N, K] packed NVFP4."""
    check_operand(a_data, a_scale, "a")
    check_operand(b_data, b_scale, "b")
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"K mismatch: a_data {tuple(a_data.shape)} and b_data {tuple(b_data.shape)} "
                         "must have the same packed K")
    rows, cols, k = a_data.shape[0], b_data.shape[0], a_data.shape[1] * 2
    if a_amax.numel() not in (1, rows) or b_amax.numel() != 1:
        raise ValueError(f"a_amax has {a_amax.numel()} values (allowed: 1 or M={rows}), b_amax has "
                         f"{b_amax.numel()} (allowed: 1)")
    padded_k = round_up(k, K_MULTIPLE)
    a_padded, a_scale_padded = pad_operand(a_data, a_scale, round_up(rows, ROW_MULTIPLE), padded_k)
    b_padded, b_scale_padded = pad_operand(b_data, b_scale, round_up(cols, ROW_MULTIPLE), padded_k)
    alpha = (decode_scale(a_amax).reshape(-1, 1) * decode_scale(b_amax).reshape(1, 1)).contiguous()
    return ScaledMMArguments(a=a_padded.view(FP4_DTYPE), b=b_padded.view(FP4_DTYPE).t(),
                             scale_a=swizzle_scales(a_scale_padded), scale_b=swizzle_scales(b_scale_padded),
                             alpha=alpha, rows=rows, cols=cols)


def run_scaled_mm(args: ScaledMMArguments) -> torch.Tensor:
    """cuBLASLt's FP32 [Mp, Np] = sum of block-scaled FP4 products, without the global scales."""
    return torch._scaled_mm(args.a, args.b, args.scale_a, args.scale_b, out_dtype=torch.float32)


def scales_from_swizzled(swizzled: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """FP32 [rows, scale_cols] read out of the swizzled layout with the offset formula of docs/numerics.md §8."""
    r = torch.arange(rows, device=swizzled.device)[:, None]
    c = torch.arange(scale_cols, device=swizzled.device)[None, :]
    offsets = swizzle_offset(r, c, scale_cols)
    return swizzled.to(torch.float32)[offsets]


def emulate_scaled_mm(args: ScaledMMArguments) -> torch.Tensor:
    """What run_scaled_mm computes, from the same arguments: FP32 [Mp, Np] per-16-block partial sums."""
    a_codes = args.a.view(torch.uint8)
    b_codes = args.b.t().view(torch.uint8)
    scale_cols = a_codes.shape[1] * 2 // BLOCK_SIZE
    a_scale = scales_from_swizzled(args.scale_a, a_codes.shape[0], scale_cols)
    b_scale = scales_from_swizzled(args.scale_b, b_codes.shape[0], scale_cols)
    a_blocks = block_values(a_codes, a_scale)
    b_blocks = block_values(b_codes, b_scale)
    return torch.einsum("mbk,nbk->mnb", a_blocks, b_blocks).sum(dim=2)


def finish_scaled_mm(raw: torch.Tensor, args: ScaledMMArguments) -> torch.Tensor:
    """FP32 [M, N] = the unpadded part of raw times alpha."""
    return raw[:args.rows, :args.cols] * args.alpha
