"""CUDA twin of nvfp4_dist.reference: the same functions and signatures, run by the csrc/ kernels.

Results equal the reference byte for byte (codes, scales, amax). The extension is built on first
use (nvfp4_dist/_extension.py); importing this module needs no GPU.
"""
from __future__ import annotations

import torch

from nvfp4_dist._extension import load_extension, on_device, stream_handle
from nvfp4_dist.formats import BLOCK_SIZE, E4M3_BOUND, SCALE_DTYPE
from nvfp4_dist.reference.copies import check_copy_options
from nvfp4_dist.reference.fourover6 import FourOverSix
from nvfp4_dist.reference.swizzle import padded_scale_shape
from nvfp4_dist.tensor import NVFP4Tensor

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_VECTOR_BYTES = 16  # the kernels read the input in 16-byte vectors
_MAX_SEED = 2 ** 64


def _check_input(x2d: torch.Tensor, *, columnwise: bool, block_2d: bool = False, rht: bool = False) -> None:
    """ValueError naming the problem for inputs the kernels do not take."""
    if not isinstance(x2d, torch.Tensor) or not x2d.is_cuda:
        raise ValueError(f"x must be a CUDA tensor, got {getattr(x2d, 'device', type(x2d).__name__)}")
    if x2d.dtype not in INPUT_DTYPES:
        raise ValueError(f"x.dtype={x2d.dtype}: the kernels take {INPUT_DTYPES}")
    rows, cols = x2d.shape
    if cols == 0 or cols % BLOCK_SIZE:
        raise ValueError(f"x.shape={tuple(x2d.shape)}: the last dim must be a positive multiple of {BLOCK_SIZE}")
    if (columnwise or block_2d) and rows % BLOCK_SIZE:
        raise ValueError(f"x.shape={tuple(x2d.shape)}: a columnwise copy or 16x16 blocks need rows ({rows}) "
                         f"to be a multiple of {BLOCK_SIZE}")
    if rht and columnwise:
        if x2d.dtype != torch.bfloat16:
            raise ValueError(f"x.dtype={x2d.dtype}: the RHT columnwise copy takes torch.bfloat16 only (docs/numerics.md §5)")
        if block_2d:
            raise ValueError("block_2d=True with rht=True: the kernels apply the RHT to 1D (1x16) blocks only")


def _kernel_input(x2d: torch.Tensor) -> torch.Tensor:
    """x2d contiguous and 16-byte aligned (a fresh copy when it is not)."""
    x2d = x2d.contiguous()
    return x2d.clone() if x2d.data_ptr() % _VECTOR_BYTES else x2d


def _new_amax(x2d: torch.Tensor, numel: int = 1) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32, device=x2d.device)


def compute_amaxes(x2d: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True, rht: bool = False,
                   rht_random_sign: bool = True, row_scaled: bool = False):
    """(amax_rowwise, amax_columnwise) for the copies asked for (None for the others).

    Rowwise: per tensor (1,), or per row (M,) when row_scaled. Columnwise: after the RHT; per tensor (1,), or per
    row of x^T (K,) when row_scaled (docs/numerics.md §6b).
    """
    _check_input(x2d, columnwise=columnwise, rht=rht)
    x2d = _kernel_input(x2d)
    extension, stream = load_extension(), stream_handle(x2d.device)
    amax_rowwise = amax_columnwise = None
    with on_device(x2d.device):
        if rowwise and row_scaled:
            amax_rowwise = _new_amax(x2d, x2d.shape[0])
            extension.amax_rows(x2d, amax_rowwise, stream)
        if columnwise and row_scaled:
            amax_columnwise = _new_amax(x2d, x2d.shape[1])
            extension.amax_columns(x2d, rht, rht_random_sign, amax_columnwise, stream)
        elif columnwise and rht:
            amax_columnwise = _new_amax(x2d)
            plain = _new_amax(x2d) if rowwise and not row_scaled else None
            extension.amax_rht(x2d, rht_random_sign, plain, amax_columnwise, stream)
            amax_rowwise = plain if plain is not None else amax_rowwise
        if (rowwise and amax_rowwise is None) or (columnwise and amax_columnwise is None):
            amax = _new_amax(x2d)
            extension.amax_tensor(x2d, amax, stream)
            if rowwise and amax_rowwise is None:
                amax_rowwise = amax
            if columnwise and amax_columnwise is None:
                amax_columnwise = amax.clone() if amax_rowwise is amax else amax
    return amax_rowwise, amax_columnwise


def _check_amax(amax: torch.Tensor, name: str, numel: int, device: torch.device) -> torch.Tensor:
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or amax.device != device:
        raise ValueError(f"{name} must be a float32 tensor on {device}, got "
                         f"{getattr(amax, 'dtype', type(amax).__name__)} on {getattr(amax, 'device', None)}")
    if amax.numel() != numel:
        raise ValueError(f"{name}.shape={tuple(amax.shape)}: expected {numel} element(s)")
    return amax.reshape(numel).contiguous()


def quantize_tensor(x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                    block_2d: bool = False, rht: bool = False, rht_random_sign: bool = True,
                    row_scaled: bool = False, sr_seed: int | torch.Tensor | None = None, sr_row_offset: int = 0,
                    amax_rowwise: torch.Tensor | None = None,
                    amax_columnwise: torch.Tensor | None = None,
                    four_over_six: FourOverSix | None = None) -> NVFP4Tensor:
    """Quantize x (viewed as [M, K]) into an NVFP4Tensor with the CUDA kernels (same contract as the reference).
    sr_seed: an int, or one int64 on x's device that the kernel reads there (ops.draw_sr_seed)."""
    check_copy_options(columnwise=columnwise, block_2d=block_2d, rht=rht, row_scaled=row_scaled,
                       stochastic=sr_seed is not None, four_over_six=four_over_six)
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False: ask for at least one copy")
    if x.dim() < 1:
        raise ValueError(f"x.shape={tuple(x.shape)}: need at least 1 dim ([..., K])")
    x2d = x.reshape(-1, x.shape[-1])
    _check_input(x2d, columnwise=columnwise, block_2d=block_2d, rht=rht)
    if isinstance(sr_seed, torch.Tensor):
        if sr_seed.dtype != torch.int64 or sr_seed.numel() != 1 or sr_seed.device != x2d.device:
            raise ValueError(f"sr_seed: a seed tensor must hold one int64 on {x2d.device}, got {sr_seed.dtype} "
                             f"{tuple(sr_seed.shape)} on {sr_seed.device}")
    elif sr_seed is not None and not 0 <= sr_seed < _MAX_SEED:
        raise ValueError(f"sr_seed={sr_seed}: must be an integer in [0, 2**64)")
    if not isinstance(sr_row_offset, int) or sr_row_offset < 0:
        raise ValueError(f"sr_row_offset={sr_row_offset!r}: must be an integer >= 0")
    x2d = _kernel_input(x2d)
    rows, cols = x2d.shape
    if amax_rowwise is not None and rowwise:
        amax_rowwise = _check_amax(amax_rowwise, "amax_rowwise", rows if row_scaled else 1, x2d.device)
    if amax_columnwise is not None and columnwise:
        amax_columnwise = _check_amax(amax_columnwise, "amax_columnwise", cols if row_scaled else 1, x2d.device)
    need_rowwise = rowwise and amax_rowwise is None
    need_columnwise = columnwise and amax_columnwise is None
    if need_rowwise or need_columnwise:
        local_row, local_col = compute_amaxes(x2d, rowwise=need_rowwise, columnwise=need_columnwise, rht=rht,
                                              rht_random_sign=rht_random_sign, row_scaled=row_scaled)
        amax_rowwise = local_row if need_rowwise else amax_rowwise
        amax_columnwise = local_col if need_columnwise else amax_columnwise
    e4m3_bound = E4M3_BOUND if four_over_six is None else four_over_six.e4m3_bound
    q = NVFP4Tensor(shape=x.shape, dtype=x.dtype, block_2d=block_2d, rht=rht and columnwise,
                    rht_random_sign=rht_random_sign, row_scaled=row_scaled, e4m3_bound=e4m3_bound)
    device = x2d.device
    if rowwise:
        q.rowwise_data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
        q.rowwise_scale = torch.empty(rows, cols // BLOCK_SIZE, dtype=SCALE_DTYPE, device=device)
        q.amax_rowwise = amax_rowwise
    if columnwise:
        q.columnwise_data = torch.empty(cols, rows // 2, dtype=torch.uint8, device=device)
        q.columnwise_scale = torch.empty(cols, rows // BLOCK_SIZE, dtype=SCALE_DTYPE, device=device)
        q.amax_columnwise = amax_columnwise
    with on_device(device):
        launch_quantize(x2d, q.amax_rowwise, q.amax_columnwise, q.rowwise_data, q.rowwise_scale, q.columnwise_data,
                        q.columnwise_scale, row_scaled=row_scaled, block_2d=block_2d, rht=rht,
                        rht_random_sign=rht_random_sign, sr_seed=sr_seed, sr_row_offset=sr_row_offset,
                        four_over_six=four_over_six)
    return q


def launch_quantize(x2d: torch.Tensor, amax_rowwise, amax_columnwise, rowwise_data, rowwise_scale, columnwise_data,
                    columnwise_scale, *, row_scaled: bool = False, block_2d: bool = False, rht: bool = False,
                    rht_random_sign: bool = True, sr_seed: int | torch.Tensor | None = None,
                    sr_row_offset: int = 0, four_over_six: FourOverSix | None = None) -> None:
    """The quantize kernel into preallocated copies (a copy's data, scale and amax all None when not wanted), on
    the current stream: quantize_tensor's launch, for callers that own their outputs (benchmarks)."""
    seed_device = sr_seed if isinstance(sr_seed, torch.Tensor) else None
    seed = 0 if sr_seed is None or seed_device is not None else sr_seed
    e4m3_bound = E4M3_BOUND if four_over_six is None else four_over_six.e4m3_bound
    load_extension().quantize(
        x2d, amax_rowwise, amax_columnwise, rowwise_data,
        None if rowwise_scale is None else rowwise_scale.view(torch.uint8), columnwise_data,
        None if columnwise_scale is None else columnwise_scale.view(torch.uint8),
        row_scaled, block_2d, rht, rht_random_sign, sr_seed is not None,
        seed - _MAX_SEED if seed >= 2 ** 63 else seed, seed_device, sr_row_offset, four_over_six is not None,
        e4m3_bound,
        four_over_six is not None and four_over_six.err_mode == "MSE",
        four_over_six is not None and four_over_six.fast_math, stream_handle(x2d.device))


def dequantize_tensor(q: NVFP4Tensor, dtype: torch.dtype, copy: str) -> torch.Tensor:
    """One copy of q back to `dtype` in the original shape ('rowwise' or 'columnwise')."""
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype={dtype}: the dequantize kernels write {INPUT_DTYPES}")
    if copy not in ("rowwise", "columnwise"):
        raise ValueError(f"copy={copy!r} is not one of ('rowwise', 'columnwise')")
    rows, cols = q.rows, q.cols
    data = getattr(q, f"{copy}_data")
    if data is None:
        raise ValueError(f"copy={copy!r}: this NVFP4Tensor holds no {copy} copy")
    out = torch.empty(rows, cols, dtype=dtype, device=data.device)
    scale = getattr(q, f"{copy}_scale").contiguous().view(torch.uint8)
    with on_device(data.device):
        if copy == "rowwise":
            load_extension().dequantize_rowwise(data.contiguous(), scale, q.amax_rowwise.contiguous(), q.row_scaled,
                                                q.e4m3_bound, out, stream_handle(out.device))
        else:
            load_extension().dequantize_columnwise(data.contiguous(), scale, q.amax_columnwise.contiguous(),
                                                   q.row_scaled, q.e4m3_bound, q.rht, q.rht_random_sign, out,
                                                   stream_handle(out.device))
    return out.reshape(q.shape)


def swap_first_dims(gathered: torch.Tensor, world_size: int) -> torch.Tensor:
    """[W*K, X] viewed as (W, K, X) -> (K, W, X), returned as [K, W*X]."""
    if gathered.dim() != 2 or world_size < 1 or gathered.shape[0] % world_size:
        raise ValueError(f"gathered.shape={tuple(gathered.shape)}, world_size={world_size}: expected [W*K, X] "
                         f"with world_size >= 1 dividing dim 0")
    gathered = gathered.contiguous()
    rows = gathered.shape[0] // world_size
    out = torch.empty(rows, world_size * gathered.shape[1], dtype=gathered.dtype, device=gathered.device)
    with on_device(gathered.device):
        load_extension().swap_first_dims(gathered, world_size, out, stream_handle(out.device))
    return out


def transpose_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 codes [N, K/2] -> the codes of the transpose, [K, N/2]."""
    packed = packed.contiguous()
    out = torch.empty(packed.shape[1] * 2, packed.shape[0] // 2, dtype=torch.uint8, device=packed.device)
    with on_device(packed.device):
        load_extension().transpose_codes(packed, out, stream_handle(out.device))
    return out


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] scales -> flat [Rp * Cp] in the 128x4 swizzled order, zero padded."""
    if scale.dim() != 2:
        raise ValueError(f"scale.shape={tuple(scale.shape)}: expected 2 dims")
    raw = scale.contiguous().view(torch.uint8)
    padded_rows, padded_cols = padded_scale_shape(*raw.shape)
    out = torch.empty(padded_rows * padded_cols, dtype=torch.uint8, device=raw.device)
    with on_device(raw.device):
        load_extension().swizzle_scales(raw, out, stream_handle(out.device))
    return out.view(SCALE_DTYPE)
