"""nvfp4_dist.Linear and the parallel layers against the independent oracle (tests/helpers/oracle.py).

Per run: every GEMM the layer ran is recorded; its operands must be the oracle's bytes of the layer's tensors
(exact), its result the float64 product of those bytes within what FP32 accumulation and the output rounding may
add (tests/helpers/layer_oracle.py). The layer's output and ALL its gradients (input, weight, bias) must be the
oracle's float64 values within elementwise bounds derived from the formats: the GEMM bound of each product, one
BF16 rounding per term of a cross-rank sum (all-reduce, reduce-scatter, ring), the FP32 token sum of a bias
gradient. Plain layer: recipes and dtypes. Parallel layers: TP 1, 2 and 4 on real gloo processes, sequence
parallelism on and off, overlap on and off (ring pipelined at every size and whatever the links:
overlap_min_chunk_gflops=0, overlap_measure_links=False).
"""
import numpy as np
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from tests.helpers import oracle as O
from tests.helpers.distributed import run_distributed
from tests.helpers.emulation import draw_seed_like_backward, four_over_six
from tests.helpers.layer_oracle import as_dtype, check_gemms, check_result, record_gemms, rounded, token_sum

SEQ, BATCH = 32, 2            # 64 tokens: SP shards of 16 tokens at TP=4
HIDDEN, FFN = 64, 64          # column: HIDDEN -> FFN; row: FFN -> ROW_OUT
ROW_OUT = 48
BACKWARD_SEED = 17
RECIPES = {
    "default": nv.NVFP4Recipe(),
    "no_rht_no_sr_1d": nv.NVFP4Recipe(rht=False, stochastic_rounding=False, weight_2d=False),
    "plain_hadamard": nv.NVFP4Recipe(rht_random_sign=False),
    "row_scaled": nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False),
    "row_scaled_rht_sr": nv.NVFP4Recipe(row_scaled_activation=True),
    "4over6_weights": nv.NVFP4Recipe(nvfp4_4over6="weights"),
    "4over6_all_mse_448": nv.NVFP4Recipe(rht=False, nvfp4_4over6="all", nvfp4_4over6_err_mode="MSE",
                                         nvfp4_4over6_e4m3_use_256="none"),
}


def make_data(in_features, out_features, seed, act_dtype=torch.bfloat16):
    """x [SEQ, BATCH, in] with features over two decades, dy, a full FP32 weight and bias."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(SEQ, BATCH, in_features, generator=generator)
         * torch.logspace(-1, 1, in_features)).to(act_dtype)
    dy = torch.randn(SEQ, BATCH, out_features, generator=generator).to(act_dtype)
    weight = torch.randn(out_features, in_features, generator=generator) * in_features ** -0.5
    bias = torch.randn(out_features, generator=generator) * 0.1
    return x, dy, weight, bias


def flat(t):
    return t.reshape(-1, t.shape[-1])


# ------------------------------------------------------------------------------------------------------
# The oracle's copies and expectations.

def activation_copies(x2d, recipe):
    """{'x_row', 'x_col'}: rowwise from x as given; columnwise from x's BF16 cast when the RHT applies (the RHT takes
    BF16); per row of each copy when row-scaled (docs/numerics.md §6, 6b); 4over6 as the recipe says."""
    options = dict(row_scaled=recipe.row_scaled_activation, four_over_six=four_over_six(recipe, is_weight=False))
    row = O.quantize(x2d, columnwise=False, **options).rowwise
    source = x2d.to(torch.bfloat16) if recipe.rht else x2d
    col = O.quantize(source, rowwise=False, rht=recipe.rht, random_sign=recipe.rht_random_sign, **options).columnwise
    return {"x_row": row, "x_col": col}


def weight_copies(weight, recipe):
    q = O.quantize(weight, block_2d=recipe.weight_2d, four_over_six=four_over_six(recipe, is_weight=True))
    return {"w_row": q.rowwise, "w_col": q.columnwise}


def gradient_copies(dy2d, recipe, seed):
    """{'dy_row', 'dy_col'} with SR (seed, global rows from 0) and the RHT as the recipe says."""
    sr_seed = seed if recipe.stochastic_rounding else None
    row = O.quantize(dy2d, columnwise=False, sr_seed=sr_seed).rowwise
    source = dy2d.to(torch.bfloat16) if recipe.rht else dy2d
    col = O.quantize(source, rowwise=False, rht=recipe.rht, random_sign=recipe.rht_random_sign,
                     sr_seed=sr_seed).columnwise
    return {"dy_row": row, "dy_col": col}


def nvfp4_result(product: O.Product, dtype, bias=None):
    value = product.value + (0 if bias is None else O.as_float32(bias).astype(np.float64).reshape(1, -1))
    return value, product.bound(dtype, bias)


def linear_expectations(x2d, dy2d, weight, bias, recipe, seed):
    """Copies, and (value, bound) of y, the dgrad partial, dW, db of one linear y = x W^T + b on one device."""
    copies = {**activation_copies(x2d, recipe), **weight_copies(weight, recipe), **gradient_copies(dy2d, recipe, seed)}
    act, weight_dtype = x2d.dtype, weight.dtype
    want = {"y": nvfp4_result(O.product(copies["x_row"], copies["w_row"]), act, bias),
            "dx": nvfp4_result(O.product(copies["dy_row"], copies["w_col"]), act),
            "dW": nvfp4_result(O.product(copies["dy_col"], copies["x_col"]), weight_dtype)}
    if bias is not None:
        want["db"] = token_sum(dy2d, bias.dtype)
    return copies, want


def reduce_over_ranks(partials):
    """A BF16 sum over ranks of (value, bound) partials, in any order."""
    return O.sum_bound([p[0] for p in partials], [p[1] for p in partials])


def rows_of(value_bound, world, rank):
    return tuple(np.array_split(t, world, axis=0)[rank] for t in value_bound)


def run_layer(layer, x, dy):
    """Output and gradients, with the GEMMs recorded; the backward draws its SR seed after manual_seed."""
    x = x.clone().requires_grad_(True)
    with record_gemms() as calls:
        out = layer(x)
        y = out[0] if isinstance(out, tuple) else out
        torch.manual_seed(BACKWARD_SEED)
        y.backward(dy)
    got = {"y": y.detach(), "dx": x.grad, "dW": layer.weight.grad}
    if layer.bias is not None:
        got["db"] = layer.bias.grad
    return got, calls


def check_run(got, calls, copies, want, what, gemms_expected):
    counts = check_gemms(calls, copies, what)
    for kind, minimum in gemms_expected.items():
        assert counts[kind] >= minimum, f"{what}: {counts[kind]} {kind} GEMMs, expected at least {minimum}"
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for name in want:
        check_result(f"{what} {name}", got[name], want[name])
    return counts


def backward_seed():
    torch.manual_seed(BACKWARD_SEED)
    return draw_seed_like_backward()


# ------------------------------------------------------------------------------------------------------
# The plain layer.

PLAIN_CASES = [pytest.param(name, act, param, id=f"{name}-{str(act).split('.')[1]}-{str(param).split('.')[1]}")
               for name, act, param in [(name, torch.bfloat16, torch.float32) for name in RECIPES] + [
                   ("default", torch.float16, torch.float32), ("default", torch.float32, torch.float32),
                   ("default", torch.bfloat16, torch.bfloat16)]]


@pytest.mark.parametrize("recipe_name,act_dtype,param_dtype", PLAIN_CASES)
def test_linear_against_the_oracle(recipe_name, act_dtype, param_dtype):
    recipe = RECIPES[recipe_name]
    x, dy, weight, bias = make_data(HIDDEN, FFN, seed=3, act_dtype=act_dtype)
    layer = nv.Linear(HIDDEN, FFN, recipe=recipe, dtype=param_dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    got, calls = run_layer(layer, x, dy)
    copies, want = linear_expectations(flat(x), flat(dy), layer.weight.detach(), layer.bias.detach(), recipe,
                                       backward_seed())
    counts = check_run(got, calls, copies, want, f"Linear {recipe_name} {act_dtype}",
                       {"fprop": 1, "dgrad": 1, "wgrad": 1})
    assert counts == {"fprop": 1, "dgrad": 1, "wgrad": 1}, counts


# ------------------------------------------------------------------------------------------------------
# Column- and row-parallel layers.

def column_case(rank, world, recipe, sequence_parallel):
    """The column-parallel layer's run on this rank and the oracle's expectations for it."""
    x, dy, weight, bias = make_data(HIDDEN, FFN, seed=5)
    layer = ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=sequence_parallel, recipe=recipe,
                                 init_method=lambda full: full.copy_(weight))
    with torch.no_grad():
        layer.bias.copy_(bias.chunk(world)[rank])
    x_in = x.chunk(world)[rank] if sequence_parallel else x
    got, calls = run_layer(layer, x_in, dy.chunk(world, dim=-1)[rank])

    seed = backward_seed()
    x2d = flat(x)
    dy_shards = [flat(d) for d in dy.chunk(world, dim=-1)]
    per_rank = [linear_expectations(x2d, dy_k, w_k, b_k, recipe, seed)
                for dy_k, w_k, b_k in zip(dy_shards, weight.chunk(world), bias.chunk(world))]
    copies, want = per_rank[rank]
    dx = reduce_over_ranks([w["dx"] for _, w in per_rank])  # dgrad partials: all-reduce, or reduce-scatter (SP)
    want["dx"] = rows_of(dx, world, rank) if sequence_parallel else dx
    return got, calls, copies, want


def row_case(rank, world, recipe, sequence_parallel):
    x, dy, weight, bias = make_data(FFN, ROW_OUT, seed=7)
    layer = RowParallelLinear(FFN, ROW_OUT, sequence_parallel=sequence_parallel, recipe=recipe,
                              init_method=lambda full: full.copy_(weight))
    with torch.no_grad():
        layer.bias.copy_(bias)
    dy_in = dy.chunk(world)[rank] if sequence_parallel else dy
    got, calls = run_layer(layer, x.chunk(world, dim=-1)[rank], dy_in)

    seed = backward_seed()
    dy2d = flat(dy)  # under SP the gradient is gathered: the full gradient, quantized with global amax and rows
    per_rank = [linear_expectations(flat(x_k), dy2d, w_k, None, recipe, seed)
                for x_k, w_k in zip(x.chunk(world, dim=-1), weight.chunk(world, dim=-1))]
    copies, want = per_rank[rank]
    y = reduce_over_ranks([w["y"] for _, w in per_rank])  # fprop partials: all-reduce, or reduce-scatter (SP)
    y = rows_of(y, world, rank) if sequence_parallel else y
    bias64 = bias.double().numpy().reshape(1, -1)
    bias_bf16 = as_dtype(bias64, torch.bfloat16)  # added after the reduction as a BF16 tensor, one BF16 add
    want["y"] = rounded((y[0] + bias64, y[1] + np.abs(bias_bf16 - bias64)), torch.bfloat16)
    want["db"] = token_sum(flat(dy_in), torch.float32)
    return got, calls, copies, want


def check_parallel(rank, world, kind, recipe_name, sequence_parallel, overlap):
    recipe = RECIPES[recipe_name].replace(overlap=overlap, overlap_min_chunk_gflops=0, overlap_measure_links=False)
    case = column_case if kind == "column" else row_case
    got, calls, copies, want = case(rank, world, recipe, sequence_parallel)
    what = f"{kind} tp={world} sp={sequence_parallel} overlap={overlap} {recipe_name} rank={rank}"
    counts = check_run(got, calls, copies, want, what, {"fprop": 1, "dgrad": 1, "wgrad": 1})
    ring = overlap and sequence_parallel and world > 1
    # the ring runs one GEMM per rank's chunk: fprop (column: input gathered; row: output reduce-scattered), and
    # dgrad (column: reduce-scattered; row: gradient gathered)
    assert counts == {"fprop": world if ring else 1, "dgrad": world if ring else 1, "wgrad": 1}, (what, counts)


def _check_configurations(rank, world, configurations):
    for configuration in configurations:
        check_parallel(rank, world, *configuration)


def configurations(world):
    for kind in ("column", "row"):
        for recipe_name in ("default", "no_rht_no_sr_1d", "row_scaled_rht_sr", "4over6_all_mse_448"):
            for sequence_parallel in (False, True):
                for overlap in ((False, True) if sequence_parallel and world > 1 else (False,)):
                    yield kind, recipe_name, sequence_parallel, overlap


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parallel_layers_against_the_oracle(world):
    run_distributed(_check_configurations, world, list(configurations(world)))
