"""Block-scaled NVFP4 GEMM dispatch (docs/numerics.md §8): y = A . B^T, both operands quantized along K.

Each operand is one copy of an NVFP4Tensor, taken as the 2D matrix it stores:
rowwise -> [M, K] of x, columnwise -> [K, M] of x^T.
"""
from __future__ import annotations

import functools
import logging

import torch

from nvfp4_dist import environment, reference
from nvfp4_dist.environment import GEMM_BACKENDS
from nvfp4_dist.gemm import gpu_backends
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor

OUT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
CUBLASLT_MIN_CAPABILITY = (10, 0)  # block-scaled FP4 tensor cores (Blackwell)
EMULATED_MIN_CAPABILITY = (9, 0)   # the emulation's E4M3 conversions and kernels (Hopper)
BLACKWELL_GPUS = {(10, 0): "B200, GB200", (10, 3): "B300, GB300",
                  (12, 0): "RTX PRO 6000 Blackwell, GeForce RTX 50 series"}

logger = logging.getLogger("nvfp4_dist")
_logged_decisions: set = set()


def operand(q: NVFP4Tensor, copy: str, name: str):
    """(data, scale, amax) of one copy of q, validated."""
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"{name} must be an NVFP4Tensor, got {type(q).__name__}")
    if copy not in ("rowwise", "columnwise"):
        raise ValueError(f"{name}_copy={copy!r} is not one of ('rowwise', 'columnwise')")
    data = getattr(q, f"{copy}_data")
    if data is None:
        raise ValueError(f"{name}_copy={copy!r}: {name} holds no {copy} copy")
    return data, getattr(q, f"{copy}_scale"), getattr(q, f"amax_{copy}")


def backend_for_capability(capability: tuple[int, int]) -> tuple[str, str]:
    """The backend "auto" picks on a CUDA device of this compute capability, and why."""
    major, minor = capability
    arch = f"sm_{major}{minor}"
    if tuple(capability) >= CUBLASLT_MIN_CAPABILITY:
        gpus = BLACKWELL_GPUS.get(tuple(capability))
        what = f"{arch} ({gpus})" if gpus else f"{arch} (a Blackwell-generation GPU not listed in docs/blackwell.md)"
        return "cublaslt", f"{what} has block-scaled FP4 tensor cores: cuBLASLt NVFP4 through torch._scaled_mm"
    if tuple(capability) >= EMULATED_MIN_CAPABILITY:
        return "emulated", (f"{arch} has no FP4 tensor cores: exact block emulation on its 16-bit tensor cores "
                            "(docs/numerics.md §8)")
    return "reference", (f"{arch} has no FP4 tensor cores and the emulation needs sm_90: the pure-torch reference "
                         "GEMM (slow)")


def log_decision(device: torch.device, backend: str, reason: str) -> None:
    """Log the automatic backend choice for a device once per process (and again only if it changes)."""
    key = (str(device), backend, reason)
    if key not in _logged_decisions:
        _logged_decisions.add(key)
        logger.info("NVFP4 GEMM on %s: backend %r, because %s", device, backend, reason)


@functools.lru_cache(maxsize=None)
def _capability_of_index(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device, asked of the driver once per device and process."""
    return _capability_of_index(device.index if device.index is not None else torch.cuda.current_device())


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend to run: explicit argument, else NVFP4_GEMM_BACKEND, else by device ("auto").

    auto: reference for CPU tensors or under NVFP4_FORCE_REFERENCE, else by compute capability
    (backend_for_capability); the choice and its reason are logged once. An explicit GPU backend the
    device cannot run is a ValueError naming the device and its capability.
    """
    backend = backend or environment.GEMM_BACKEND.read() or "auto"
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {GEMM_BACKENDS}")
    if device.type != "cuda":
        if backend in ("cublaslt", "emulated"):
            raise ValueError(f"backend={backend!r} needs CUDA tensors; operands are on {device}")
        if backend == "auto":
            log_decision(device, "reference", f"the operands are on {device.type}")
        return "reference"
    if backend == "reference":
        return backend
    if backend == "auto" and environment.FORCE_REFERENCE.read():
        log_decision(device, "reference", "NVFP4_FORCE_REFERENCE is set")
        return "reference"
    capability = device_capability(device)
    if backend == "auto":
        chosen, reason = backend_for_capability(capability)
        log_decision(device, chosen, reason)
        return chosen
    needed = CUBLASLT_MIN_CAPABILITY if backend == "cublaslt" else EMULATED_MIN_CAPABILITY
    if capability < needed:
        _, reason = backend_for_capability(capability)
        raise ValueError(f"backend={backend!r} needs sm_{needed[0]}{needed[1]} or newer; {device} is "
                         f"sm_{capability[0]}{capability[1]} ({reason})")
    return backend


def gemm(a: NVFP4Tensor, b: NVFP4Tensor, *, a_copy: str = "rowwise", b_copy: str = "rowwise",
         out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
         accumulate_into: torch.Tensor | None = None, out: torch.Tensor | None = None,
         backend: str | None = None, recipe: NVFP4Recipe | None = None) -> torch.Tensor:
    """y = A . B^T for A = a's `a_copy` [M, K] and B = b's `b_copy` [N, K].

    Each operand's global scale S_dec is per tensor, per row of A (row-scaled activations, docs/numerics.md §6) or
    per row of B (the columnwise copy of a row-scaled activation in wgrad, §6b: it scales output column n), with
    the operand's global-scale bound (§12.7).

    out_dtype: BF16, FP16 or FP32 output. bias: [N], added in FP32 before the cast.
    accumulate_into: an FP32 [M, N] tensor that receives y (+ bias) in place (wgrad into main_grad); it is
      returned instead of a new tensor.
    out: an out_dtype [M, N] tensor with unit column stride (for example rows of a larger output) that
      receives y and is returned, instead of a new tensor; not with accumulate_into.
    backend: auto | cublaslt | emulated | reference (default: recipe.gemm_backend, then NVFP4_GEMM_BACKEND).
    """
    a_data, a_scale, a_amax = operand(a, a_copy, "a")
    b_data, b_scale, b_amax = operand(b, b_copy, "b")
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"K mismatch: a ({a_copy}) is {tuple(a_data.shape)} packed, b ({b_copy}) is "
                         f"{tuple(b_data.shape)} packed; both must share K")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}: allowed are {OUT_DTYPES}")
    rows, cols = a_data.shape[0], b_data.shape[0]
    if a_amax.numel() not in (1, rows):
        raise ValueError(f"a's amax has {a_amax.numel()} values: allowed are 1 or one per row ({rows})")
    if b_amax.numel() not in (1, cols):
        raise ValueError(f"b's amax has {b_amax.numel()} values: allowed are 1 or one per row of b's {b_copy} copy "
                         f"({cols}: the columnwise copy of a row-scaled activation, docs/numerics.md §6b)")
    device = a_data.device
    for name, tensor in (("b", b_data), ("bias", bias), ("accumulate_into", accumulate_into)):
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}; a is on {device}: all must share one device")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != cols or not bias.is_floating_point()):
        raise ValueError(f"bias: expected a floating-point tensor of shape ({cols},), got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if accumulate_into is not None and (accumulate_into.dtype != torch.float32
                                        or tuple(accumulate_into.shape) != (rows, cols)
                                        or accumulate_into.stride(1) != 1):
        raise ValueError(f"accumulate_into: expected a float32 {(rows, cols)} tensor with unit column stride, got "
                         f"{accumulate_into.dtype} {tuple(accumulate_into.shape)} strides {accumulate_into.stride()}")
    if out is not None:
        if accumulate_into is not None:
            raise ValueError("out and accumulate_into: give at most one of them")
        if out.dtype != out_dtype or tuple(out.shape) != (rows, cols) or out.stride(1) != 1 or out.device != device:
            raise ValueError(f"out: expected a {out_dtype} {(rows, cols)} tensor on {device} with unit column stride, "
                             f"got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    if recipe is not None and backend is None and recipe.gemm_backend != "auto":
        backend = recipe.gemm_backend
    chosen = resolve_backend(backend, device)
    if bias is not None:
        bias = bias.contiguous()
    if chosen == "reference":
        y = gpu_backends.finish_output(reference.gemm_reference(a_data, a_scale, a_amax, b_data, b_scale, b_amax,
                                                                a_e4m3_bound=a.e4m3_bound, b_e4m3_bound=b.e4m3_bound),
                                       out_dtype, bias, accumulate_into)
        return y if out is None else out.copy_(y)
    return gpu_backends.run(chosen, a_data, a_scale, a_amax, b_data, b_scale, b_amax, out_dtype=out_dtype,
                            bias=bias, accumulate_into=accumulate_into, out=out, a_e4m3_bound=a.e4m3_bound,
                            b_e4m3_bound=b.e4m3_bound)
