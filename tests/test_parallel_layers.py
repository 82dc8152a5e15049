"""Column- and row-parallel NVFP4 layers on gloo groups of 2 and 4 ranks.

Each rank checks its outputs and gradients against a single-process emulation of the same sharded math whose
operands the independent oracle quantized (tests/helpers/emulation.py): exact, except the BF16 sums of partial GEMM
outputs over 4 ranks, whose order is gloo's own: those are checked against the exact sum within the
rounding bound of a 4-term BF16 sum (3 roundings). Then against the TP=1 nvfp4_dist.Linear within a
stated tolerance (weights are quantized per shard, so the NVFP4 rounding differs).
"""
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist.linear import Linear
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from tests.helpers.distributed import run_distributed
from tests.helpers.emulation import (draw_seed_like_backward, fprop, gemm_cols, gemm_row_col, quantize_activation,
                                     quantize_gradient, quantize_weight)

SEQ_PER_RANK, BATCH = 8, 2           # SP shards: 16 tokens per rank
COLUMN_IN, ROW_OUT = 32, 32
LOCAL_FEATURES = 16                  # column out / row in per rank
BACKWARD_SEED = 11
# Relative Frobenius distance to the TP=1 layer. Weights are quantized per shard (own amax) and, for the
# column-parallel output gradient, also per shard with SR bits drawn at local column positions; measured
# at these shapes: outputs <= 0.07, row-parallel gradients <= 0.10, column-parallel gradients <= 0.19.
TP1_OUTPUT_TOLERANCE, TP1_ROW_GRAD_TOLERANCE, TP1_COLUMN_GRAD_TOLERANCE = 0.1, 0.15, 0.25


def full_tensors(world_size, in_features, out_features, device="cpu", dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(42)
    seq = SEQ_PER_RANK * world_size
    x = torch.randn(seq, BATCH, in_features, generator=generator).to(dtype)
    dy = torch.randn(seq, BATCH, out_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator)
    return tuple(t.to(device) for t in (x, dy, weight, bias))


def run(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y, returned_bias = layer(x)
    torch.manual_seed(BACKWARD_SEED)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad, returned_bias


def bf16_sum(partials):
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total


def assert_reduced(got, partials, what):
    """Exact for 2 ranks; for more, within the bound of (W-1) BF16 roundings of any summation order."""
    if len(partials) <= 2:
        assert torch.equal(got, bf16_sum(partials)), what
        return
    exact = sum(p.double() for p in partials)
    bound = (len(partials) - 1) * 2.0 ** -8 * sum(p.double().abs() for p in partials) + 1e-30
    assert bool(((got.double() - exact).abs() <= bound).all()), what


def assert_equal(got, expected, what):
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    assert torch.equal(got, expected), f"{what}: max diff {(got.float() - expected.float()).abs().max().item()}"


def assert_near_tp1(got, expected, what, tolerance):
    distance = (got.float() - expected.float()).norm() / expected.float().norm()
    assert distance <= tolerance, f"{what}: relative distance to TP=1 {distance:.3f}"


def tp1_result(x, dy, weight, bias, recipe):
    layer = Linear(weight.shape[1], weight.shape[0], recipe=recipe, device=x.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x = x.clone().requires_grad_(True)
    y = layer(x)
    torch.manual_seed(BACKWARD_SEED)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def check_column(rank, world_size, sequence_parallel, recipe, keep_input_columnwise=False, device="cpu"):
    out_features = LOCAL_FEATURES * world_size
    x, dy, weight, bias = full_tensors(world_size, COLUMN_IN, out_features, device)
    layer = ColumnParallelLinear(COLUMN_IN, out_features, sequence_parallel=sequence_parallel, recipe=recipe,
                                 device=device,
                                 init_method=lambda w: w.copy_(weight), keep_input_columnwise=keep_input_columnwise)
    with torch.no_grad():
        layer.bias.copy_(bias.chunk(world_size)[rank])
    x_in = x.chunk(world_size)[rank] if sequence_parallel else x
    dy_local = dy.chunk(world_size, dim=-1)[rank]
    y, dx, dw, db, returned_bias = run(layer, x_in, dy_local)
    assert returned_bias is None

    # Emulation of the sharded math: the gathered input equals quantizing the full input (docs/numerics.md §9).
    x2d = x.reshape(-1, COLUMN_IN)
    xq_row, xq_col = quantize_activation(x2d, recipe)
    torch.manual_seed(BACKWARD_SEED)
    sr_seed = draw_seed_like_backward()
    partials, expected = [], {}
    for r, (w_r, dy_r, b_r) in enumerate(zip(weight.chunk(world_size), dy.chunk(world_size, dim=-1),
                                             bias.chunk(world_size))):
        wq = quantize_weight(w_r, recipe)
        dy2d = dy_r.reshape(-1, LOCAL_FEATURES)
        dyq_row, dyq_col = quantize_gradient(dy2d, recipe, sr_seed)
        partials.append(gemm_row_col(dyq_row, wq).to(x.dtype).reshape(x.shape))
        if r == rank:
            expected["y"] = fprop(xq_row, wq, b_r, x.dtype).reshape(*x.shape[:-1], LOCAL_FEATURES)
            expected["dw"] = gemm_cols(dyq_col, xq_col).to(weight.dtype)
            expected["db"] = dy2d.sum(0).to(torch.float32)
    what = f"column sp={sequence_parallel} rank={rank}"
    assert_equal(y, expected["y"], what + " y")
    assert_equal(dw, expected["dw"], what + " dW")
    assert_equal(db, expected["db"], what + " db")
    if sequence_parallel:
        partials = [p.chunk(world_size)[rank] for p in partials]
    assert dx.shape == x_in.shape
    assert_reduced(dx, partials, what + " dx")

    y1, dx1, dw1, db1 = tp1_result(x, dy, weight, bias, recipe)
    assert_near_tp1(y, y1.chunk(world_size, dim=-1)[rank], what + " y", TP1_OUTPUT_TOLERANCE)
    assert_near_tp1(dx, dx1.chunk(world_size)[rank] if sequence_parallel else dx1, what + " dx",
                    TP1_COLUMN_GRAD_TOLERANCE)
    assert_near_tp1(dw, dw1.chunk(world_size)[rank], what + " dW", TP1_COLUMN_GRAD_TOLERANCE)
    assert_equal(db, db1.chunk(world_size)[rank], what + " db vs TP=1")
    return y, dx, dw


def check_row(rank, world_size, sequence_parallel, recipe, device="cpu"):
    in_features = LOCAL_FEATURES * world_size
    x, dy, weight, bias = full_tensors(world_size, in_features, ROW_OUT, device)
    layer = RowParallelLinear(in_features, ROW_OUT, sequence_parallel=sequence_parallel, recipe=recipe, device=device,
                              init_method=lambda w: w.copy_(weight))
    with torch.no_grad():
        layer.bias.copy_(bias)
    x_in = x.chunk(world_size, dim=-1)[rank]
    dy_in = dy.chunk(world_size)[rank] if sequence_parallel else dy
    y, dx, dw, db, _ = run(layer, x_in, dy_in)

    torch.manual_seed(BACKWARD_SEED)
    sr_seed = draw_seed_like_backward()
    dyq_row, dyq_col = quantize_gradient(dy.reshape(-1, ROW_OUT), recipe, sr_seed)  # = the gathered SP gradient
    partials = []
    for r, (x_r, w_r) in enumerate(zip(x.chunk(world_size, dim=-1), weight.chunk(world_size, dim=-1))):
        wq = quantize_weight(w_r, recipe)
        xq_row, xq_col = quantize_activation(x_r.reshape(-1, LOCAL_FEATURES), recipe)
        partials.append(fprop(xq_row, wq, None, x.dtype).reshape(*x.shape[:-1], ROW_OUT))
        if r == rank:
            expected_dx = gemm_row_col(dyq_row, wq).to(x.dtype).reshape(x_in.shape)
            expected_dw = gemm_cols(dyq_col, xq_col).to(weight.dtype)
    what = f"row sp={sequence_parallel} rank={rank}"
    if sequence_parallel:
        partials = [p.chunk(world_size)[rank] for p in partials]
    if world_size == 2:
        assert_equal(y, bf16_sum(partials) + bias.to(y.dtype), what + " y")
    else:  # the bias is one more BF16 term
        assert_reduced(y, partials + [bias.to(y.dtype).expand_as(y)], what + " y")
    assert_equal(dx, expected_dx, what + " dx")
    assert_equal(dw, expected_dw, what + " dW")
    assert_equal(db, dy_in.reshape(-1, ROW_OUT).sum(0).to(torch.float32), what + " db")

    y1, dx1, dw1, _ = tp1_result(x, dy, weight, bias, recipe)
    assert_near_tp1(y, y1.chunk(world_size)[rank] if sequence_parallel else y1, what + " y", TP1_OUTPUT_TOLERANCE)
    assert_near_tp1(dx, dx1.chunk(world_size, dim=-1)[rank], what + " dx", TP1_ROW_GRAD_TOLERANCE)
    assert_near_tp1(dw, dw1.chunk(world_size, dim=-1)[rank], what + " dW", TP1_ROW_GRAD_TOLERANCE)


def check_options(rank, world_size, recipe=nv.NVFP4Recipe(), device="cpu"):
    """keep_input_columnwise, gather_output, input_is_parallel=False, skip_bias_add, BF16 fallback."""
    y_default, dx_default, dw_default = check_column(rank, world_size, True, recipe, device=device)
    y_kept, dx_kept, dw_kept = check_column(rank, world_size, True, recipe, keep_input_columnwise=True,
                                            device=device)
    assert torch.equal(y_kept, y_default) and torch.equal(dx_kept, dx_default) and torch.equal(dw_kept, dw_default)

    out_features = LOCAL_FEATURES * world_size
    x, dy, weight, bias = full_tensors(world_size, COLUMN_IN, out_features, device)
    gathered = ColumnParallelLinear(COLUMN_IN, out_features, gather_output=True, recipe=recipe, device=device,
                                    init_method=lambda w: w.copy_(weight))
    plain = ColumnParallelLinear(COLUMN_IN, out_features, recipe=recipe, device=device,
                                 init_method=lambda w: w.copy_(weight))
    y_gathered, dx_gathered, dw_gathered, _, _ = run(gathered, x, dy)
    y_plain, dx_plain, dw_plain, _, _ = run(plain, x, dy.chunk(world_size, dim=-1)[rank])
    assert y_gathered.shape[-1] == out_features
    assert torch.equal(y_gathered.chunk(world_size, dim=-1)[rank], y_plain)
    assert torch.equal(dx_gathered, dx_plain) and torch.equal(dw_gathered, dw_plain)

    in_features = LOCAL_FEATURES * world_size
    x, dy, weight, bias = full_tensors(world_size, in_features, ROW_OUT, device)
    scattering = RowParallelLinear(in_features, ROW_OUT, input_is_parallel=False, skip_bias_add=True, recipe=recipe,
                                   device=device, init_method=lambda w: w.copy_(weight))
    parallel_in = RowParallelLinear(in_features, ROW_OUT, skip_bias_add=True, recipe=recipe, device=device,
                                    init_method=lambda w: w.copy_(weight))
    y_s, dx_s, dw_s, _, bias_s = run(scattering, x, dy)
    y_p, dx_p, dw_p, _, bias_p = run(parallel_in, x.chunk(world_size, dim=-1)[rank], dy)
    assert bias_s is scattering.bias and bias_p is parallel_in.bias
    assert torch.equal(y_s, y_p) and torch.equal(dw_s, dw_p)
    assert torch.equal(dx_s.chunk(world_size, dim=-1)[rank], dx_p) and dx_s.shape == x.shape

    # BF16 fallback column(SP) -> row(SP) pair equals the unsharded BF16 math (within BF16 sum order).
    column = ColumnParallelLinear(COLUMN_IN, out_features, sequence_parallel=True, bf16_fallback=True,
                                  params_dtype=torch.bfloat16, device=device)
    row = RowParallelLinear(out_features, COLUMN_IN, sequence_parallel=True, bf16_fallback=True,
                            params_dtype=torch.bfloat16, device=device)
    torch.manual_seed(5)
    full_column = torch.nn.Linear(COLUMN_IN, out_features, dtype=torch.bfloat16, device=device)
    full_row = torch.nn.Linear(out_features, COLUMN_IN, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        column.weight.copy_(full_column.weight.chunk(world_size)[rank])
        column.bias.copy_(full_column.bias.chunk(world_size)[rank])
        row.weight.copy_(full_row.weight.chunk(world_size, dim=-1)[rank])
        row.bias.copy_(full_row.bias)
    x, dy, _, _ = full_tensors(world_size, COLUMN_IN, COLUMN_IN, device)
    x_local = x.chunk(world_size)[rank].clone().requires_grad_(True)
    y_local = row(column(x_local)[0])[0]
    y_local.backward(dy.chunk(world_size)[rank])
    x_full = x.clone().requires_grad_(True)
    y_full = full_row(full_column(x_full))
    y_full.backward(dy)
    torch.testing.assert_close(y_local, y_full.chunk(world_size)[rank], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x_local.grad, x_full.grad.chunk(world_size)[rank], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(column.weight.grad, full_column.weight.grad.chunk(world_size)[rank],
                               rtol=2e-2, atol=5e-2)


def check_row_scaled_and_megatron_hooks(rank, world_size, device="cpu", recipe_backend="auto"):
    """Row-scaled column(SP) in NVFP4 both ways (docs/numerics.md §6b): per-row amaxes gathered with their rows, the
    per-column amaxes of the wgrad copy reduced over the group, so each rank's dW equals the full tensor's math;
    with and without the RHT and SR, the input's columnwise copy kept or gathered again. main_grad + delayed
    wgrad. overlap switch."""
    out_features = LOCAL_FEATURES * world_size
    for recipe in (nv.NVFP4Recipe(row_scaled_activation=True, rht=False, stochastic_rounding=False,
                                  gemm_backend=recipe_backend),
                   nv.NVFP4Recipe(row_scaled_activation=True, gemm_backend=recipe_backend)):
        for keep_input_columnwise in (False, True):
            check_column(rank, world_size, True, recipe, keep_input_columnwise=keep_input_columnwise, device=device)
    x, dy, weight, bias = full_tensors(world_size, COLUMN_IN, out_features, device)

    exact = nv.NVFP4Recipe(gemm_backend=recipe_backend)
    make = lambda **options: ColumnParallelLinear(COLUMN_IN, out_features, sequence_parallel=True,  # noqa: E731
                                                  recipe=exact, device=device, init_method=lambda w: w.copy_(weight),
                                                  **options)
    plain = run(make(), x.chunk(world_size)[rank], dy.chunk(world_size, dim=-1)[rank])
    hooked = make(accumulate_into_main_grad=True, delay_wgrad=True)
    hooked.weight.main_grad = torch.zeros_like(hooked.weight, dtype=torch.float32)
    got = run(hooked, x.chunk(world_size)[rank], dy.chunk(world_size, dim=-1)[rank])
    assert got[2] is None and not bool(hooked.weight.main_grad.any()) and len(hooked.wgrad_store) == 1
    assert torch.equal(got[1], plain[1])
    hooked.backward_dw()
    assert torch.equal(hooked.weight.main_grad, plain[2])

    overlapped = ColumnParallelLinear(COLUMN_IN, out_features, sequence_parallel=True, device=device,
                                      recipe=exact.replace(overlap=True), init_method=lambda w: w.copy_(weight))
    got = run(overlapped, x.chunk(world_size)[rank], dy.chunk(world_size, dim=-1)[rank])
    assert type(overlapped._overlapped_comm).__name__ == "OverlappedColumnParallelComm"
    assert torch.equal(got[0], plain[0]) and torch.equal(got[2], plain[2])


def _check_layers(rank, world_size, which):
    recipes = {"default": nv.NVFP4Recipe(), "no_rht_no_2d": nv.NVFP4Recipe(rht=False, weight_2d=False),
               "4over6": nv.NVFP4Recipe(rht=False, nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="weights")}
    if which == "column":
        for sequence_parallel in (True, False):
            check_column(rank, world_size, sequence_parallel, recipes["default"])
        check_column(rank, world_size, True, recipes["no_rht_no_2d"])
        check_column(rank, world_size, True, recipes["4over6"])
    elif which == "row":
        for sequence_parallel in (True, False):
            check_row(rank, world_size, sequence_parallel, recipes["default"])
        check_row(rank, world_size, True, recipes["no_rht_no_2d"])
        check_row(rank, world_size, True, recipes["4over6"])
    else:
        check_options(rank, world_size)
        check_row_scaled_and_megatron_hooks(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("which", ["column", "row", "options"])
def test_parallel_layers(which, world_size):
    run_distributed(_check_layers, world_size, which)
