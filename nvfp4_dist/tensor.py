"""NVFP4Tensor: packed FP4 codes, E4M3 block scales and FP32 amax of one tensor (docs/numerics.md §1-3)."""
from __future__ import annotations

import copy
import dataclasses

import torch

from nvfp4_dist.formats import E4M3_BOUND

_TENSOR_FIELDS = ("rowwise_data", "rowwise_scale", "amax_rowwise",
                  "columnwise_data", "columnwise_scale", "amax_columnwise")


@dataclasses.dataclass
class NVFP4Tensor:
    """A tensor quantized to NVFP4, keeping a rowwise and/or a columnwise copy.

    For the 2D view x [M, K] of a tensor of shape `shape`:
      rowwise_data    uint8 [M, K/2]   rowwise_scale    float8_e4m3fn [M, K/16]
      columnwise_data uint8 [K, M/2]   columnwise_scale float8_e4m3fn [K, M/16]  (of x^T)
      amax_rowwise    float32 (1,), or (M,) when row_scaled
      amax_columnwise float32 (1,), or (K,) when row_scaled (one per row of x^T, docs/numerics.md §6b)
    rht: the columnwise copy holds x^T . H (docs/numerics.md §5), so dequantizing it undoes H.
    e4m3_bound: B of the global scale S_enc = 6 * B / amax: 448, or 256 for some 4over6 tensors
      (docs/numerics.md §12); dequantization and GEMMs use S_dec = amax / (6 * B).
    """

    shape: torch.Size
    dtype: torch.dtype
    rowwise_data: torch.Tensor | None = None
    rowwise_scale: torch.Tensor | None = None
    amax_rowwise: torch.Tensor | None = None
    columnwise_data: torch.Tensor | None = None
    columnwise_scale: torch.Tensor | None = None
    amax_columnwise: torch.Tensor | None = None
    block_2d: bool = False
    rht: bool = False
    rht_random_sign: bool = True
    row_scaled: bool = False
    e4m3_bound: int = E4M3_BOUND

    @property
    def rows(self) -> int:
        """M: the product of all but the last dimension."""
        return self.shape.numel() // self.shape[-1] if len(self.shape) else 1

    @property
    def cols(self) -> int:
        """K: the last dimension."""
        return self.shape[-1]

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    def device_tensor(self) -> torch.Tensor:
        """One of the storage tensors (they share a device)."""
        return next(t for t in self.tensors() if t is not None)

    @property
    def device(self) -> torch.device:
        return self.device_tensor().device

    def tensors(self) -> tuple:
        """The six storage tensors (None where a copy is absent), for autograd's save_for_backward."""
        return tuple(getattr(self, name) for name in _TENSOR_FIELDS)

    def replace(self, **changes) -> NVFP4Tensor:
        """A copy with `changes` to its fields (dataclasses.replace without re-running __init__: the layers make
        several per call, so it stays cheap)."""
        unknown = changes.keys() - _FIELD_NAMES
        if unknown:
            raise TypeError(f"NVFP4Tensor has no field(s) {sorted(unknown)}")
        copied = object.__new__(NVFP4Tensor)
        copied.__dict__.update(self.__dict__)
        copied.__dict__.update(changes)
        return copied

    def with_tensors(self, tensors) -> NVFP4Tensor:
        """The same metadata around other storage tensors (the inverse of tensors())."""
        return self.replace(**dict(zip(_TENSOR_FIELDS, tensors)))

    def metadata(self) -> NVFP4Tensor:
        """A copy that holds no storage, to keep beside save_for_backward."""
        return self.with_tensors((None,) * len(_TENSOR_FIELDS))

    def nbytes(self) -> int:
        """Bytes held by the data, scales and amax of both copies."""
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def to(self, device) -> NVFP4Tensor:
        return self.with_tensors(tuple(None if t is None else t.to(device) for t in self.tensors()))

    def rowwise_only(self) -> NVFP4Tensor:
        return self.replace(columnwise_data=None, columnwise_scale=None, amax_columnwise=None)

    def columnwise_only(self) -> NVFP4Tensor:
        return self.replace(rowwise_data=None, rowwise_scale=None, amax_rowwise=None)

    def rowwise_rows(self, start: int, stop: int) -> NVFP4Tensor:
        """Rows [start, stop) of the 2D view, rowwise copy only (a chunk for pipelined GEMMs)."""
        amax = self.amax_rowwise[start:stop] if self.row_scaled else self.amax_rowwise
        return self.replace(shape=torch.Size((stop - start, self.cols)), rowwise_data=self.rowwise_data[start:stop],
                            rowwise_scale=self.rowwise_scale[start:stop], amax_rowwise=amax,
                            columnwise_data=None, columnwise_scale=None, amax_columnwise=None)

    def rowwise_row_ranges(self, ranges) -> NVFP4Tensor:
        """Rows [start, stop) of each (start, stop) in `ranges`, stacked in order, rowwise copy only: one GEMM
        operand for row blocks that lie apart (a copy, unless there is one range)."""
        chunks = [self.rowwise_rows(start, stop) for start, stop in ranges]
        if len(chunks) == 1:
            return chunks[0]
        data = torch.cat([chunk.rowwise_data for chunk in chunks])
        scale = torch.cat([chunk.rowwise_scale.view(torch.uint8) for chunk in chunks]).view(self.rowwise_scale.dtype)
        amax = torch.cat([chunk.amax_rowwise for chunk in chunks]) if self.row_scaled else self.amax_rowwise
        return chunks[0].replace(shape=torch.Size((data.shape[0], self.cols)), rowwise_data=data,
                                 rowwise_scale=scale, amax_rowwise=amax)

    def __repr__(self) -> str:
        copies = [name for name, present in (("rowwise", self.has_rowwise), ("columnwise", self.has_columnwise)) if present]
        flags = [name for name in ("block_2d", "rht", "row_scaled") if getattr(self, name)]
        if self.e4m3_bound != E4M3_BOUND:
            flags.append(f"e4m3_bound={self.e4m3_bound}")
        return (f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, copies={copies}, "
                f"flags={flags}, nbytes={self.nbytes()})")


_FIELD_NAMES = frozenset(field.name for field in dataclasses.fields(NVFP4Tensor))
