"""Public operations: validate inputs, then run the CUDA kernels (CUDA tensors) or the reference.

Set NVFP4_FORCE_REFERENCE=1 to run the reference on every device.
"""
from __future__ import annotations

import torch

from nvfp4_dist import environment, finite_check, reference
from nvfp4_dist.finite_check import NonFiniteAmaxError  # noqa: F401 (part of this module's interface)
from nvfp4_dist.formats import BLOCK_SIZE
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.reference.copies import check_copy_options
from nvfp4_dist.reference.fourover6 import FourOverSix
from nvfp4_dist.tensor import NVFP4Tensor

ROLES = ("activation", "weight", "gradient")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
COPIES = ("rowwise", "columnwise")


def use_kernels(tensor: torch.Tensor) -> bool:
    """True when `tensor` is on a GPU and the reference is not forced."""
    return tensor.is_cuda and not environment.FORCE_REFERENCE.read()


def backend_for(tensor: torch.Tensor):
    """The module that implements the operations for `tensor`: the kernels or the reference."""
    if use_kernels(tensor):
        from nvfp4_dist import kernels
        return kernels
    return reference


def _scope_covers(scope: str, role: str) -> bool:
    """Whether a 4over6 scope (none | weights | activations | all) covers `role` (never gradients)."""
    return role != "gradient" and scope in ("all", "weights" if role == "weight" else "activations")


def four_over_six_options(role: str, recipe: NVFP4Recipe) -> FourOverSix | None:
    """The 4over6 settings of a role's copies (docs/numerics.md §12), or None: weights and activations as
    recipe.nvfp4_4over6 says; gradients never, so their RHT and SR stay as the recipe says."""
    if not _scope_covers(recipe.nvfp4_4over6, role):
        return None
    bound = 256 if _scope_covers(recipe.nvfp4_4over6_e4m3_use_256, role) else 448
    return FourOverSix(err_mode=recipe.nvfp4_4over6_err_mode, e4m3_bound=bound,
                       fast_math=recipe.nvfp4_4over6_err_use_fast_math)


def quantize_options(role: str, recipe: NVFP4Recipe) -> dict:
    """What a role's copies get from the recipe: 2D blocks, RHT, SR, row scaling, 4over6 (docs/numerics.md §3-7, 12)."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not one of {ROLES}")
    return dict(block_2d=role == "weight" and recipe.weight_2d,
                rht=role != "weight" and recipe.rht,
                rht_random_sign=recipe.rht_random_sign,
                row_scaled=role == "activation" and recipe.row_scaled_activation,
                stochastic_rounding=role == "gradient" and recipe.stochastic_rounding,
                four_over_six=four_over_six_options(role, recipe))


def validate_input(x: torch.Tensor, *, name: str = "x", columnwise: bool = False, block_2d: bool = False,
                   rht: bool = False) -> None:
    """Raise ValueError naming the argument if x cannot be quantized as asked."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}.dtype={x.dtype}: allowed are {INPUT_DTYPES}")
    if x.dim() < 2:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: need at least 2 dims ([..., K])")
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    if cols == 0 or cols % BLOCK_SIZE:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: the last dim ({cols}) must be a positive multiple of {BLOCK_SIZE}")
    if (columnwise or block_2d) and (rows == 0 or rows % BLOCK_SIZE):
        what = "a 2D (16x16) quantization" if block_2d else "a columnwise copy"
        raise ValueError(f"{name}.shape={tuple(x.shape)}: {what} needs the leading dims' product ({rows}) "
                         f"to be a positive multiple of {BLOCK_SIZE}")
    if rht and columnwise and x.dtype != torch.bfloat16:
        raise ValueError(f"{name}.dtype={x.dtype}: the RHT columnwise copy takes torch.bfloat16 input (docs/numerics.md §5)")


def check_amax(amax: torch.Tensor | None, name: str, expected_numel: tuple, device: torch.device) -> None:
    if amax is None:
        return
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor, got {getattr(amax, 'dtype', type(amax).__name__)}")
    if amax.numel() not in expected_numel:
        raise ValueError(f"{name}.shape={tuple(amax.shape)}: expected {' or '.join(map(str, expected_numel))} elements")
    if amax.device != device:
        raise ValueError(f"{name}.device={amax.device} differs from the input's device {device}")


def compute_amaxes(x: torch.Tensor, role: str = "activation", *, rowwise: bool = True, columnwise: bool = True,
                   recipe: NVFP4Recipe | None = None):
    """(amax_rowwise, amax_columnwise) that quantize() would use, for reducing across ranks first."""
    recipe = recipe or NVFP4Recipe()
    options = quantize_options(role, recipe)
    validate_input(x, columnwise=columnwise, block_2d=options["block_2d"], rht=options["rht"])
    return backend_for(x).compute_amaxes(x.reshape(-1, x.shape[-1]), rowwise=rowwise, columnwise=columnwise,
                                         rht=options["rht"], rht_random_sign=options["rht_random_sign"],
                                         row_scaled=options["row_scaled"])


def draw_sr_seed() -> int:
    """A 62-bit stochastic-rounding seed from torch's default (CPU) generator: torch.manual_seed fixes it."""
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def quantize(x: torch.Tensor, role: str = "activation", *, rowwise: bool = True, columnwise: bool = True,
             recipe: NVFP4Recipe | None = None, amax_rowwise: torch.Tensor | None = None,
             amax_columnwise: torch.Tensor | None = None, sr_seed: int | None = None,
             sr_row_offset: int = 0) -> NVFP4Tensor:
    """Quantize x [..., K] to NVFP4 with the recipe's treatment of `role`.

    role: "activation" (RHT on the columnwise copy; row-scaled when the recipe says: one amax per row of x and,
          for the columnwise copy, one per column, docs/numerics.md §6b),
          "weight" (2D blocks when the recipe says) or "gradient" (RHT and SR);
          activations and weights take 4over6 where recipe.nvfp4_4over6 says (docs/numerics.md §12).
    amax_*: precomputed (for example all-reduced across ranks) amaxes.
    sr_seed / sr_row_offset: the stochastic-rounding stream (drawn from torch's generator when None)
          and this shard's first row in the global tensor.
    """
    recipe = recipe or NVFP4Recipe()
    options = quantize_options(role, recipe)
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False: ask for at least one copy")
    validate_input(x, columnwise=columnwise, block_2d=options["block_2d"], rht=options["rht"])
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    check_amax(amax_rowwise, "amax_rowwise", (rows,) if options["row_scaled"] else (1,), x.device)
    check_amax(amax_columnwise, "amax_columnwise", (cols,) if options["row_scaled"] else (1,), x.device)
    if not isinstance(sr_row_offset, int) or sr_row_offset < 0:
        raise ValueError(f"sr_row_offset={sr_row_offset!r}: must be an integer >= 0")
    stochastic = options.pop("stochastic_rounding")
    check_copy_options(columnwise=columnwise, block_2d=options["block_2d"], rht=options["rht"],
                       row_scaled=options["row_scaled"], stochastic=stochastic,
                       four_over_six=options["four_over_six"])
    if stochastic and sr_seed is None:
        sr_seed = draw_sr_seed()
    q = backend_for(x).quantize_tensor(
        x, rowwise=rowwise, columnwise=columnwise, sr_seed=sr_seed if stochastic else None,
        sr_row_offset=sr_row_offset, amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise, **options)
    if recipe.check_finite:
        finite_check.check_amaxes({"amax_rowwise": q.amax_rowwise, "amax_columnwise": q.amax_columnwise})
    return q


def dequantize(q: NVFP4Tensor, dtype: torch.dtype | None = None, copy: str | None = None) -> torch.Tensor:
    """q back to `dtype` (default q.dtype) in its original shape, from one copy (default: rowwise if present)."""
    if not isinstance(q, NVFP4Tensor):
        raise ValueError(f"q must be an NVFP4Tensor, got {type(q).__name__}")
    copy = copy or ("rowwise" if q.has_rowwise else "columnwise")
    if copy not in COPIES:
        raise ValueError(f"copy={copy!r} is not one of {COPIES}")
    if getattr(q, f"{copy}_data") is None:
        raise ValueError(f"copy={copy!r}: this NVFP4Tensor holds no {copy} copy")
    return backend_for(q.device_tensor()).dequantize_tensor(q, dtype or q.dtype, copy)


def swap_first_dims(gathered: torch.Tensor, world_size: int) -> torch.Tensor:
    """(W, K, X) -> (K, W, X) of a gathered columnwise copy [W*K, X] -> [K, W*X] (docs/numerics.md §9)."""
    if gathered.dim() != 2:
        raise ValueError(f"gathered.shape={tuple(gathered.shape)}: expected 2 dims [W*K, X]")
    if world_size < 1 or gathered.shape[0] % world_size:
        raise ValueError(f"world_size={world_size} must be >= 1 and divide gathered.shape[0]={gathered.shape[0]}")
    return backend_for(gathered).swap_first_dims(gathered, world_size)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] E4M3 scales -> the flat 128x4 swizzled layout of Blackwell GEMMs (docs/numerics.md §8)."""
    if scale.dim() != 2 or scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"scale: expected a 2D float8_e4m3fn tensor, got {scale.dtype} {tuple(scale.shape)}")
    return backend_for(scale).swizzle_scales(scale)
