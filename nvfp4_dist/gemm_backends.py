"""The two GPU GEMM backends behind nvfp4_dist.gemm (docs/numerics.md §8).

cublaslt: Blackwell cuBLASLt block-scaled NVFP4 (gemm_blackwell).
emulated: Hopper exact-block emulation (gemm_hopper); NVFP4_HOPPER_GEMM picks "dequantize"
          (exact BF16 operand copies feeding cuBLASLt, which applies alpha itself: the default and
          the faster, docs/performance.md) or "fused" (dequantization inside a Triton GEMM: slower,
          far less extra memory).
"""
from __future__ import annotations

import os

import torch

HOPPER_PATHS = ("fused", "dequantize")
_HOPPER_PATH_ENV = "NVFP4_HOPPER_GEMM"


def finish_output(out: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None,
                  accumulate_into: torch.Tensor | None) -> torch.Tensor:
    """FP32 y -> y + bias, added into accumulate_into (returned) or cast to out_dtype."""
    if bias is not None:
        out = out + bias.to(torch.float32)
    if accumulate_into is not None:
        return accumulate_into.add_(out)
    return out.to(out_dtype)


def hopper_path() -> str:
    """The emulated backend's path: NVFP4_HOPPER_GEMM, default "dequantize"."""
    path = os.environ.get(_HOPPER_PATH_ENV) or "dequantize"
    if path not in HOPPER_PATHS:
        raise ValueError(f"environment variable {_HOPPER_PATH_ENV}={path!r}: allowed are {HOPPER_PATHS}")
    return path


def import_hopper():
    try:
        from . import gemm_hopper
    except ImportError as error:
        raise RuntimeError("the emulated NVFP4 GEMM backend needs Triton (pip install triton; it ships with "
                           "the CUDA builds of torch); or select backend='reference'") from error
    return gemm_hopper


def run(backend: str, a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, out_dtype: torch.dtype = torch.float32,
        bias: torch.Tensor | None = None, accumulate_into: torch.Tensor | None = None,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """y = A . B^T on the GPU with `backend` ("cublaslt" or "emulated"), already validated by gemm().

    Returns y in out_dtype (written into `out` when given), or accumulate_into after adding y (+ bias) into it.
    """
    if backend == "cublaslt":
        from . import gemm_blackwell
        args = gemm_blackwell.scaled_mm_arguments(a_data, a_scale, a_amax, b_data, b_scale, b_amax)
        y = finish_output(gemm_blackwell.finish_scaled_mm(gemm_blackwell.run_scaled_mm(args), args), out_dtype,
                          bias, accumulate_into)
        return y if out is None else out.copy_(y)
    if backend == "emulated":
        gemm_hopper = import_hopper()
        path = gemm_hopper.gemm_fused if hopper_path() == "fused" else gemm_hopper.gemm_dequantize_matmul
        return path(a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype=out_dtype, bias=bias,
                    accumulate_into=accumulate_into, out=out)
    raise ValueError(f"backend={backend!r}: the GPU backends are 'cublaslt' and 'emulated'")
