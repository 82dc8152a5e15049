"""Layers against the oracle: what each GEMM of a layer consumed and produced, and the float64 expectations of a
layer's outputs and gradients with elementwise bounds derived from the formats.

record_gemms() wraps nvfp4_dist.gemm wherever the package calls it and keeps, per call, the bytes of both operand
copies and the result. check_gemms() then holds every call to the oracle: its result against the float64 product
of its own operands' bytes, its operands against the oracle's quantization of the layer's tensors (found as whole
copies or as row blocks of them: the chunks of a pipelined ring), and the pair of copies against the three GEMMs a
linear layer may run (fprop x.W, dgrad dy.W, wgrad dy.x, docs/numerics.md §3).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys

import numpy as np
import torch

import nvfp4_dist
from tests.helpers import oracle as O

# The GEMMs of a linear layer: (A operand, B operand) by copy name.
LINEAR_GEMMS = {("x_row", "w_row"): "fprop", ("dy_row", "w_col"): "dgrad", ("dy_col", "x_col"): "wgrad"}


@dataclasses.dataclass
class GemmCall:
    a: O.Copy | None  # None when recorded without operands
    b: O.Copy | None
    out: torch.Tensor
    out_dtype: torch.dtype
    bias: torch.Tensor | None
    accumulated_onto: torch.Tensor | None  # accumulate_into's values before the call


@contextlib.contextmanager
def record_gemms(with_operands: bool = True):
    """Record every nvfp4_dist.gemm call made inside the block (the package's modules that imported it included);
    with_operands=False keeps only the results (no copy of the operands to the host)."""
    original = nvfp4_dist.gemm
    calls: list[GemmCall] = []

    def recording(a, b, *, a_copy="rowwise", b_copy="rowwise", out_dtype=torch.bfloat16, bias=None,
                  accumulate_into=None, **kwargs):
        before = None if accumulate_into is None else accumulate_into.detach().clone()
        result = original(a, b, a_copy=a_copy, b_copy=b_copy, out_dtype=out_dtype, bias=bias,
                          accumulate_into=accumulate_into, **kwargs)
        operands = (O.copy_of(a, a_copy), O.copy_of(b, b_copy)) if with_operands else (None, None)
        calls.append(GemmCall(*operands, result.detach().clone(),
                              torch.float32 if accumulate_into is not None else out_dtype,
                              None if bias is None else bias.detach().clone(), before))
        return result

    patched = [(module, name) for module in list(sys.modules.values())
               if getattr(module, "__name__", "").startswith("nvfp4_dist")
               for name, value in list(vars(module).items()) if value is original]
    for module, name in patched:
        setattr(module, name, recording)
    try:
        yield calls
    finally:
        for module, name in patched:
            setattr(module, name, original)


def locate(copy: O.Copy, expected: dict) -> tuple | None:
    """(name, first row) of the expected copy whose rows [first, first + R) hold `copy`'s bytes, or None."""
    rows = copy.data.shape[0]
    for name, candidate in expected.items():
        if candidate is None or candidate.data.shape[1] != copy.data.shape[1] or candidate.data.shape[0] < rows:
            continue
        for first in range(candidate.data.shape[0] - rows + 1):
            last = first + rows
            amax = candidate.amax if candidate.amax.size == 1 else candidate.amax[first:last]
            if (np.array_equal(candidate.data[first:last], copy.data)
                    and np.array_equal(candidate.scale[first:last], copy.scale)
                    and np.array_equal(amax, copy.amax)):
                return name, first
    return None


def check_gemms(calls: list, expected: dict, what: str) -> dict:
    """Hold each recorded GEMM to the oracle; returns the number of calls per GEMM kind."""
    counts = dict.fromkeys(LINEAR_GEMMS.values(), 0)
    for index, call in enumerate(calls):
        label = f"{what}: GEMM {index}"
        found = [locate(call.a, expected), locate(call.b, expected)]
        for operand, where in zip("ab", found):
            if where is None:
                raise AssertionError(f"{label}: operand {operand} is none of the oracle's copies {sorted(expected)} "
                                     f"(nor rows of one): wrong bytes")
        kind = LINEAR_GEMMS.get((found[0][0], found[1][0]))
        if kind is None:
            raise AssertionError(f"{label}: multiplies {found[0][0]} by {found[1][0]}; a linear layer's GEMMs are "
                                 f"{sorted(LINEAR_GEMMS)}")
        counts[kind] += 1
        product = O.product(call.a, call.b)
        value, bound = product.value, product.bound(call.out_dtype, call.bias)
        if call.bias is not None:
            value = value + O.as_float32(call.bias).reshape(1, -1)
        if call.accumulated_onto is not None:
            value = value + O.as_float32(call.accumulated_onto)
            bound = bound + O.FP32_UNIT_ROUNDOFF * (np.abs(value) + bound)
        O.check_within(f"{label} ({kind})", call.out, value, bound)
    return counts


# ------------------------------------------------------------------------------------------------------
# Expected values: (float64 value, elementwise bound) pairs.

def rounded(value_bound: tuple, dtype: torch.dtype) -> tuple:
    """A (value, bound) result rounded once more to dtype."""
    value, bound = value_bound
    unit = {torch.bfloat16: O.BF16_UNIT_ROUNDOFF, torch.float16: 2.0 ** -11, torch.float32: O.FP32_UNIT_ROUNDOFF}[dtype]
    return value, bound + unit * (np.abs(value) + bound)


def token_sum(dy2d: torch.Tensor, out_dtype: torch.dtype) -> tuple:
    """A bias gradient: dy summed over tokens in FP32 (any order), the sum rounded to dy's dtype, then cast to
    out_dtype."""
    values = O.as_float32(dy2d).astype(np.float64)
    result = values.sum(axis=0), values.shape[0] * O.FP32_UNIT_ROUNDOFF * np.abs(values).sum(axis=0)
    if dy2d.dtype != torch.float32:
        result = rounded(result, dy2d.dtype)
    if out_dtype not in (torch.float32, dy2d.dtype):
        result = rounded(result, out_dtype)
    return result


def as_dtype(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float64 values rounded to FP32, then to dtype, back as float64."""
    return torch.from_numpy(values.astype(np.float32)).to(dtype).double().numpy()


def check_result(name: str, got: torch.Tensor, expected: tuple) -> None:
    value, bound = expected
    O.check_within(name, got, value.reshape(-1, value.shape[-1]), bound.reshape(-1, value.shape[-1]))
