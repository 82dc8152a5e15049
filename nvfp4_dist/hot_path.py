"""The layers' hot path on CUDA: a whole quantize and a whole emulated GEMM, each in one C++ call.

ops.quantize and gemm() validate every argument of a public call, then descend through several Python layers
to a few kernel launches; a layer's forward+backward makes about a dozen of them, which costs far more host
time than the kernels take on small and mid-sized GEMMs. The layers build their operands themselves, so they
call these instead: `quantize` (csrc/bindings.cpp quantize_copies: amaxes, outputs and cast) and `gemm`
(emulated_gemm: the operands' block values, then cuBLASLt with alpha read from the amaxes; B's values come from
the Hopper backend's cache of the last B when it holds them). Both launch the same kernels
in the same order as the general path, so they give the same bytes; any case they do not cover (CPU tensors,
NVFP4_FORCE_REFERENCE, 4over6, an empty tensor, the Blackwell and fused Hopper backends, per-row amaxes, a
GEMM in several chunks, bias with accumulation) goes to ops.quantize and gemm() unchanged. `grouped_gemm` runs a
grouped layer's GEMM stage (every expert's emulated GEMM) in one call, with the kernels of a loop of `gemm`.
"""
from __future__ import annotations

import functools

import torch

from nvfp4_dist import ops
from nvfp4_dist._extension import load_extension, stream_handle
from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.gemm import dispatch, gemm as general_gemm
from nvfp4_dist.gemm import gpu_backends
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor

_OUT_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}
_SEED_LIMIT = 2 ** 64
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
def _emulated_dequantize(switches: tuple, device_index: int, gemm_backend: str) -> bool:
    """Whether gemm() would run the Hopper emulation's dequantize path on this device for this recipe backend."""
    device = torch.device("cuda", device_index)
    backend = dispatch.resolve_backend(None if gemm_backend == "auto" else gemm_backend, device)
    return backend == "emulated" and gpu_backends.hopper_path() == "dequantize"


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
         recipe: NVFP4Recipe | None = None) -> torch.Tensor:
    """gemm(a, b, ...) for a layer's operands, in one C++ call on the Hopper emulation's common case; gemm()
    otherwise."""
    a_data = getattr(a, f"{a_copy}_data")
    b_data = getattr(b, f"{b_copy}_data")
    if a_data is not None and b_data is not None and a_data.is_cuda and out_dtype in _OUT_DTYPE_CODES:
        gemm_backend = recipe.gemm_backend if recipe is not None else "auto"
        if _emulated_dequantize(_switches(), a_data.device.index, gemm_backend):
            hopper = _hopper()
            b_scale = getattr(b, f"{b_copy}_scale")
            y = load_extension().emulated_gemm(
                a_data, getattr(a, f"{a_copy}_scale"), getattr(a, f"amax_{a_copy}"), b_data, b_scale,
                hopper._last_b.cached(b_data, b_scale), getattr(b, f"amax_{b_copy}"), bias, _OUT_DTYPE_CODES[out_dtype], accumulate_into, a.e4m3_bound,
                b.e4m3_bound, hopper.CHUNK_BYTES, stream_handle(a_data.device))
            if y is not None:
                return y
    return general_gemm(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=out_dtype, bias=bias,
                        accumulate_into=accumulate_into, recipe=recipe)


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
            or not _emulated_dequantize(_switches(), first.device.index, recipe.gemm_backend)):
        return 0
    return load_extension().grouped_emulated_gemm(
        a_data, [getattr(q, f"{a_copy}_scale") for q in a_ops], [getattr(q, f"amax_{a_copy}") for q in a_ops],
        b_data, [getattr(q, f"{b_copy}_scale") for q in b_ops], [getattr(q, f"amax_{b_copy}") for q in b_ops],
        list(biases) if biases is not None else [], outs, accumulate, a_ops[0].e4m3_bound, b_ops[0].e4m3_bound,
        _hopper().CHUNK_BYTES, stream_handle(first.device))
