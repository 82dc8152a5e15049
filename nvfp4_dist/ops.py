"""Public operations: validate inputs, then run the CUDA kernels (CUDA tensors) or the reference.

Set NVFP4_FORCE_REFERENCE=1 to run the reference on every device.
"""
from __future__ import annotations

import math

import torch

from nvfp4_dist import environment, finite_check, reference
from nvfp4_dist.finite_check import NonFiniteAmaxError
from nvfp4_dist.formats import BLOCK_SIZE, SCALE_DTYPE
from nvfp4_dist.recipe import NVFP4Recipe, check_recipe
from nvfp4_dist.reference.copies import check_copy_options
from nvfp4_dist.reference.fourover6 import FourOverSix
from nvfp4_dist.tensor import NVFP4Tensor

ROLES = ("activation", "weight", "gradient")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
COPIES = ("rowwise", "columnwise")
SR_SEED_LIMIT = 2 ** 64


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
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    if cols == 0 or cols % BLOCK_SIZE:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: the last dim ({cols}) must be a positive multiple of {BLOCK_SIZE}")
    if (columnwise or block_2d) and rows % BLOCK_SIZE:
        what = "a 2D (16x16) quantization" if block_2d else "a columnwise copy"
        raise ValueError(f"{name}.shape={tuple(x.shape)}: {what} needs the leading dims' product ({rows}) "
                         f"to be a multiple of {BLOCK_SIZE}")
    if rht and columnwise and x.dtype != torch.bfloat16:
        raise ValueError(f"{name}.dtype={x.dtype}: the RHT columnwise copy takes torch.bfloat16 input (docs/numerics.md §5)")


def check_flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}): must be True or False")


def check_amax(amax: torch.Tensor | None, name: str, expected_numel: tuple, device: torch.device, *,
               check_finite: bool) -> None:
    """A given amax must be a float32 tensor of one dim (or none) with an expected number of values on `device`,
    non-negative, and finite unless check_finite is off (CUDA: checked without a host sync, see finite_check)."""
    if amax is None:
        return
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor, got {getattr(amax, 'dtype', type(amax).__name__)}")
    if amax.dim() > 1 or amax.numel() not in expected_numel:
        raise ValueError(f"{name}.shape={tuple(amax.shape)}: expected one dim of "
                         f"{' or '.join(map(str, expected_numel))} values")
    if amax.device != device:
        raise ValueError(f"{name}.device={amax.device} differs from the input's device {device}")
    if amax.numel() == 0:
        return

    def problem(values):
        """(error class, message) for a bad given amax, or None."""
        maximum, minimum = values
        if check_finite and not (math.isfinite(maximum) and math.isfinite(minimum)):
            return NonFiniteAmaxError, f"{name}: the given amax is not finite (max {maximum}, min {minimum})"
        if minimum < 0:
            return ValueError, f"{name}: the given amax has a negative value ({minimum}); an amax is a maximum of |x|"
        return None
    extremes = torch.stack([amax.detach().max(), amax.detach().min()])
    if amax.is_cuda:  # raised later, as a NonFiniteAmaxError (a ValueError)
        finite_check.check(extremes, lambda values: None if problem(values) is None else problem(values)[1])
        return
    found = problem(extremes.tolist())
    if found is not None:
        error, message = found
        raise error(message)


def check_sr_seed(sr_seed, device: torch.device) -> None:
    if sr_seed is None:
        return
    if isinstance(sr_seed, torch.Tensor):
        if sr_seed.dtype != torch.int64 or sr_seed.numel() != 1 or sr_seed.device != device:
            raise ValueError(f"sr_seed: a seed tensor must hold one int64 on the input's device {device}, got "
                             f"{sr_seed.dtype} {tuple(sr_seed.shape)} on {sr_seed.device}")
        return
    if not isinstance(sr_seed, int) or isinstance(sr_seed, bool):
        raise TypeError(f"sr_seed={sr_seed!r} ({type(sr_seed).__name__}): must be an int, an int64 tensor or None")
    if not 0 <= sr_seed < SR_SEED_LIMIT:
        raise ValueError(f"sr_seed={sr_seed}: must be in [0, 2**64)")


def compute_amaxes(x: torch.Tensor, role: str = "activation", *, rowwise: bool = True, columnwise: bool = True,
                   recipe: NVFP4Recipe | None = None):
    """(amax_rowwise, amax_columnwise) that quantize() would use, for reducing across ranks first."""
    check_recipe(recipe)
    recipe = recipe or NVFP4Recipe()
    options = quantize_options(role, recipe)
    check_flag(rowwise, "rowwise")
    check_flag(columnwise, "columnwise")
    validate_input(x, columnwise=columnwise, block_2d=options["block_2d"], rht=options["rht"])
    x2d = x.detach().reshape(-1, x.shape[-1])
    if x2d.shape[0] == 0:
        empty = empty_quantized(x, rowwise=rowwise, columnwise=columnwise, **options)
        return empty.amax_rowwise, empty.amax_columnwise
    return backend_for(x).compute_amaxes(x2d, rowwise=rowwise, columnwise=columnwise,
                                         rht=options["rht"], rht_random_sign=options["rht_random_sign"],
                                         row_scaled=options["row_scaled"])


def draw_sr_seed(like: torch.Tensor | None = None) -> int | torch.Tensor:
    """A 62-bit stochastic-rounding seed for quantizing `like` (docs/numerics.md §7); torch.manual_seed fixes it.

    For a tensor the kernels quantize (CUDA), it is drawn on the GPU from its device's default CUDA generator and
    stays there (an int64 tensor the kernel reads): no host sync, and a CUDA graph draws a new seed at every
    replay, exactly as the eager calls would. Otherwise, an int from torch's default CPU generator."""
    if like is not None and use_kernels(like):
        return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=like.device)
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def empty_quantized(x: torch.Tensor, *, rowwise: bool, columnwise: bool, block_2d: bool, rht: bool,
                    rht_random_sign: bool, row_scaled: bool, amax_rowwise: torch.Tensor | None = None,
                    amax_columnwise: torch.Tensor | None = None, **_) -> NVFP4Tensor:
    """The NVFP4Tensor of an x with no rows ([..., 0, ..., K]): empty data and scales, zero amaxes (the max over
    nothing of |x|), as torch.nn.Linear takes empty batches."""
    cols, device = x.shape[-1], x.device

    def amax(given, count):
        return given if given is not None else torch.zeros(count, dtype=torch.float32, device=device)
    q = NVFP4Tensor(shape=x.shape, dtype=x.dtype, block_2d=block_2d, rht=rht and columnwise,
                    rht_random_sign=rht_random_sign, row_scaled=row_scaled)
    if rowwise:
        q.rowwise_data = torch.empty((0, cols // 2), dtype=torch.uint8, device=device)
        q.rowwise_scale = torch.empty((0, cols // BLOCK_SIZE), dtype=SCALE_DTYPE, device=device)
        q.amax_rowwise = amax(amax_rowwise, 0 if row_scaled else 1)
    if columnwise:
        q.columnwise_data = torch.empty((cols, 0), dtype=torch.uint8, device=device)
        q.columnwise_scale = torch.empty((cols, 0), dtype=SCALE_DTYPE, device=device)
        q.amax_columnwise = amax(amax_columnwise, cols if row_scaled else 1)
    return q


def quantize(x: torch.Tensor, role: str = "activation", *, rowwise: bool = True, columnwise: bool = True,
             recipe: NVFP4Recipe | None = None, amax_rowwise: torch.Tensor | None = None,
             amax_columnwise: torch.Tensor | None = None, sr_seed: int | torch.Tensor | None = None,
             sr_row_offset: int = 0, check_finite: bool | None = None) -> NVFP4Tensor:
    """Quantize x [..., K] to NVFP4 with the recipe's treatment of `role`.

    role: "activation" (RHT on the columnwise copy; row-scaled when the recipe says: one amax per row of x and,
          for the columnwise copy, one per column, docs/numerics.md §6b),
          "weight" (2D blocks when the recipe says) or "gradient" (RHT and SR);
          activations and weights take 4over6 where recipe.nvfp4_4over6 says (docs/numerics.md §12).
    amax_*: precomputed (for example all-reduced across ranks) amaxes: float32, one dim, non-negative (and
          finite when checked).
    sr_seed / sr_row_offset: the stochastic-rounding seed (an int, or for CUDA input one int64 on its device; drawn
          by draw_sr_seed when None) and this shard's first row in the global tensor.
    check_finite: raise NonFiniteAmaxError for a NaN/Inf amax (None: the recipe's check_finite; the layers pass
          False and check their operands themselves, across their tensor-parallel group).
    The result holds no autograd history (x's gradient does not flow through quantization). An x with no rows
    gives an NVFP4Tensor with empty data and scales.
    """
    check_recipe(recipe)
    recipe = recipe or NVFP4Recipe()
    options = quantize_options(role, recipe)
    check_flag(rowwise, "rowwise")
    check_flag(columnwise, "columnwise")
    if check_finite is None:
        check_finite = recipe.check_finite
    check_flag(check_finite, "check_finite")
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False: ask for at least one copy")
    validate_input(x, columnwise=columnwise, block_2d=options["block_2d"], rht=options["rht"])
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    check_amax(amax_rowwise, "amax_rowwise", (rows,) if options["row_scaled"] else (1,), x.device,
               check_finite=check_finite)
    check_amax(amax_columnwise, "amax_columnwise", (cols,) if options["row_scaled"] else (1,), x.device,
               check_finite=check_finite)
    if not isinstance(sr_row_offset, int) or isinstance(sr_row_offset, bool) or sr_row_offset < 0:
        raise ValueError(f"sr_row_offset={sr_row_offset!r}: must be an integer >= 0")
    check_sr_seed(sr_seed, x.device)
    stochastic = options.pop("stochastic_rounding")
    check_copy_options(columnwise=columnwise, block_2d=options["block_2d"], rht=options["rht"],
                       row_scaled=options["row_scaled"], stochastic=stochastic,
                       four_over_six=options["four_over_six"])
    x = x.detach()
    amax_rowwise = None if amax_rowwise is None else amax_rowwise.detach()
    amax_columnwise = None if amax_columnwise is None else amax_columnwise.detach()
    if rows == 0:
        return empty_quantized(x, rowwise=rowwise, columnwise=columnwise, amax_rowwise=amax_rowwise,
                               amax_columnwise=amax_columnwise, **options)
    if stochastic and sr_seed is None:
        sr_seed = draw_sr_seed(x)
    if isinstance(sr_seed, torch.Tensor) and not use_kernels(x):
        sr_seed = int(sr_seed.item())  # the reference takes the seed as an int
    q = backend_for(x).quantize_tensor(
        x, rowwise=rowwise, columnwise=columnwise, sr_seed=sr_seed if stochastic else None,
        sr_row_offset=sr_row_offset, amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise, **options)
    if check_finite:
        finite_check.check_operands({"x": q})
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
    if q.rows == 0:
        return torch.empty(q.shape, dtype=dtype or q.dtype, device=q.device)
    return backend_for(q.device_tensor()).dequantize_tensor(q, dtype or q.dtype, copy)


def swap_first_dims(gathered: torch.Tensor, world_size: int) -> torch.Tensor:
    """(W, K, X) -> (K, W, X) of a gathered columnwise copy [W*K, X] -> [K, W*X] (docs/numerics.md §9)."""
    if gathered.dim() != 2:
        raise ValueError(f"gathered.shape={tuple(gathered.shape)}: expected 2 dims [W*K, X]")
    if world_size < 1 or gathered.shape[0] % world_size:
        raise ValueError(f"world_size={world_size} must be >= 1 and divide gathered.shape[0]={gathered.shape[0]}")
    return backend_for(gathered).swap_first_dims(gathered, world_size)


def transpose_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 codes [N, K/2] -> the codes of the transpose, packed the same way, [K, N/2] (docs/numerics.md §4:
    a 16x16-blocked rowwise copy's codes are its columnwise copy's, transposed)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[0] % 2:
        raise ValueError(f"packed: expected 2D uint8 codes [N, K/2] with N even, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    return backend_for(packed).transpose_codes(packed)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] E4M3 scales -> the flat 128x4 swizzled layout of Blackwell GEMMs (docs/numerics.md §8)."""
    if scale.dim() != 2 or scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"scale: expected a 2D float8_e4m3fn tensor, got {scale.dtype} {tuple(scale.shape)}")
    return backend_for(scale).swizzle_scales(scale)
