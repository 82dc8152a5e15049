"""The two GPU GEMM backends behind nvfp4_dist.gemm (docs/numerics.md §8), and the output epilogue all share.

cublaslt: Blackwell cuBLASLt block-scaled NVFP4 (nvfp4_dist.gemm.blackwell).
emulated: Hopper exact-block emulation (nvfp4_dist.gemm.hopper); NVFP4_HOPPER_GEMM picks "dequantize"
          (exact BF16 operand copies feeding cuBLASLt, which applies alpha itself: the default and
          the faster, docs/performance.md) or "fused" (dequantization inside a Triton GEMM: slower,
          far less extra memory).
"""
from __future__ import annotations

import torch

from nvfp4_dist import environment
from nvfp4_dist.formats import E4M3_BOUND


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
    return environment.HOPPER_GEMM.read()


def import_hopper():
    try:
        from nvfp4_dist.gemm import hopper
    except ImportError as error:
        raise RuntimeError("the emulated NVFP4 GEMM backend needs Triton (pip install triton; it ships with "
                           "the CUDA builds of torch); or select backend='reference'") from error
    return hopper


def run(backend: str, a_data, a_scale, a_amax, b_data, b_scale, b_amax, *, out_dtype: torch.dtype = torch.float32,
        bias: torch.Tensor | None = None, accumulate_into: torch.Tensor | None = None,
        out: torch.Tensor | None = None, a_e4m3_bound: int = E4M3_BOUND, b_e4m3_bound: int = E4M3_BOUND) -> torch.Tensor:
    """y = A . B^T on the GPU with `backend` ("cublaslt" or "emulated"), already validated by gemm().

    Returns y in out_dtype (written into `out` when given), or accumulate_into after adding y (+ bias) into it.
    *_e4m3_bound: each operand's global-scale bound (docs/numerics.md §12.7).
    """
    bounds = dict(a_e4m3_bound=a_e4m3_bound, b_e4m3_bound=b_e4m3_bound)
    if backend == "cublaslt":
        from nvfp4_dist.gemm import blackwell
        args = blackwell.scaled_mm_arguments(a_data, a_scale, a_amax, b_data, b_scale, b_amax, **bounds)
        y = finish_output(blackwell.finish_scaled_mm(blackwell.run_scaled_mm(args), args), out_dtype, bias,
                          accumulate_into)
        return y if out is None else out.copy_(y)
    if backend == "emulated":
        hopper = import_hopper()
        path = hopper.gemm_fused if hopper_path() == "fused" else hopper.gemm_dequantize_matmul
        return path(a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype=out_dtype, bias=bias,
                    accumulate_into=accumulate_into, out=out, **bounds)
    raise ValueError(f"backend={backend!r}: the GPU backends are 'cublaslt' and 'emulated'")
