"""The layers' hot path on CUDA: a whole quantize and a whole GEMM, each in one or a few C++ calls.

ops.quantize and gemm() validate every argument of a public call, then descend through several Python layers
to a few kernel launches; a layer's forward+backward makes about a dozen of them, which costs far more host
time than the kernels take on small and mid-sized GEMMs. The layers build their operands themselves, so they
call these instead: `quantize` (csrc/bindings.cpp quantize_copies: amaxes, outputs and cast) and `gemm`. On the
Hopper emulation `gemm` is one call (emulated_gemm: the operands' block values, then cuBLASLt with alpha read from
the amaxes; B's values come from the Hopper backend's cache of the last B when it holds them); on Blackwell's
cuBLASLt FP4 backend it is three (swizzled_scale_pair, torch._scaled_mm, scaled_mm_output: the epilogue kernel
applies alpha, bias and accumulation in the order of the general path's torch ops) instead of about twenty
launches. Both launch the same kernels, or compute the same FP32 operations in the same order, as the general
path, so they give the same bytes; any case they do not cover (CPU tensors, NVFP4_FORCE_REFERENCE, 4over6, an
empty tensor, the fused Hopper path, per-row amaxes on Hopper, a GEMM in several chunks, operands cuBLASLt needs
padded, bias with accumulation on Hopper) goes to ops.quantize and gemm() unchanged. `grouped_gemm` runs a
grouped layer's GEMM stage (every expert's emulated GEMM) in one call, with the kernels of a loop of `gemm`.
"""
from __future__ import annotations

import functools

import torch

from nvfp4_dist import ops
from nvfp4_dist._extension import load_extension, stream_handle
from nvfp4_dist.formats import BLOCK_SIZE, SCALE_DTYPE
from nvfp4_dist.gemm import dispatch, gemm as general_gemm
from nvfp4_dist.gemm import gpu_backends
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor

_OUT_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}
_SEED_LIMIT = 2 ** 64
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)  # torch._scaled_mm's FP4 operand dtype
# The environment variables that decide whether the general paths would run the kernels the hot path runs.
_SWITCHES = ("NVFP4_FORCE_REFERENCE", "NVFP4_GEMM_BACKEND", "NVFP4_HOPPER_GEMM")


@functools.lru_cache(maxsize=256)
def _copy_options(role: str, recipe: NVFP4Recipe) -> tuple | None:
    """(block_2d, rht, rht_random_sign, row_scaled, stochastic_rounding) of a role under a recipe, or None when
    its copies take 4over6 (the general path's)."""
    options = ops.quantize_options(role, recipe)
    if options["four_over_six"] is not None:
        return None
    return (options["block_2d"], options["rht"], options["rht_random_sign"], options["row_scaled"],
            options["stochastic_rounding"])


@functools.lru_cache(maxsize=64)
def _runs_kernels(switches: tuple) -> bool:
    """Whether CUDA tensors are quantized by the kernels under these NVFP4_* values (not the forced reference)."""
    return not ops.environment.FORCE_REFERENCE.read()


@functools.lru_cache(maxsize=64)
def _gpu_gemm_path(switches: tuple, device_index: int, gemm_backend: str) -> str:
    """The path gemm() would run on this device for this recipe backend: "dequantize" (the Hopper emulation's
    dequantize path), "scaled_mm" (Blackwell's cuBLASLt FP4) or "" (another: the general path)."""
    device = torch.device("cuda", device_index)
    backend = dispatch.resolve_backend(None if gemm_backend == "auto" else gemm_backend, device)
    if backend == "emulated" and gpu_backends.hopper_path() == "dequantize":
        return "dequantize"
    return "scaled_mm" if backend == "cublaslt" else ""


def _hopper():
    from nvfp4_dist.gemm import hopper  # imported where used: it needs triton, which CPU-only installs may lack
    return hopper


def _switches() -> tuple:
    return ops.environment.raw_values(_SWITCHES)


def quantize(x2d: torch.Tensor, role: str, recipe: NVFP4Recipe, *, rowwise: bool, columnwise: bool,
             amax_rowwise: torch.Tensor | None = None, amax_columnwise: torch.Tensor | None = None,
             sr_seed: int | torch.Tensor | None = None, sr_row_offset: int = 0) -> NVFP4Tensor:
    """ops.quantize(x2d [rows, K], role, ..., check_finite=False) for a layer's operand, in one C++ call when the
    kernels run it and its recipe takes no 4over6; the general path otherwise (with its errors)."""
    options = _copy_options(role, recipe)
    rows, cols = x2d.shape[0], x2d.shape[-1]
    if (options is None or not x2d.is_cuda or x2d.dim() != 2 or rows == 0 or cols % BLOCK_SIZE
            or ((columnwise or options[0]) and rows % BLOCK_SIZE) or x2d.dtype not in ops.INPUT_DTYPES
            or (options[1] and columnwise and x2d.dtype != torch.bfloat16) or not (rowwise or columnwise)
            or not _runs_kernels(_switches())):
        return ops.quantize(x2d, role, rowwise=rowwise, columnwise=columnwise, recipe=recipe,
                            amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise, sr_seed=sr_seed,
                            sr_row_offset=sr_row_offset, check_finite=False)
    block_2d, rht, random_sign, row_scaled, stochastic = options
    if x2d.requires_grad:
        x2d = x2d.detach()  # the result holds no autograd history, as ops.quantize's
    seed, seed_device = 0, None
    if stochastic:
        if sr_seed is None:
            sr_seed = ops.draw_sr_seed(x2d)
        if isinstance(sr_seed, torch.Tensor):
            seed_device = sr_seed
        else:
            seed = sr_seed - _SEED_LIMIT if sr_seed >= 2 ** 63 else sr_seed
    copies = load_extension().quantize_copies(
        x2d, rowwise, columnwise, block_2d, rht, random_sign, row_scaled, amax_rowwise, amax_columnwise,
        stochastic, seed, seed_device, sr_row_offset, stream_handle(x2d.device))
    return NVFP4Tensor(x2d.shape, x2d.dtype, *copies, block_2d=block_2d, rht=rht and columnwise,
                       rht_random_sign=random_sign, row_scaled=row_scaled)


def gemm(a: NVFP4Tensor, b: NVFP4Tensor, *, a_copy: str, b_copy: str, out_dtype: torch.dtype,
         bias: torch.Tensor | None = None, accumulate_into: torch.Tensor | None = None,
         out: torch.Tensor | None = None, recipe: NVFP4Recipe | None = None) -> torch.Tensor:
    """gemm(a, b, ...) for a layer's operands: in one C++ call on the Hopper emulation's common case, in three on
    the cuBLASLt FP4 backend's (operands it takes unpadded); gemm() otherwise."""
    a_data = getattr(a, f"{a_copy}_data")
    b_data = getattr(b, f"{b_copy}_data")
    if a_data is not None and b_data is not None and a_data.is_cuda and out_dtype in _OUT_DTYPE_CODES:
        path = _gpu_gemm_path(_switches(), a_data.device.index, recipe.gemm_backend if recipe is not None else "auto")
        if path == "dequantize" and out is None:
            hopper = _hopper()
            b_scale = getattr(b, f"{b_copy}_scale")
            y = load_extension().emulated_gemm(
                a_data, getattr(a, f"{a_copy}_scale"), getattr(a, f"amax_{a_copy}"), b_data, b_scale,
                hopper._last_b.cached(b_data, b_scale), getattr(b, f"amax_{b_copy}"), bias, _OUT_DTYPE_CODES[out_dtype],
                accumulate_into, a.e4m3_bound, b.e4m3_bound, hopper.CHUNK_BYTES, stream_handle(a_data.device))
            if y is not None:
                return y
        elif path == "scaled_mm":
            a_data, b_data = a_data.contiguous(), b_data.contiguous()  # as gemm() takes them
            a_scale, a_amax = getattr(a, f"{a_copy}_scale").contiguous(), getattr(a, f"amax_{a_copy}")
            b_scale, b_amax = getattr(b, f"{b_copy}_scale").contiguous(), getattr(b, f"amax_{b_copy}")
            target = accumulate_into if accumulate_into is not None else out
            if _scaled_mm_takes(a_data, a_scale, a_amax, b_data, b_scale, b_amax, bias, out_dtype, accumulate_into,
                                out):
                extension, stream = load_extension(), stream_handle(a_data.device)
                scale_a, scale_b = extension.swizzled_scale_pair(a_scale, b_scale, stream)
                raw = torch._scaled_mm(a_data.view(_FP4), b_data.view(_FP4).t(), scale_a, scale_b,
                                       out_dtype=torch.float32)
                return extension.scaled_mm_output(raw, a_amax, b_amax, bias, _OUT_DTYPE_CODES[out_dtype], target,
                                                  accumulate_into is not None, a.e4m3_bound, b.e4m3_bound, stream)
    return general_gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=out_dtype, bias=bias,
                        accumulate_into=accumulate_into, out=out, recipe=recipe)


def _scaled_mm_takes(a_data, a_scale, a_amax, b_data, b_scale, b_amax, bias, out_dtype, accumulate_into, out) -> bool:
    """Whether torch._scaled_mm takes the (contiguous) operands as they are, as gemm() would (K a multiple of 32,
    N of 16, 16-byte aligned codes), and the epilogue kernel takes the rest; anything else goes to gemm(), which
    pads, copies or explains."""
    rows, packed_k = a_data.shape
    cols = b_data.shape[0]
    device = a_data.device
    return (_FP4 is not None and rows > 0 and packed_k % 16 == 0 and cols % 16 == 0 and b_data.shape[1] == packed_k
            and a_data.dtype == b_data.dtype == torch.uint8 and b_data.device == device
            and a_data.data_ptr() % 16 == 0 and b_data.data_ptr() % 16 == 0
            and a_scale.dtype == b_scale.dtype == SCALE_DTYPE
            and tuple(a_scale.shape) == (rows, packed_k // 8) and tuple(b_scale.shape) == (cols, packed_k // 8)
            and a_amax.numel() in (1, rows) and b_amax.numel() in (1, cols)
            and a_amax.dtype == b_amax.dtype == torch.float32 and a_amax.device == b_amax.device == device
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == cols and bias.dtype in _OUT_DTYPE_CODES
                                  and bias.device == device))
            and (accumulate_into is None or (out is None and accumulate_into.dtype == torch.float32
                                             and tuple(accumulate_into.shape) == (rows, cols)
                                             and accumulate_into.stride(1) == 1 and accumulate_into.device == device))
            and (out is None or (out.dtype == out_dtype and tuple(out.shape) == (rows, cols) and out.stride(1) == 1
                                 and out.device == device)))


def grouped_gemm(a_ops: list, a_copy: str, b_ops: list, b_copy: str, outs: list, *, recipe: NVFP4Recipe,
                 biases: list | None = None, accumulate: bool = False) -> int:
    """outs[i] = A_i . B_i^T (+ biases[i]), or += it (accumulate), for the operand pairs in order, in one C++ call
    (grouped_emulated_gemm) on the Hopper emulation's common case: per pair the kernels `gemm` runs, so the same
    bytes. Returns how many leading pairs it did (0: the case does not apply; the caller runs gemm() for the rest)."""
    if not a_ops:
        return 0
    a_data = [getattr(q, f"{a_copy}_data") for q in a_ops]
    b_data = [getattr(q, f"{b_copy}_data") for q in b_ops]
    first = a_data[0]
    if (any(d is None for d in a_data + b_data) or not first.is_cuda or outs[0].dtype not in _OUT_DTYPE_CODES
            or len({q.e4m3_bound for q in a_ops}) != 1 or len({q.e4m3_bound for q in b_ops}) != 1
            or _gpu_gemm_path(_switches(), first.device.index, recipe.gemm_backend) != "dequantize"):
        return 0
    return load_extension().grouped_emulated_gemm(
        a_data, [getattr(q, f"{a_copy}_scale") for q in a_ops], [getattr(q, f"amax_{a_copy}") for q in a_ops],
        b_data, [getattr(q, f"{b_copy}_scale") for q in b_ops], [getattr(q, f"amax_{b_copy}") for q in b_ops],
        list(biases) if biases is not None else [], outs, accumulate, a_ops[0].e4m3_bound, b_ops[0].e4m3_bound,
        _hopper().CHUNK_BYTES, stream_handle(first.device))
