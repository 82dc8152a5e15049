"""Blackwell NVFP4 GEMM through cuBLASLt block-scaled FP4, via torch._scaled_mm (docs/numerics.md §8).

Runs on every GPU with block-scaled FP4 tensor cores: sm_100 (B200, GB200), sm_103 (B300, GB300) and
sm_120 (RTX PRO 6000 Blackwell, GeForce RTX 50). The call, valid for torch 2.11 and 2.13 (the
single-scale NVFP4 recipe of the v1 API):
    torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    a: float4_e2m1fn_x2 [M, Kp/2], row-major      (A's codes, low nibble first)
    b: float4_e2m1fn_x2 [Kp/2, Np], column-major  (the transpose view of B's codes [Np, Kp/2])
    scale_a: float8_e4m3fn, flat, round_up(M, 128) * round_up(Kp/16, 4) values, 128x4 swizzled
    scale_b: float8_e4m3fn, flat, round_up(Np, 128) * round_up(Kp/16, 4) values, 128x4 swizzled
torch requires Kp % 32 == 0 and Np % 16 == 0 and nothing of M; the 128-row and 4-column tiles are
needed only by the scales, whose swizzle writes the zero padding itself. So the codes are used in
place unless K % 32 == 16 (both operands gain one zero block) or N % 16 != 0 (B gains zero rows):
padded blocks have zero codes and zero scales and add exactly zero. round_up(Kp/16, 4) equals
round_up(K/16, 4), so the swizzled unpadded scales already have torch's size.

The two global scales are not passed: alpha = S_dec(a) * S_dec(b) (per row of A when A is row-scaled,
per row of B when B is) multiplies the FP32 output. On CUDA tensors the scale swizzle runs as a kernel
(csrc/swizzle.cu); on CPU tensors scaled_mm_arguments builds the same arguments with the reference
swizzle, so tests can check them without a Blackwell GPU.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from nvfp4_dist import ops
from nvfp4_dist.formats import BLOCK_SIZE, E4M3_BOUND, SCALE_DTYPE
from nvfp4_dist.reference.quantize import decode_scale

K_MULTIPLE = 32         # torch: the packed K of both operands a multiple of 16 bytes
N_MULTIPLE = 16         # torch: both dimensions of mat2 multiples of 16
POINTER_ALIGNMENT = 16  # cuBLASLt reads the FP4 operands in 16-byte vectors
FP4_DTYPE = torch.float4_e2m1fn_x2


@dataclasses.dataclass
class ScaledMMArguments:
    """The arguments of torch._scaled_mm for one NVFP4 GEMM, and what undoes its padding."""

    a: torch.Tensor          # float4_e2m1fn_x2 [M, Kp/2], row-major
    b: torch.Tensor          # float4_e2m1fn_x2 [Kp/2, Np], column-major
    scale_a: torch.Tensor    # float8_e4m3fn, flat, swizzled
    scale_b: torch.Tensor    # float8_e4m3fn, flat, swizzled
    alpha: torch.Tensor      # float32 [M or 1, N or 1]: S_dec(a) * S_dec(b)
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


def gemm_codes(data: torch.Tensor, padded_rows: int, padded_k: int) -> torch.Tensor:
    """Codes [R, K/2] as cuBLASLt reads them: zero-padded to [Rp, Kp/2] only where needed, else in place."""
    rows, packed_k = data.shape
    if (rows, packed_k * 2) != (padded_rows, padded_k):
        return F.pad(data, (0, padded_k // 2 - packed_k, 0, padded_rows - rows))
    data = data.contiguous()
    return data.clone() if data.data_ptr() % POINTER_ALIGNMENT else data


def scaled_mm_arguments(a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, a_e4m3_bound: int = E4M3_BOUND,
                        b_e4m3_bound: int = E4M3_BOUND) -> ScaledMMArguments:
    """The torch._scaled_mm arguments for y = A . B^T, A [M, K] and B [N, K] packed NVFP4.

    a_amax: 1 or M values (row-scaled A); b_amax: 1 or N values (B's rows: the columnwise copy of a row-scaled
    activation, docs/numerics.md §6b); *_e4m3_bound: each operand's global-scale bound (docs/numerics.md §12.7).
    """
    check_operand(a_data, a_scale, "a")
    check_operand(b_data, b_scale, "b")
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"K mismatch: a_data {tuple(a_data.shape)} and b_data {tuple(b_data.shape)} "
                         "must have the same packed K")
    rows, cols, k = a_data.shape[0], b_data.shape[0], a_data.shape[1] * 2
    if a_amax.numel() not in (1, rows) or b_amax.numel() not in (1, cols):
        raise ValueError(f"a_amax has {a_amax.numel()} values (allowed: 1 or M={rows}), b_amax has "
                         f"{b_amax.numel()} (allowed: 1 or N={cols})")
    padded_k = round_up(k, K_MULTIPLE)
    a_codes = gemm_codes(a_data, rows, padded_k)
    b_codes = gemm_codes(b_data, round_up(cols, N_MULTIPLE), padded_k)
    alpha = decode_scale(a_amax, a_e4m3_bound).reshape(-1, 1) * decode_scale(b_amax, b_e4m3_bound).reshape(1, -1)
    return ScaledMMArguments(a=a_codes.view(FP4_DTYPE), b=b_codes.view(FP4_DTYPE).t(),
                             scale_a=ops.swizzle_scales(a_scale), scale_b=ops.swizzle_scales(b_scale),
                             alpha=alpha, cols=cols)


def run_scaled_mm(args: ScaledMMArguments) -> torch.Tensor:
    """cuBLASLt's FP32 [M, Np] = sum of block-scaled FP4 products, without the global scales."""
    return torch._scaled_mm(args.a, args.b, args.scale_a, args.scale_b, out_dtype=torch.float32)


def finish_scaled_mm(raw: torch.Tensor, args: ScaledMMArguments) -> torch.Tensor:
    """FP32 [M, N] = the unpadded columns of raw times alpha."""
    return raw[:, :args.cols] * args.alpha
