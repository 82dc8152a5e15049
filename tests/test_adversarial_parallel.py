"""A faulty or inconsistent rank in a tensor-parallel group (2 real processes on gloo): every case ends with a
clear error on every rank, or the correct result. A rank left waiting in a collective would hang the run,
and a case where only one rank raised would desynchronise every case after it: run_distributed's timeout turns
either into a failure.

The cases run in a few process launches (CI has 2 cores), many cases per launch:
- NaN / Inf / a finite value whose RHT overflows, in the input, weight or output gradient of column- and
  row-parallel layers, with and without sequence parallelism and overlap, on either rank;
- ranks that disagree on input shapes, in/out features, sequence parallelism, recipes (rht,
  row_scaled_activation), input dtypes, or whose input one rank rejects;
- empty local shards; weights changed behind the cache; the amax all-reduce and the host check of the
  symmetric-memory transport.
"""
import os

import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear, all_reduce_amax, symmetric
from nvfp4_dist.parallel.group_checks import TensorParallelMismatchError
from tests.helpers.distributed import run_distributed

WORLD = 2
TIMEOUT_S = 400
NAN, INF = float("nan"), float("inf")
RECIPE = nv.NVFP4Recipe()


def expect(error, pattern, run):
    """run() must raise `error` with a message matching `pattern` (on this rank)."""
    with pytest.raises(error, match=pattern):
        run()


def tokens(seed, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def column(sequence_parallel, recipe=RECIPE, in_features=64, out_features=64, **options):
    torch.manual_seed(1)
    return ColumnParallelLinear(in_features, out_features, sequence_parallel=sequence_parallel, recipe=recipe,
                                **options)


def row(sequence_parallel, recipe=RECIPE, in_features=64, out_features=64, **options):
    torch.manual_seed(1)
    return RowParallelLinear(in_features, out_features, sequence_parallel=sequence_parallel, recipe=recipe,
                             input_is_parallel=True, **options)


def local_input(layer, rank, seed=3):
    """This rank's input of `layer`: column-parallel SP shards of 16 tokens, else 32 tokens (replicated, or K-split
    for row-parallel layers, whose SP output keeps 16 per rank)."""
    features = layer.in_features // (layer.world_size if isinstance(layer, RowParallelLinear) else 1)
    rows = 16 if layer.sequence_parallel and isinstance(layer, ColumnParallelLinear) else 32
    return tokens(seed + (rank if layer.sequence_parallel or isinstance(layer, RowParallelLinear) else 0),
                  rows, features)


def forward_backward(layer, x):
    y, _ = layer(x.requires_grad_())
    y.float().sum().backward()
    return y


def _non_finite_cases(rank, world_size):
    layers = {"column SP": lambda: column(True), "column": lambda: column(False),
              "row SP": lambda: row(True), "row": lambda: row(False),
              "column SP overlap": lambda: column(True, RECIPE.replace(overlap=True, overlap_min_chunk_gflops=0)),
              "row SP overlap": lambda: row(True, RECIPE.replace(overlap=True, overlap_min_chunk_gflops=0))}
    for kind, build in layers.items():
        class_name = "ColumnParallelLinear" if kind.startswith("column") else "RowParallelLinear"
        for bad_rank in range(world_size):
            for bad in (NAN, INF):
                # the input: sharded (SP, row-parallel) or replicated (column without SP: both ranks get it)
                layer = build()
                x = local_input(layer, rank)
                replicated = kind == "column"
                if rank == bad_rank or replicated:
                    x[1, 2] = bad
                where = "" if replicated or "SP" in kind and class_name == "ColumnParallelLinear" else (
                    "this tensor-parallel rank" if rank == bad_rank else "another tensor-parallel rank")
                expect(nv.NonFiniteAmaxError, f"the input of {class_name}.*: amax_rowwise is not finite .*{where}",
                       lambda: layer(x))
                # the weight shard of one rank
                layer = build()
                if rank == bad_rank:
                    with torch.no_grad():
                        layer.weight[0, 0] = bad
                where = "this tensor-parallel rank" if rank == bad_rank else "another tensor-parallel rank"
                expect(nv.NonFiniteAmaxError, f"the weight of {class_name}.* on {where}",
                       lambda: layer(local_input(layer, rank)))
            # the output gradient of one rank (row-parallel without SP: every rank holds it whole)
            layer = build()
            y, _ = layer(local_input(layer, rank).requires_grad_())
            dy = torch.ones_like(y)
            if rank == bad_rank or kind == "row":
                dy[0, 1] = NAN
            expect(nv.NonFiniteAmaxError, f"the gradient of {class_name}", lambda: y.backward(dy))
    # A finite input whose RHT overflows on one rank (row-parallel: the input is K-split).
    layer = row(False)
    x = local_input(layer, rank)
    if rank == 1:
        x.fill_(-3.38e38)
    message = ("the tensor is finite, but its random Hadamard transform" if rank == 1 else
               "another tensor-parallel rank .*random Hadamard transform")
    expect(nv.NonFiniteAmaxError, message, lambda: forward_backward(layer, x))
    # With check_finite=False nothing is checked: NaN flows through the reduction to every rank.
    layer = row(False, RECIPE.replace(check_finite=False))
    x = local_input(layer, rank)
    if rank == 1:
        x[0, 0] = NAN
    with torch.no_grad():
        y, _ = layer(x)
    assert bool(y[0].isnan().any())
    # The group is still in step: a clean layer gives the same output on both ranks (replicated column).
    layer = column(False, gather_output=True)
    y, _ = layer(local_input(layer, rank))
    gathered = [torch.empty_like(y) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, y)
    assert torch.equal(gathered[0], gathered[1]) and bool(torch.isfinite(y).all())


def test_non_finite_values_on_any_rank_stop_every_rank():
    run_distributed(_non_finite_cases, WORLD, timeout_s=TIMEOUT_S)


def _mismatch_cases(rank, world_size):
    mismatch = TensorParallelMismatchError
    # Local input shapes (SP shards of 16 and 8 tokens): would abort inside gloo's all-gather.
    layer = column(True)
    expect(mismatch, r"disagree on input shape \(rank 0: \(16, 64\), rank 1: \(8, 64\)\)",
           lambda: layer(tokens(0, 16 if rank == 0 else 8, 64)))
    # In / out features.
    layer = column(False, out_features=64 if rank == 0 else 96)
    expect(mismatch, r"out_features \(rank 0: 64, rank 1: 96\).*local weight shape \(rank 0: \(32, 64\), "
                     r"rank 1: \(48, 64\)\)", lambda: layer(tokens(0, 32, 64)))
    layer = row(False, in_features=64 if rank == 0 else 128)
    expect(mismatch, r"in_features \(rank 0: 64, rank 1: 128\)",
           lambda: layer(tokens(0, 32, layer.in_features // world_size)))
    # Sequence parallelism on one rank only.
    layer = row(rank == 0)
    expect(mismatch, r"sequence_parallel \(rank 0: 1, rank 1: 0\)", lambda: layer(tokens(0, 32, 32)))
    # Recipes: the RHT, and row-scaled activations (which used to hang).
    layer = column(True, RECIPE.replace(rht=rank == 0))
    expect(mismatch, r"recipe.rht \(rank 0: 1, rank 1: 0\)", lambda: forward_backward(layer, tokens(rank, 16, 64)))
    recipe = RECIPE.replace(rht=False, stochastic_rounding=False, row_scaled_activation=rank == 1)
    layer = column(True, recipe)
    expect(mismatch, r"recipe.row_scaled_activation \(rank 0: 0, rank 1: 1\)",
           lambda: forward_backward(layer, tokens(rank, 16, 64)))
    layer = column(True, RECIPE.replace(gemm_backend="reference" if rank else "auto"))
    expect(mismatch, r"recipe.gemm_backend \(rank 0: .*, rank 1: .*\)", lambda: layer(tokens(rank, 16, 64)))
    # Input dtypes, and autocast disabled on one rank.
    layer = column(True)
    expect(mismatch, r"input dtype \(rank 0: torch.bfloat16, rank 1: torch.float32\)",
           lambda: layer(tokens(rank, 16, 64, dtype=torch.bfloat16 if rank == 0 else torch.float32)))
    layer = column(True)
    with nv.autocast(enabled=rank == 0):
        expect(mismatch, r"NVFP4 .* \(rank 0: 1, rank 1: 0\)", lambda: layer(tokens(rank, 16, 64)))
    # One rank's input is invalid: that rank names its problem, the other stops too.
    layer = column(True)
    if rank == 0:
        expect(ValueError, r"input.shape=\(16, 48\): the last dim must be in_features=64 \(tensor-parallel rank 0",
               lambda: layer(tokens(0, 16, 48)))
    else:
        expect(mismatch, r"tensor-parallel rank\(s\) \[0\] rejected their input", lambda: layer(tokens(1, 16, 64)))
    # After a first call, later calls are compared only with NVFP4_CHECK_TP_CONSISTENCY=1.
    layer = column(True)
    layer(tokens(rank, 16, 64))
    assert layer.consistency_checked
    os.environ["NVFP4_CHECK_TP_CONSISTENCY"] = "1"
    try:
        expect(mismatch, r"input shape \(rank 0: \(32, 64\), rank 1: \(16, 64\)\)",
               lambda: layer(tokens(rank, 32 if rank == 0 else 16, 64)))
    finally:
        del os.environ["NVFP4_CHECK_TP_CONSISTENCY"]
    # The group is still in step.
    y, _ = column(True)(tokens(rank, 16, 64))
    assert y.shape == (32, 32)


def test_ranks_that_disagree_raise_on_every_rank():
    run_distributed(_mismatch_cases, WORLD, timeout_s=TIMEOUT_S)


def _empty_and_stale_cases(rank, world_size):
    # Empty local shards (MoE routing gives experts no tokens): empty outputs, zero weight gradients.
    for layer in (column(True), column(False), row(True), row(False), column(False, gather_output=True),
                  RowParallelLinear(64, 64, input_is_parallel=False)):
        features = layer.in_features // world_size if isinstance(layer, RowParallelLinear) and \
            layer.input_is_parallel else layer.in_features
        x = torch.empty(0, 4, features, requires_grad=True)
        y, _ = layer(x)
        y.sum().backward()
        assert y.shape[0] == 0 and x.grad.shape == x.shape
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() == 0
    # Weights changed behind the cache are seen by the parallel layers too.
    for build in (lambda: column(True, bias=False), lambda: row(True, bias=False)):
        layer = build()
        x = local_input(layer, rank)
        first, _ = layer(x)
        layer.weight.data.mul_(0)
        zeroed, _ = layer(x)
        assert bool((first != 0).any()) and bool((zeroed == 0).all())
        layer.weight.grad = torch.ones_like(layer.weight)
        torch.optim.AdamW([layer.weight], lr=1.0, fused=True).step()
        stepped, _ = layer(x)
        assert bool((stepped != 0).any())
        assert layer.weight_cache.quantizations == 3
        layer(x)
        assert layer.weight_cache.quantizations == 3  # unchanged: reused
    # Non-contiguous inputs give the contiguous result.
    for layer in (column(True), row(False)):
        x = local_input(layer, rank)
        strided = x.t().contiguous().t()
        assert not strided.is_contiguous() and torch.equal(layer(strided)[0], layer(x)[0])
    # Sizes that are not multiples of 16 per rank, and token counts that cannot train: the same error on each rank.
    expect(ValueError, r"out_features per rank=24", lambda: ColumnParallelLinear(64, 48))
    expect(ValueError, r"in_features per rank=8", lambda: RowParallelLinear(16, 64))
    expect(ValueError, r"out_features=65: must be divisible by the tensor-parallel size 2",
           lambda: ColumnParallelLinear(64, 64 + 1))
    layer = column(True)
    expect(ValueError, r"training needs the token count", lambda: layer(tokens(rank, 8, 64).requires_grad_()))
    # The amax all-reduce carries a NaN of either rank to both (gloo's MAX alone would drop it).
    for bad_rank in range(world_size):
        amaxes = [torch.tensor([1.0 + rank]), torch.tensor([NAN if rank == bad_rank else 2.0])]
        all_reduce_amax(amaxes)
        assert amaxes[0].item() == 2.0 and amaxes[1].item() == INF
    # The symmetric-memory transport's host check exchanges fixed-size records, not pickles.
    assert symmetric._same_host(torch.distributed.group.WORLD)


def test_empty_shards_stale_weights_and_amax_transport():
    run_distributed(_empty_and_stale_cases, WORLD, timeout_s=TIMEOUT_S)
