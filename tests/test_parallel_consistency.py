"""Every field of the tensor-parallel consistency record (parallel/group_checks.py layer_fields), one case each: two
gloo ranks whose layer or call differ in that field alone raise TensorParallelMismatchError naming it, on both ranks,
at the layer's first call (and at a later call with NVFP4_CHECK_TP_CONSISTENCY=1); never a hang (run_distributed's
timeout) or one rank raising alone (the next case would then desynchronise).
"""
import contextlib
import os

import pytest
import torch

from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from nvfp4_dist.parallel.group_checks import TensorParallelMismatchError
from tests.helpers.distributed import run_distributed

WORLD = 2
TIMEOUT_S = 180
FEATURES = 64


def tokens(rank, rows, features, dtype=torch.bfloat16, requires_grad=True):
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(rank)).to(dtype)
    return x.requires_grad_(requires_grad)


def column(**options):
    torch.manual_seed(1)
    options.setdefault("sequence_parallel", True)
    return ColumnParallelLinear(FEATURES, FEATURES, **options)


def row(**options):
    torch.manual_seed(1)
    return RowParallelLinear(FEATURES, FEATURES, **options)


def column_input(rank, **options):
    return tokens(rank, 16, FEATURES, **options)


def row_input(rank, **options):
    return tokens(rank, 32, FEATURES // WORLD, **options)


def forward_backward(layer, x, grad_mode=contextlib.nullcontext):
    with grad_mode():
        y, _ = layer(x)
    if y.requires_grad:
        y.float().sum().backward()


def with_bias_dtype(layer, dtype):
    layer.bias = torch.nn.Parameter(layer.bias.detach().to(dtype))
    return layer


def cases(rank):
    """(field, pattern of the error, run): rank 1 differs from rank 0 in that field only."""
    odd = rank == 1
    yield ("grad mode", r"grad enabled \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(column(), column_input(rank), torch.no_grad if odd else contextlib.nullcontext))
    yield ("weight.requires_grad", r"weight.requires_grad \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(column().requires_grad_(not odd), column_input(rank)))
    yield ("input.requires_grad", r"input.requires_grad \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(column(), column_input(rank, requires_grad=not odd)))
    yield ("bias presence", r"bias \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(row(bias=not odd), row_input(rank)))
    yield ("bias.requires_grad", r"bias.requires_grad \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(row_with_frozen_bias(odd), row_input(rank)))
    yield ("bias dtype", r"bias dtype \(rank 0: torch.float32, rank 1: torch.bfloat16\)",
           lambda: forward_backward(with_bias_dtype(row(), torch.bfloat16 if odd else torch.float32),
                                    row_input(rank)))
    yield ("weight dtype", r"weight dtype \(rank 0: torch.float32, rank 1: torch.bfloat16\)",
           lambda: forward_backward(column(params_dtype=torch.bfloat16 if odd else torch.float32),
                                    column_input(rank)))
    yield ("input dtype", r"input dtype \(rank 0: torch.bfloat16, rank 1: torch.float32\)",
           lambda: forward_backward(column(), column_input(rank, dtype=torch.float32 if odd else torch.bfloat16)))
    yield ("sequence_parallel", r"sequence_parallel \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(row(sequence_parallel=not odd), row_input(rank)))
    yield ("input_is_parallel", r"input_is_parallel \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(row(input_is_parallel=not odd),
                                    tokens(rank, 32, FEATURES if odd else FEATURES // WORLD)))
    yield ("gather_output", r"gather_output \(rank 0: 0, rank 1: 1\)",
           lambda: forward_backward(column(sequence_parallel=False, gather_output=odd), tokens(0, 32, FEATURES)))
    yield ("keep_input_columnwise", r"keep_input_columnwise \(rank 0: 0, rank 1: 1\)",
           lambda: forward_backward(column(keep_input_columnwise=odd), column_input(rank)))
    yield ("skip_bias_add", r"skip_bias_add \(rank 0: 0, rank 1: 1\)",
           lambda: forward_backward(row(skip_bias_add=odd), row_input(rank)))
    yield ("accumulate_into_main_grad", r"accumulate_into_main_grad \(rank 0: 0, rank 1: 1\)",
           lambda: forward_backward(column(accumulate_into_main_grad=odd), column_input(rank)))
    yield ("delay_wgrad", r"delay_wgrad \(rank 0: 0, rank 1: 1\)",
           lambda: forward_backward(column(delay_wgrad=odd), column_input(rank)))
    yield ("input_norm", r"input_norm \(rank 0: 'LayerNorm', rank 1: a different value\)|"
                         r"input_norm \(rank 0: a different value, rank 1: 'RMSNorm'\)",
           lambda: forward_backward(column(input_norm="RMSNorm" if odd else "LayerNorm"), column_input(rank)))
    yield ("norm_eps", r"norm_eps \(rank 0: ",
           lambda: forward_backward(column(input_norm="RMSNorm", norm_eps=1e-6 if odd else 1e-5), column_input(rank)))
    yield ("zero_centered_gamma", r"zero_centered_gamma \(rank 0: 0, rank 1: 1\)",
           lambda: forward_backward(column(input_norm="RMSNorm", zero_centered_gamma=odd), column_input(rank)))
    yield ("layer_norm_weight.requires_grad", r"layer_norm_weight.requires_grad \(rank 0: 1, rank 1: 0\)",
           lambda: forward_backward(norm_frozen(column(input_norm="RMSNorm"), odd), column_input(rank)))


def row_with_frozen_bias(frozen):
    layer = row()
    layer.bias.requires_grad_(not frozen)
    return layer


def norm_frozen(layer, frozen):
    layer.layer_norm_weight.requires_grad_(not frozen)
    return layer


def _every_field(rank, world_size):
    for field, pattern, run in cases(rank):
        try:
            with pytest.raises(TensorParallelMismatchError, match=pattern):
                run()
        except BaseException as error:
            raise AssertionError(f"field {field!r} on rank {rank}: {error}") from error
    # A later call is compared only with NVFP4_CHECK_TP_CONSISTENCY=1: then grad mode too.
    layer = column()
    forward_backward(layer, column_input(rank))
    os.environ["NVFP4_CHECK_TP_CONSISTENCY"] = "1"
    try:
        with pytest.raises(TensorParallelMismatchError, match=r"grad enabled \(rank 0: 1, rank 1: 0\)"):
            forward_backward(layer, column_input(rank), torch.no_grad if rank == 1 else contextlib.nullcontext)
    finally:
        del os.environ["NVFP4_CHECK_TP_CONSISTENCY"]
    # The group is still in step.
    y, _ = column()(column_input(rank))
    assert y.shape == (32, FEATURES // WORLD)


def test_each_field_that_differs_raises_on_every_rank():
    run_distributed(_every_field, WORLD, timeout_s=TIMEOUT_S)
