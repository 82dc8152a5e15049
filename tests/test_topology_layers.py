"""Column- and row-parallel layers in a 4-rank job as TP=2 x DP=2: tensor-parallel groups that are not the world.

Each data-parallel replica (TP group) runs its own data, scaled differently, and every rank is held to the
independent oracle of its own group alone (tests/test_layer_oracle.py's expectations at TP=2): every GEMM operand
must be the oracle's bytes of the group's tensors (so the amaxes shared before quantizing and the gathered copies
are the group's, not the world's), and outputs and all gradients within the oracle's bounds. Both layouts of
tests/helpers/topology.py; sequence parallelism on and off, the pipelined ring (point-to-point between global
ranks), row-scaled activations (their per-column amaxes reduced as a vector). Then the checks that exchange
across the group: a NaN in one replica stops that replica only, and ranks of one replica that disagree raise
there only.
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from nvfp4_dist.parallel.group_checks import TensorParallelMismatchError
from tests.helpers.distributed import run_distributed
from tests.helpers.topology import TP, WORLD, tensor_parallel_groups
from tests.test_layer_oracle import (FFN, HIDDEN, RECIPES, ROW_OUT, as_dtype, backward_seed, check_run, flat,
                                     linear_expectations, make_data, reduce_over_ranks, rounded, rows_of, run_layer,
                                     token_sum)

TIMEOUT_S = 600
CONFIGURATIONS = [  # (kind, recipe, sequence_parallel, overlap)
    ("column", "default", True, False), ("column", "default", True, True), ("column", "default", False, False),
    ("column", "row_scaled_rht_sr", True, False),
    ("row", "default", True, False), ("row", "default", True, True), ("row", "default", False, False),
    ("row", "no_rht_no_sr_1d", True, False),
]


def replica_data(in_features, out_features, seed, replica):
    """This replica's x, dy, weight and bias: other values, and a larger range, in each replica."""
    x, dy, weight, bias = make_data(in_features, out_features, seed=seed + 10 * replica)
    return (x * 3 ** replica).to(x.dtype), (dy * 2.5 ** replica).to(dy.dtype), weight, bias


def build_layer(kind, place, weight, sequence_parallel, recipe):
    """nvfp4_dist's own layer of `kind` on this rank's TP group, its full weight `weight`."""
    cls, sizes = (ColumnParallelLinear, (HIDDEN, FFN)) if kind == "column" else (RowParallelLinear, (FFN, ROW_OUT))
    return cls(*sizes, sequence_parallel=sequence_parallel, recipe=recipe, tp_group=place.group,
               init_method=lambda full: full.copy_(weight))


def column_case(place, recipe, sequence_parallel, build=build_layer):
    """The column-parallel layer's run on this rank, and the oracle's expectations for its TP group's data alone.
    build(kind, place, full weight, sequence_parallel, recipe) makes the layer."""
    x, dy, weight, bias = replica_data(HIDDEN, FFN, 5, place.replica)
    layer = build("column", place, weight, sequence_parallel, recipe)
    with torch.no_grad():
        layer.bias.copy_(bias.chunk(TP)[place.rank])
    x_in = x.chunk(TP)[place.rank] if sequence_parallel else x
    got, calls = run_layer(layer, x_in, dy.chunk(TP, dim=-1)[place.rank])

    seed = backward_seed()
    per_rank = [linear_expectations(flat(x), flat(dy_k), w_k, b_k, recipe, seed)
                for dy_k, w_k, b_k in zip(dy.chunk(TP, dim=-1), weight.chunk(TP), bias.chunk(TP))]
    copies, want = per_rank[place.rank]
    dx = reduce_over_ranks([w["dx"] for _, w in per_rank])
    want["dx"] = rows_of(dx, TP, place.rank) if sequence_parallel else dx
    return got, calls, copies, want


def row_case(place, recipe, sequence_parallel, build=build_layer):
    x, dy, weight, bias = replica_data(FFN, ROW_OUT, 7, place.replica)
    layer = build("row", place, weight, sequence_parallel, recipe)
    with torch.no_grad():
        layer.bias.copy_(bias)
    dy_in = dy.chunk(TP)[place.rank] if sequence_parallel else dy
    got, calls = run_layer(layer, x.chunk(TP, dim=-1)[place.rank], dy_in)

    seed = backward_seed()
    per_rank = [linear_expectations(flat(x_k), flat(dy), w_k, None, recipe, seed)
                for x_k, w_k in zip(x.chunk(TP, dim=-1), weight.chunk(TP, dim=-1))]
    copies, want = per_rank[place.rank]
    y = reduce_over_ranks([w["y"] for _, w in per_rank])
    y = rows_of(y, TP, place.rank) if sequence_parallel else y
    bias64 = bias.double().numpy().reshape(1, -1)
    bias_bf16 = as_dtype(bias64, torch.bfloat16)
    want["y"] = rounded((y[0] + bias64, y[1] + abs(bias_bf16 - bias64)), torch.bfloat16)
    want["db"] = token_sum(flat(dy_in), torch.float32)
    return got, calls, copies, want


def check_configurations(rank, place, configurations, build=build_layer, label=""):
    """Every (kind, recipe, sequence_parallel, overlap) of `configurations` against the oracle of place's group."""
    for kind, recipe_name, sequence_parallel, overlap in configurations:
        recipe = RECIPES[recipe_name].replace(overlap=overlap, overlap_min_chunk_gflops=0,
                                              overlap_measure_links=False)
        case = column_case if kind == "column" else row_case
        got, calls, copies, want = case(place, recipe, sequence_parallel, build)
        what = (f"{kind} {label} TP group {place.ranks} replica {place.replica} sp={sequence_parallel} "
                f"overlap={overlap} {recipe_name} rank={rank}")
        check_run(got, calls, copies, want, what, {"fprop": 1, "dgrad": 1, "wgrad": 1})


def _check_against_group_oracle(rank, world_size, layout):
    check_configurations(rank, tensor_parallel_groups(layout), CONFIGURATIONS, label=layout)


@pytest.mark.parametrize("layout", ["consecutive", "strided"])
def test_layers_match_the_oracle_of_their_own_group(layout):
    run_distributed(_check_against_group_oracle, WORLD, layout, timeout_s=TIMEOUT_S)


def _check_group_scoped_agreement(rank, world_size, layout):
    place = tensor_parallel_groups(layout)
    # A NaN in replica 1's input: its ranks raise, replica 0 runs on (its layers exchange nothing with replica 1).
    for build, features in ((lambda: RowParallelLinear(FFN, ROW_OUT, tp_group=place.group), FFN // TP),
                            (lambda: ColumnParallelLinear(HIDDEN, FFN, tp_group=place.group, sequence_parallel=True),
                             HIDDEN)):
        torch.manual_seed(1)
        layer = build()
        x = torch.randn(32, features, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        if place.replica == 1 and place.rank == 0:
            x[3, 5] = float("nan")
        if place.replica == 1:
            with pytest.raises(nv.NonFiniteAmaxError):
                layer(x)
        else:
            y, _ = layer(x)
            assert bool(torch.isfinite(y).all())
    # The ranks of replica 1 disagree on their input's shape: they raise, replica 0 runs on.
    torch.manual_seed(1)
    layer = ColumnParallelLinear(HIDDEN, FFN, tp_group=place.group, sequence_parallel=True)
    tokens = 16 if place.replica == 0 or place.rank == 0 else 32
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    if place.replica == 1:
        with pytest.raises(TensorParallelMismatchError, match=r"input shape \(rank 0: \(16, 64\), rank 1: \(32, 64\)"):
            layer(x)
    else:
        assert layer(x)[0].shape == (32, FFN // TP)


@pytest.mark.parametrize("layout", ["consecutive", "strided"])
def test_group_checks_stay_within_the_group(layout):
    run_distributed(_check_group_scoped_agreement, WORLD, layout, timeout_s=TIMEOUT_S)
