"""Overlapped (ring-pipelined) TP+SP layers vs the plain layers on 2 and 4 GPUs with NCCL.

Run: `pytest -q tests_multigpu/test_overlap_gpu.py` (each test launches torchrun on 2 or 4 local GPUs), or one
world directly: `torchrun --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py`.
Build the CUDA kernels first (`python -m nvfp4_dist.build`): the ranks quantize with them.

Expected, per GEMM path of the Hopper emulated backend (both are run, whichever is the default):
- fused Triton kernel (NVFP4_HOPPER_GEMM=fused): each output row depends only on its own row of A, so the
  all-gather side (column fprop, row dgrad, both wgrads, bias grads) is bit-identical to the plain layers;
- dequantize + cuBLAS (NVFP4_HOPPER_GEMM=dequantize): cuBLAS may pick another kernel for a chunk's row
  count, so within accumulation-order tolerance: rtol = 8e-3, atol = 8e-3 * rms(expected) (docs/numerics.md §11's GEMM
  tolerance).
The reduce-scatter side (row fprop, column dgrad) sums in ring order (FP32, rounded to BF16 each hop) against
NCCL's own order: each is within (W-1) * 2^-8 * S of the exact sum, S = sum over ranks of |partial|, so they
differ by at most twice that (plus the GEMM tolerance above on the dequantize path).
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

TOKENS_PER_RANK = 512          # [seq/tp = 256, batch = 2]
HIDDEN, LOCAL_FFN = 1024, 512
BACKWARD_SEED = 7
GEMM_PATHS = ("fused", "dequantize")


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlapped_layers_match_plain_on_gpus(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               __file__]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert f"overlap GPU checks passed on {world_size} ranks" in result.stdout


# ----------------------------------------------------------------------------------------------------------
# Per-rank checks (run under torchrun).

def assert_equal(got, expected, what):
    if expected is None:
        assert got is None, what
        return
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    assert torch.equal(got, expected), f"{what}: max diff {(got.float() - expected.float()).abs().max().item()}"


def assert_gemm_close(got, expected, what):
    if expected is None:
        assert got is None, what
        return
    scale = expected.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=8e-3 * scale, msg=what)


def assert_reduce_scatter_close(got, expected, partial, exact_gemms, what):
    """Ring vs NCCL reduce-scatter of this rank's [M, N] `partial`: the summation-order bound."""
    world_size = dist.get_world_size()
    magnitude = partial.double().abs()
    dist.all_reduce(magnitude)
    magnitude = magnitude.chunk(world_size)[dist.get_rank()].reshape(got.shape)
    bound = 2 * (world_size - 1) * 2.0 ** -8 * magnitude
    if not exact_gemms:
        bound = bound + 8e-3 * (expected.double().abs() + magnitude.pow(2).mean().sqrt())
    excess = (got.double() - expected.double()).abs() - bound
    assert bool((excess <= 0).all()), f"{what}: exceeds the summation-order bound by {excess.max().item()}"


def run_layer(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    torch.manual_seed(BACKWARD_SEED)  # the SR seed of backward, drawn alike on every rank and in both runs
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad,
            "db": None if layer.bias is None else layer.bias.grad}


def plain_and_overlapped(make_layer, x, dy):
    from nvfp4_dist.parallel import overlap
    plain = run_layer(make_layer(), x, dy)
    layer = make_layer()
    layer.comm = overlap.overlapped_comm(layer.comm)
    calls = []
    originals = (overlap.ring_all_gather_consume, overlap.ring_reduce_scatter_produce)
    overlap.ring_all_gather_consume = lambda *a, **k: (calls.append("gather"), originals[0](*a, **k))[1]
    overlap.ring_reduce_scatter_produce = lambda *a, **k: (calls.append("scatter"), originals[1](*a, **k))[1]
    try:
        result = run_layer(layer, x, dy)
    finally:
        overlap.ring_all_gather_consume, overlap.ring_reduce_scatter_produce = originals
    return plain, result, sorted(calls)


def inputs(world_size, in_features, out_features, seed):
    generator = torch.Generator().manual_seed(seed)
    seq = TOKENS_PER_RANK // 2 * world_size
    x = torch.randn(seq, 2, in_features, generator=generator) * torch.logspace(-1, 1, in_features)
    dy = torch.randn(seq, 2, out_features, generator=generator)
    return x.bfloat16().cuda(), dy.bfloat16().cuda()


def check_column(recipe, exact_gemms, keep_input_columnwise=False):
    from nvfp4_dist import ops
    from nvfp4_dist.gemm import gemm
    from nvfp4_dist.linear import quantize_operand
    from nvfp4_dist.parallel import ColumnParallelLinear
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, dy = inputs(world_size, HIDDEN, LOCAL_FFN * world_size, 1)
    x_local, dy_local = x.chunk(world_size)[rank], dy.chunk(world_size, dim=-1)[rank]

    def make_layer():
        torch.manual_seed(1)
        layer = ColumnParallelLinear(HIDDEN, LOCAL_FFN * world_size, sequence_parallel=True, recipe=recipe,
                                     keep_input_columnwise=keep_input_columnwise, device="cuda")
        with torch.no_grad():
            layer.bias.uniform_(-1, 1)
        return layer

    plain, overlapped, calls = plain_and_overlapped(make_layer, x_local, dy_local)
    what = f"column {recipe} keep={keep_input_columnwise} rank={rank}"
    assert calls == ["gather", "scatter"], (what, calls)
    compare = assert_equal if exact_gemms else assert_gemm_close
    for name in ("y", "dw", "db"):
        compare(overlapped[name], plain[name], f"{what} {name}")
    layer = make_layer()
    weight_q = layer.weight_cache.get(layer.weight, recipe)
    dy2d = dy_local.reshape(-1, LOCAL_FFN)
    torch.manual_seed(BACKWARD_SEED)
    sr_seed = ops.draw_sr_seed() if recipe.stochastic_rounding else None
    dyq = quantize_operand(dy2d, "gradient", recipe, rowwise=True, columnwise=False, sr_seed=sr_seed)
    partial = gemm(dyq, weight_q, a_copy="rowwise", b_copy="columnwise", out_dtype=torch.bfloat16)
    assert_reduce_scatter_close(overlapped["dx"], plain["dx"], partial, exact_gemms, what + " dx")


def check_row(recipe, exact_gemms):
    from nvfp4_dist.gemm import gemm
    from nvfp4_dist.linear import quantize_operand
    from nvfp4_dist.parallel import RowParallelLinear
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, dy = inputs(world_size, LOCAL_FFN * world_size, HIDDEN, 2)
    x_local, dy_local = x.chunk(world_size, dim=-1)[rank], dy.chunk(world_size)[rank]

    def make_layer():
        torch.manual_seed(2)
        return RowParallelLinear(LOCAL_FFN * world_size, HIDDEN, sequence_parallel=True, recipe=recipe,
                                 skip_bias_add=True, device="cuda")

    plain, overlapped, calls = plain_and_overlapped(make_layer, x_local, dy_local)
    what = f"row {recipe} rank={rank}"
    assert calls == ["gather", "scatter"], (what, calls)
    compare = assert_equal if exact_gemms else assert_gemm_close
    for name in ("dx", "dw", "db"):
        compare(overlapped[name], plain[name], f"{what} {name}")
    layer = make_layer()
    weight_q = layer.weight_cache.get(layer.weight, recipe)
    xq = quantize_operand(x_local.reshape(-1, LOCAL_FFN), "activation", recipe, columnwise=False)
    partial = gemm(xq, weight_q, out_dtype=torch.bfloat16)
    assert_reduce_scatter_close(overlapped["y"], plain["y"], partial, exact_gemms, what + " y")


def check_pair(recipe):
    """Column -> gelu -> row with SP, forward and backward: weight grads exact (fused GEMM), y and dx near."""
    from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear, overlap
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, dy = inputs(world_size, HIDDEN, HIDDEN, 3)
    results = []
    for overlapped in (False, True):
        torch.manual_seed(4)
        column = ColumnParallelLinear(HIDDEN, LOCAL_FFN * world_size, sequence_parallel=True, recipe=recipe,
                                      device="cuda")
        row = RowParallelLinear(LOCAL_FFN * world_size, HIDDEN, sequence_parallel=True, recipe=recipe, device="cuda")
        if overlapped:
            column.comm, row.comm = overlap.overlapped_comm(column.comm), overlap.overlapped_comm(row.comm)
        x_local = x.chunk(world_size)[rank].clone().requires_grad_(True)
        y = row(torch.nn.functional.gelu(column(x_local)[0]))[0]
        torch.manual_seed(BACKWARD_SEED)
        y.backward(dy.chunk(world_size)[rank])
        results.append((y.detach(), x_local.grad, column.weight.grad, row.weight.grad))
    (y0, dx0, dwc0, dwr0), (y1, dx1, dwc1, dwr1) = results
    what = f"pair {recipe} rank={rank}"
    for got, expected, name in ((y1, y0, "y"), (dx1, dx0, "dx")):
        distance = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert distance <= 1e-2, f"{what} {name}: relative distance {distance:.2e}"
    # The column output is exact, so the row layer's input and everything backward of y is too, up to the
    # column dgrad's reduce-scatter (dx).
    assert_equal(dwr1, dwr0, what + " row dW")
    assert_equal(dwc1, dwc0, what + " column dW")


def main():
    import nvfp4_dist as nv
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    recipes = [nv.NVFP4Recipe(), nv.NVFP4Recipe(rht=False, stochastic_rounding=False, weight_2d=False),
               nv.NVFP4Recipe(rht=False, stochastic_rounding=False, row_scaled_activation=True)]
    try:
        for path in GEMM_PATHS:
            os.environ["NVFP4_HOPPER_GEMM"] = path
            exact = path == "fused"
            for recipe in recipes:
                check_column(recipe, exact)
                check_row(recipe, exact)
            check_column(recipes[0], exact, keep_input_columnwise=True)
        os.environ["NVFP4_HOPPER_GEMM"] = "fused"
        check_pair(recipes[0])
        torch.cuda.synchronize()
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"overlap GPU checks passed on {dist.get_world_size()} ranks", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
