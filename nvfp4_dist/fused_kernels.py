"""CUDA twin of nvfp4_dist.reference.fused_producers: the same functions and signatures, run by
csrc/norm_quantize.cu and csrc/activation_quantize.cu.

Results equal the reference bit for bit (norm statistics and outputs, activation outputs, NVFP4 codes, scales and
amaxes). The norm's row pass holds a row in registers: its kernels take rows of whole 16-blocks up to
NORM_THREADS * MAX_NORM_BLOCKS_PER_THREAD * 16 wide (takes_norm_width). The activation kernels look the GELU or
SiLU of BF16 inputs up in a table of the formula's values (activation_table). Importing this module needs no GPU.
"""
from __future__ import annotations

import torch

from nvfp4_dist._extension import load_extension, on_device, stream_handle
from nvfp4_dist.formats import BLOCK_SIZE, SCALE_DTYPE
from nvfp4_dist.reference.fused_producers import ACTIVATIONS, NORMALIZATIONS, activation_output_shape
from nvfp4_dist.tensor import NVFP4Tensor

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NORM_THREADS = 256               # csrc/norm_quantize.cu kNormThreads
MAX_NORM_BLOCKS_PER_THREAD = 4   # csrc/norm_quantize.cu kMaxBlocksPerThread
_NORMALIZATION_CODES = {"LayerNorm": 0, "RMSNorm": 1}  # nvfp4::Normalization
_ACTIVATION_CODES = {"gelu": 0, "swiglu": 1}           # nvfp4::Activation
_VECTOR_BYTES = 16
_ACTIVATION_TABLES: dict[tuple[torch.device, str], torch.Tensor] = {}


def norm_blocks_per_thread(cols: int) -> int:
    """The 16-blocks of a row each row-pass thread holds: the power of two that covers the row."""
    needed = -(-cols // (BLOCK_SIZE * NORM_THREADS))
    return 1 << max(needed - 1, 0).bit_length()


def takes_norm_width(cols: int, dtype: torch.dtype) -> bool:
    """Whether the norm kernels take rows `cols` wide of `dtype`."""
    return (dtype in INPUT_DTYPES and cols > 0 and cols % BLOCK_SIZE == 0
            and norm_blocks_per_thread(cols) <= MAX_NORM_BLOCKS_PER_THREAD)


def _kernel_input(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as [rows, cols], contiguous and 16-byte aligned (a copy when it is not); ValueError off CUDA."""
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got {getattr(t, 'device', type(t).__name__)}")
    if t.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}.dtype={t.dtype}: the kernels take {INPUT_DTYPES}")
    t2d = t.reshape(-1, t.shape[-1]).contiguous()
    return t2d.clone() if t2d.data_ptr() % _VECTOR_BYTES else t2d


def _float_vector(t: torch.Tensor | None, name: str, size: int, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if t.shape != (size,) or t.device != device:
        raise ValueError(f"{name}: expected ({size},) on {device}, got {tuple(t.shape)} on {t.device}")
    return t.to(torch.float32).contiguous()


def _check_norm(x2d: torch.Tensor, normalization: str, bias) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: allowed values are {NORMALIZATIONS}")
    if (normalization == "LayerNorm") != (bias is not None):
        raise ValueError(f"normalization={normalization!r}: LayerNorm takes a bias, RMSNorm none")
    if not takes_norm_width(x2d.shape[1], x2d.dtype):
        raise ValueError(f"x.shape[-1]={x2d.shape[1]}: the norm kernels take whole 16-blocks up to "
                         f"{NORM_THREADS * MAX_NORM_BLOCKS_PER_THREAD * BLOCK_SIZE} wide")


def _norm_tensors(x, weight, bias, normalization):
    x2d = _kernel_input(x, "x")
    _check_norm(x2d, normalization, bias)
    cols = x2d.shape[1]
    return (x2d, _float_vector(weight, "weight", cols, x2d.device), _float_vector(bias, "bias", cols, x2d.device))


def _amax(x2d: torch.Tensor, numel: int = 1) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32, device=x2d.device)


def _norm_statistics(x2d: torch.Tensor, normalization: str):
    rows = x2d.shape[0]
    mean = _amax(x2d, rows) if normalization == "LayerNorm" else None
    return mean, _amax(x2d, rows)


def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, normalization: str,
                 eps: float, out_dtype: torch.dtype):
    """(y in out_dtype with x's shape, mean or None, rstd) of LayerNorm/RMSNorm over the last dim."""
    x2d, weight, bias = _norm_tensors(x, weight, bias, normalization)
    if out_dtype not in INPUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}: the kernels write {INPUT_DTYPES}")
    mean, rstd = _norm_statistics(x2d, normalization)
    y = torch.empty(x2d.shape, dtype=out_dtype, device=x2d.device)
    with on_device(x2d.device):
        load_extension().norm_rows(x2d, weight, bias, _NORMALIZATION_CODES[normalization], float(eps), mean, rstd,
                                   None, y, None, False, None, True, stream_handle(x2d.device))
    return y.reshape(x.shape), mean, rstd


def norm_row_sums(x: torch.Tensor, *, normalization: str):
    """(mean or None for RMSNorm, sum of squares), FP32 [M], of the rows of x [..., K]: the row pass's statistics
    before rstd."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: allowed values are {NORMALIZATIONS}")
    x2d = _kernel_input(x, "x")
    cols = x2d.shape[1]
    weight = torch.ones(cols, dtype=torch.float32, device=x2d.device)
    bias = torch.zeros_like(weight) if normalization == "LayerNorm" else None
    _check_norm(x2d, normalization, bias)
    mean, rstd = _norm_statistics(x2d, normalization)
    sum_of_squares = torch.empty_like(rstd)
    with on_device(x2d.device):
        load_extension().norm_rows(x2d, weight, bias, _NORMALIZATION_CODES[normalization], 0.0, mean, rstd,
                                   sum_of_squares, None, None, False, None, True, stream_handle(x2d.device))
    return mean, sum_of_squares


def _check_rows(rows: int, columnwise: bool, row_scaled: bool) -> None:
    if columnwise and rows % BLOCK_SIZE:
        raise ValueError(f"{rows} rows: a columnwise copy needs a multiple of {BLOCK_SIZE}")
    if columnwise and row_scaled:
        raise ValueError("columnwise=True with row_scaled=True: row-scaled copies are rowwise only "
                         "(docs/numerics.md §6)")


def norm_amaxes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, normalization: str,
                eps: float, columnwise: bool = True, rht: bool = False, rht_random_sign: bool = True,
                row_scaled: bool = False):
    """Pass 1: (mean or None, rstd, amax_rowwise, amax_columnwise or None) of the norm's BF16 output."""
    x2d, weight, bias = _norm_tensors(x, weight, bias, normalization)
    rows = x2d.shape[0]
    _check_rows(rows, columnwise, row_scaled)
    mean, rstd = _norm_statistics(x2d, normalization)
    amax_rowwise = _amax(x2d, rows if row_scaled else 1)
    amax_rht = _amax(x2d) if columnwise and rht else None
    with on_device(x2d.device):
        load_extension().norm_rows(x2d, weight, bias, _NORMALIZATION_CODES[normalization], float(eps), mean, rstd,
                                   None, None, amax_rowwise, row_scaled, amax_rht, rht_random_sign,
                                   stream_handle(x2d.device))
    amax_columnwise = amax_rht if amax_rht is not None else (amax_rowwise.clone() if columnwise else None)
    return mean, rstd, amax_rowwise, amax_columnwise


def _copies(shape: torch.Size, device, *, rowwise: bool, columnwise: bool, rht: bool, rht_random_sign: bool,
            row_scaled: bool, amax_rowwise, amax_columnwise) -> NVFP4Tensor:
    """An NVFP4Tensor of a BF16 output of `shape` with its copies allocated (as quantize_tensor makes them)."""
    q = NVFP4Tensor(shape=shape, dtype=torch.bfloat16, rht=rht and columnwise, rht_random_sign=rht_random_sign,
                    row_scaled=row_scaled)
    rows, cols = q.rows, q.cols
    if rowwise:
        if amax_rowwise is None or amax_rowwise.numel() != (rows if row_scaled else 1):
            raise ValueError(f"amax_rowwise: expected {rows if row_scaled else 1} element(s)")
        q.rowwise_data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
        q.rowwise_scale = torch.empty(rows, cols // BLOCK_SIZE, dtype=SCALE_DTYPE, device=device)
        q.amax_rowwise = amax_rowwise.to(torch.float32).reshape(-1).contiguous()
    if columnwise:
        if amax_columnwise is None or amax_columnwise.numel() != 1:
            raise ValueError("amax_columnwise: expected 1 element")
        q.columnwise_data = torch.empty(cols, rows // 2, dtype=torch.uint8, device=device)
        q.columnwise_scale = torch.empty(cols, rows // BLOCK_SIZE, dtype=SCALE_DTYPE, device=device)
        q.amax_columnwise = amax_columnwise.to(torch.float32).reshape(-1).contiguous()
    return q


def _raw(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8)


def norm_quantize(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mean: torch.Tensor | None,
                  rstd: torch.Tensor, *, amax_rowwise: torch.Tensor, amax_columnwise: torch.Tensor | None,
                  rowwise: bool = True, columnwise: bool = True, rht: bool = False, rht_random_sign: bool = True,
                  row_scaled: bool = False) -> NVFP4Tensor:
    """Pass 2: the norm's BF16 output (from pass 1's statistics) quantized with the given amaxes."""
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False: ask for at least one copy")
    x2d, weight, bias = _norm_tensors(x, weight, bias, normalization="LayerNorm" if mean is not None else "RMSNorm")
    rows = x2d.shape[0]
    _check_rows(rows, columnwise, row_scaled)
    mean = _float_vector(mean, "mean", rows, x2d.device)
    rstd = _float_vector(rstd, "rstd", rows, x2d.device)
    q = _copies(x.shape, x2d.device, rowwise=rowwise, columnwise=columnwise, rht=rht, rht_random_sign=rht_random_sign,
                row_scaled=row_scaled, amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise)
    code = _NORMALIZATION_CODES["LayerNorm" if mean is not None else "RMSNorm"]
    with on_device(x2d.device):
        load_extension().norm_cast(x2d, weight, bias, code, mean, rstd, q.amax_rowwise, q.amax_columnwise,
                                   q.rowwise_data, _raw(q.rowwise_scale), q.columnwise_data, _raw(q.columnwise_scale),
                                   row_scaled, rht, rht_random_sign, stream_handle(x2d.device))
    return q


def _activation_input(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: allowed values are {ACTIVATIONS}")
    h2d = _kernel_input(h, "h")
    width = BLOCK_SIZE * (2 if activation == "swiglu" else 1)
    if h2d.shape[1] == 0 or h2d.shape[1] % width:
        raise ValueError(f"h.shape[-1]={h2d.shape[1]}: must be a positive multiple of {width} for {activation!r}")
    return h2d


def activation_table(device: torch.device, activation: str) -> torch.Tensor | None:
    """The table by which the kernels activate BF16 inputs on `device` (csrc/producer_numerics.cuh: the formula's
    values over the BF16 inputs that need them), built once per device and activation. None while the current
    stream captures a CUDA graph and it is not built yet: the kernels then evaluate the formulas (the same bits,
    slower)."""
    key = (torch.device(device), activation)
    table = _ACTIVATION_TABLES.get(key)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        extension = load_extension()
        code = _ACTIVATION_CODES[activation]
        with on_device(key[0]):
            table = torch.empty(extension.activation_table_bytes(code), dtype=torch.uint8, device=key[0])
            extension.activation_table(code, table, stream_handle(key[0]))
            torch.cuda.current_stream(key[0]).synchronize()  # other streams may read it first
        _ACTIVATION_TABLES[key] = table
    return table


def _table_for(h2d: torch.Tensor, activation: str) -> torch.Tensor | None:
    return activation_table(h2d.device, activation) if h2d.dtype == torch.bfloat16 else None


def activation_forward(h: torch.Tensor, *, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The activation of h [..., N] in out_dtype, which must be h's dtype ([..., N/2] for SwiGLU)."""
    h2d = _activation_input(h, activation)
    if out_dtype != h.dtype:
        raise ValueError(f"out_dtype={out_dtype}: the activation kernel writes h's dtype ({h.dtype})")
    shape = activation_output_shape(h.shape, activation)
    out = torch.empty(shape, dtype=out_dtype, device=h2d.device)
    with on_device(h2d.device):
        load_extension().activation_forward(h2d, _ACTIVATION_CODES[activation], out, _table_for(h2d, activation),
                                            stream_handle(h2d.device))
    return out


def activation_amaxes(h: torch.Tensor, *, activation: str, columnwise: bool = True, rht: bool = False,
                      rht_random_sign: bool = True, row_scaled: bool = False):
    """Pass 1: (amax_rowwise, amax_columnwise or None) of the activation's BF16 output."""
    h2d = _activation_input(h, activation)
    rows = h2d.shape[0]
    _check_rows(rows, columnwise, row_scaled)
    amax_rowwise = _amax(h2d, rows if row_scaled else 1)
    amax_rht = _amax(h2d) if columnwise and rht else None
    with on_device(h2d.device):
        load_extension().activation_amaxes(h2d, _ACTIVATION_CODES[activation], amax_rowwise, row_scaled, amax_rht,
                                           rht_random_sign, _table_for(h2d, activation), stream_handle(h2d.device))
    amax_columnwise = amax_rht if amax_rht is not None else (amax_rowwise.clone() if columnwise else None)
    return amax_rowwise, amax_columnwise


def activation_quantize(h: torch.Tensor, *, activation: str, amax_rowwise: torch.Tensor,
                        amax_columnwise: torch.Tensor | None, rowwise: bool = True, columnwise: bool = True,
                        rht: bool = False, rht_random_sign: bool = True, row_scaled: bool = False) -> NVFP4Tensor:
    """Pass 2: the activation's BF16 output quantized with the given amaxes."""
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False: ask for at least one copy")
    h2d = _activation_input(h, activation)
    _check_rows(h2d.shape[0], columnwise, row_scaled)
    q = _copies(activation_output_shape(h.shape, activation), h2d.device, rowwise=rowwise, columnwise=columnwise,
                rht=rht, rht_random_sign=rht_random_sign, row_scaled=row_scaled, amax_rowwise=amax_rowwise,
                amax_columnwise=amax_columnwise)
    with on_device(h2d.device):
        load_extension().activation_cast(h2d, _ACTIVATION_CODES[activation], q.amax_rowwise, q.amax_columnwise,
                                         q.rowwise_data, _raw(q.rowwise_scale), q.columnwise_data,
                                         _raw(q.columnwise_scale), row_scaled, rht, rht_random_sign,
                                         _table_for(h2d, activation), stream_handle(h2d.device))
    return q
