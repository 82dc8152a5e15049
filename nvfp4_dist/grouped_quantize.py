"""Grouped (segmented) NVFP4 quantization: x [M, K] split into E row segments (a mixture of experts' tokens),
each quantized as a tensor of its own.

quantize_segments(x, split_sizes, role, recipe) returns, per segment e (rows [o_e, o_e + m_e)), exactly what
linear.quantize_operand(x[o_e:o_e + m_e], role, recipe, sr_row_offset=sr_row_offset + o_e) returns: codes,
scales and amaxes byte for byte (None for a segment with no rows). Its definition, and the path on the CPU
(the reference) and for the recipe options below, is that loop of per-segment quantizations.

On CUDA it runs a constant number of launches, independent of E, for the recipe family of the default recipe
(1x16 or 16x16 blocks, RHT, stochastic rounding):
  - the amaxes: the per-row amax of x (rowwise copy without the RHT, or no RHT at all), or the plain and post-RHT
    amax of each 16-row chunk (csrc/amax.cu, amax_rht_chunks: the RHT's 16-row chunks never straddle segments,
    whose sizes are multiples of 16 when a columnwise copy is made); then one segment_amaxes launch for the E
    segment amaxes (NaN winning, as the amax kernels) and their expansion into one amax per row (rowwise copy)
    and per 16-row chunk (columnwise copy);
  - one cast (csrc/quantize_tile.cuh with QuantizeArgs.amax_rowwise_rows / amax_columnwise_chunks): each row's
    rowwise blocks and each chunk's columnwise blocks use their segment's amax with the arithmetic of a tensor
    amax of that value, so each segment's bytes are its own quantization's. It writes the rowwise copy of x
    [M, K/2] (segment e: rows o_e ..) and the columnwise copy of x^T [K, M/2] (segment e: columns o_e / 2 ..).
    Stochastic rounding: the kernels' random bits depend on the element's global row (row + sr_row_offset), so
    one cast of x at sr_row_offset gives segment e the bits of its own cast at sr_row_offset + o_e.
Segment e's NVFP4Tensor holds views: rows of the rowwise copy (contiguous), columns of the columnwise copy
(strided views of [K, M/2]; contiguous_columnwise=True, for equal segment sizes, makes them contiguous with one
copy: the stacked weights of nvfp4_dist.GroupedLinear) and one-element views of the [E] segment amaxes.
An FP16/FP32 x whose columnwise copy takes the RHT gets it from x cast to BF16 (quantize_operand's rule): one
more cast, rowwise and columnwise apart.

The loop runs instead for 4over6 and row-scaled recipes (their amaxes and tables are per tensor or per row
already), under CUDA graph capture, with NVFP4_FORCE_REFERENCE, and on CPU tensors.
"""
from __future__ import annotations

import torch

from nvfp4_dist import ops
from nvfp4_dist.formats import BLOCK_SIZE, SCALE_DTYPE
from nvfp4_dist.recipe import NVFP4Recipe
from nvfp4_dist.tensor import NVFP4Tensor

_MAX_SEED = 2 ** 64


def segment_offsets(split_sizes) -> list[int]:
    """The first row of each segment and the total: [0, m_0, m_0 + m_1, ...] (E + 1 entries)."""
    offsets = [0]
    for size in split_sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def check_segments(split_sizes, rows: int, *, columnwise: bool, block_2d: bool = False,
                   num_experts: int | None = None) -> list[int]:
    """split_sizes as a list of ints >= 0 summing to `rows` (and of num_experts entries when given), each a multiple
    of 16 when a columnwise copy or 16x16 blocks are asked for; ValueError naming the first bad entry otherwise.
    Takes a list or tuple of ints, or a 1D integer tensor (Megatron's tokens_per_expert; read on the host)."""
    if isinstance(split_sizes, torch.Tensor):
        if split_sizes.dim() != 1 or split_sizes.is_floating_point() or split_sizes.is_complex():
            raise ValueError(f"split_sizes: a tensor must be 1D of integers, got {split_sizes.dtype} "
                             f"{tuple(split_sizes.shape)}")
        split_sizes = split_sizes.tolist()
    if not isinstance(split_sizes, (list, tuple)):
        raise ValueError(f"split_sizes={split_sizes!r}: must be a list of ints (rows per segment)")
    sizes = list(split_sizes)
    if num_experts is not None and len(sizes) != num_experts:
        raise ValueError(f"split_sizes has {len(sizes)} entries: the layer has num_experts={num_experts}")
    for index, size in enumerate(sizes):
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"split_sizes[{index}]={size!r}: must be an int >= 0")
        if (columnwise or block_2d) and size % BLOCK_SIZE:
            what = "16x16 blocks" if block_2d else "a columnwise copy"
            raise ValueError(f"split_sizes[{index}]={size}: {what} needs each segment's rows to be a multiple of "
                             f"{BLOCK_SIZE}")
    if sum(sizes) != rows:
        raise ValueError(f"split_sizes sum to {sum(sizes)}: x has {rows} rows")
    return sizes


def segmented_kernels_apply(x2d: torch.Tensor, role: str, recipe: NVFP4Recipe) -> bool:
    """Whether quantize_segments runs the segmented kernels for x2d (else the per-segment loop)."""
    if not ops.use_kernels(x2d) or x2d.dtype not in ops.INPUT_DTYPES:
        return False
    if x2d.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    options = ops.quantize_options(role, recipe)
    return options["four_over_six"] is None and not options["row_scaled"]


def ints_on_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list of ints as a tensor on `device`, queued from pinned memory on CUDA: the host does not wait for
    the GPU (torch.tensor(..., device="cuda") would, until every kernel queued before it ran). Not for CUDA graph
    captures (a captured copy would read the pinned buffer again at every replay)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def chunk_amaxes(segment_amaxes: torch.Tensor, split_sizes: list[int], granule: int) -> torch.Tensor:
    """One amax per `granule` rows (1: per row, 16: per 16-row chunk) from one per segment: segment e's value
    repeated m_e / granule times (what segment_amaxes writes into rows_out / chunks_out, as torch ops)."""
    counts = torch.tensor([size // granule for size in split_sizes], dtype=torch.int64, device=segment_amaxes.device)
    return torch.repeat_interleave(segment_amaxes.reshape(-1), counts, output_size=sum(split_sizes) // granule)


def quantize_segments(x: torch.Tensor, split_sizes, role: str, recipe: NVFP4Recipe, *, rowwise: bool = True,
                      columnwise: bool = True, sr_seed: int | torch.Tensor | None = None, sr_row_offset: int = 0,
                      contiguous_columnwise: bool = False) -> list:
    """Per segment of x's rows, its NVFP4Tensor (None for an empty segment), as quantize_operand of the segment
    (module docstring). x: [M, K] (or [..., K], flattened); split_sizes: E ints >= 0 summing to M (a multiple of
    16 each when columnwise, or for 16x16 weight blocks); sr_seed: the stochastic-rounding seed shared by the
    segments (drawn once when the role's recipe rounds stochastically and none is given), segment e at row offset
    sr_row_offset + o_e; contiguous_columnwise: contiguous columnwise copies (equal segment sizes only)."""
    from nvfp4_dist.linear import quantize_operand  # linear imports the layers' modules

    ops.check_flag(rowwise, "rowwise")
    ops.check_flag(columnwise, "columnwise")
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False: ask for at least one copy")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor of at least 1 dim ([..., K]), got {getattr(x, 'shape', type(x))}")
    if not isinstance(sr_row_offset, int) or isinstance(sr_row_offset, bool) or sr_row_offset < 0:
        raise ValueError(f"sr_row_offset={sr_row_offset!r}: must be an integer >= 0")
    options = ops.quantize_options(role, recipe)
    x2d = x.detach().reshape(-1, x.shape[-1])
    sizes = check_segments(split_sizes, x2d.shape[0], columnwise=columnwise, block_2d=options["block_2d"])
    offsets = segment_offsets(sizes)
    if contiguous_columnwise and columnwise and len(set(sizes)) > 1:
        raise ValueError(f"contiguous_columnwise=True needs equal segment sizes, got {sizes}")
    if options["stochastic_rounding"] and sr_seed is None and any(sizes):
        sr_seed = ops.draw_sr_seed(x2d)
    if not any(sizes):
        return [None] * len(sizes)
    if not segmented_kernels_apply(x2d, role, recipe):
        return [None if size == 0 else
                quantize_operand(x2d[offsets[e]:offsets[e + 1]], role, recipe, rowwise=rowwise, columnwise=columnwise,
                                 sr_seed=sr_seed, sr_row_offset=sr_row_offset + offsets[e])
                for e, size in enumerate(sizes)]
    ops.validate_input(x2d, columnwise=columnwise, block_2d=options["block_2d"], rht=False)
    ops.check_sr_seed(sr_seed, x2d.device)
    seed = sr_seed if options["stochastic_rounding"] else None
    common = dict(block_2d=options["block_2d"], rht=options["rht"], rht_random_sign=options["rht_random_sign"],
                  sr_seed=seed, sr_row_offset=sr_row_offset)
    if columnwise and options["rht"] and x2d.dtype != torch.bfloat16:  # the RHT copy from the BF16 cast
        column_parts = _segmented_cast(x2d.to(torch.bfloat16), sizes, offsets, rowwise=False, columnwise=True,
                                       contiguous_columnwise=contiguous_columnwise, **common)
        column_parts = [None if q is None else q.replace(dtype=x2d.dtype) for q in column_parts]
        if not rowwise:
            parts = column_parts
        else:
            row_parts = _segmented_cast(x2d, sizes, offsets, rowwise=True, columnwise=False, **common)
            parts = [None if row is None else
                     row.replace(columnwise_data=column.columnwise_data, columnwise_scale=column.columnwise_scale,
                                 amax_columnwise=column.amax_columnwise, rht=column.rht)
                     for row, column in zip(row_parts, column_parts)]
    else:
        parts = _segmented_cast(x2d, sizes, offsets, rowwise=rowwise, columnwise=columnwise,
                                contiguous_columnwise=contiguous_columnwise, **common)
    return parts


def _segmented_cast(x2d: torch.Tensor, sizes: list[int], offsets: list[int], *, rowwise: bool, columnwise: bool,
                    block_2d: bool, rht: bool, rht_random_sign: bool, sr_seed, sr_row_offset: int,
                    contiguous_columnwise: bool = False) -> list:
    """The kernels' segmented cast of x2d (CUDA, rows > 0): amaxes, segment amaxes, one cast; per-segment views
    (contiguous_columnwise, equal sizes m: the columnwise copy rearranged to [E, K, m/2] by one copy)."""
    from nvfp4_dist._extension import load_extension, on_device, stream_handle
    from nvfp4_dist.kernels import _kernel_input

    x2d = _kernel_input(x2d)
    rows, cols = x2d.shape
    device = x2d.device
    experts = len(sizes)
    rht_columnwise = rht and columnwise

    def floats(count):
        return torch.empty(count, dtype=torch.float32, device=device)
    segment_plain, segment_columnwise = floats(experts), floats(experts)
    rows_out = floats(rows) if rowwise else None
    chunks_out = floats(rows // BLOCK_SIZE) if columnwise else None
    rowwise_data = rowwise_scale = columnwise_data = columnwise_scale = None
    if rowwise:
        rowwise_data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
        rowwise_scale = torch.empty(rows, cols // BLOCK_SIZE, dtype=SCALE_DTYPE, device=device)
    if columnwise:
        columnwise_data = torch.empty(cols, rows // 2, dtype=torch.uint8, device=device)
        columnwise_scale = torch.empty(cols, rows // BLOCK_SIZE, dtype=SCALE_DTYPE, device=device)
    seed_device = sr_seed if isinstance(sr_seed, torch.Tensor) else None
    seed = 0 if sr_seed is None or seed_device is not None else sr_seed
    with on_device(device):
        extension, stream = load_extension(), stream_handle(device)
        offsets_device = ints_on_device(offsets, torch.int64, device)
        if rht_columnwise:
            chunk_rht = floats(rows // BLOCK_SIZE)
            chunk_plain = floats(rows // BLOCK_SIZE) if rowwise else None
            extension.amax_rht_chunks(x2d, rht_random_sign, chunk_plain, chunk_rht, stream)
            if rowwise:
                extension.segment_amaxes(chunk_plain, chunk_rht, BLOCK_SIZE, offsets_device, segment_plain,
                                         segment_columnwise, rows_out, chunks_out, stream)
            else:  # the post-RHT amaxes only: both outputs get them
                extension.segment_amaxes(chunk_rht, None, BLOCK_SIZE, offsets_device, segment_plain,
                                         segment_columnwise, None, chunks_out, stream)
        else:
            row_amax = floats(rows)
            extension.amax_rows(x2d, row_amax, stream)
            extension.segment_amaxes(row_amax, None, 1, offsets_device, segment_plain, segment_columnwise, rows_out,
                                     chunks_out, stream)
        extension.quantize_segmented(
            x2d, rows_out, chunks_out, rowwise_data, None if rowwise_scale is None else rowwise_scale.view(torch.uint8),
            columnwise_data, None if columnwise_scale is None else columnwise_scale.view(torch.uint8),
            block_2d, rht, rht_random_sign, sr_seed is not None, seed - _MAX_SEED if seed >= 2 ** 63 else seed,
            seed_device, sr_row_offset, stream)
    column_data = column_scale = None
    if columnwise and contiguous_columnwise:
        size = sizes[0]
        column_data = columnwise_data.view(cols, experts, size // 2).transpose(0, 1).contiguous()
        column_scale = (columnwise_scale.view(torch.uint8).view(cols, experts, size // BLOCK_SIZE).transpose(0, 1)
                        .contiguous().view(SCALE_DTYPE))
    parts = []
    for e, size in enumerate(sizes):
        if size == 0:
            parts.append(None)
            continue
        first, end = offsets[e], offsets[e + 1]
        q = NVFP4Tensor(shape=torch.Size((size, cols)), dtype=x2d.dtype, block_2d=block_2d, rht=rht_columnwise,
                        rht_random_sign=rht_random_sign)
        if rowwise:
            q.rowwise_data, q.rowwise_scale = rowwise_data[first:end], rowwise_scale[first:end]
            q.amax_rowwise = segment_plain[e:e + 1]
        if columnwise and contiguous_columnwise:
            q.columnwise_data, q.columnwise_scale = column_data[e], column_scale[e]
            q.amax_columnwise = segment_columnwise[e:e + 1]
        elif columnwise:
            q.columnwise_data = columnwise_data[:, first // 2:end // 2]
            q.columnwise_scale = columnwise_scale[:, first // BLOCK_SIZE:end // BLOCK_SIZE]
            q.amax_columnwise = segment_columnwise[e:e + 1]
        parts.append(q)
    return parts

