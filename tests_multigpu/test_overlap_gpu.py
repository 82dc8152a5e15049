"""Overlapped (ring-pipelined) TP+SP layers vs the plain layers on 2 and 4 GPUs with NCCL, over each link class.

Run: `pytest -q tests_multigpu/test_overlap_gpu.py` (each test launches torchrun on 2 or 4 local GPUs: NVLink, slow
links and two nodes on one host, each at TP2 and TP4; docs/slow_links.md), or one world directly:
`torchrun --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py`, with a link class's environment
(`eval "$(python benchmarks/torchrun_setup.py --links slow)"` first), or
`tests_multigpu/two_node_local.sh tests_multigpu/test_overlap_gpu.py`.
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
The pair check also runs the automatic choice (measured links, overlap_measure_links): every rank takes the same
path and the weight gradients equal the plain pair's; its split reduce-scatters cut their rows into growing pieces
(the measured links: transfers longer than these small GEMMs); and the overlapped pair's row layer starts the column
layer's input re-gather (its wgrad GEMM then runs with that transfer in flight).
"""
import contextlib
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

TOKENS_PER_RANK = 512          # [seq/tp = 256, batch = 2]
HIDDEN, LOCAL_FFN = 1024, 512
BACKWARD_SEED = 7
GEMM_PATHS = ("fused", "dequantize")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def link_environment(links):
    """benchmarks/torchrun_setup.py's environment of a link class (checked against the current one)."""
    spec = importlib.util.spec_from_file_location("torchrun_setup", ROOT / "benchmarks" / "torchrun_setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.link_environment(links)


@pytest.mark.parametrize("world_size, links", [(2, "nvlink"), (2, "slow"), (2, "two-node"),
                                               (4, "nvlink"), (4, "slow"), (4, "two-node")])
def test_overlapped_layers_match_plain_on_gpus(world_size, links):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    environment = dict(os.environ, **link_environment(links), PYTHON=sys.executable)
    if links == "two-node":
        command = ["bash", str(ROOT / "tests_multigpu" / "two_node_local.sh"), "--gpus", str(world_size), __file__]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                   __file__]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    # The link class reached the ranks: two agents for two-node, and no symmetric memory off NVLink (on NVLink it
    # is used where the host allows it).
    passed = f"overlap GPU checks passed on {world_size} ranks ({2 if links == 'two-node' else 1} torchrun node(s), "
    passed += "symmetric memory off)" if links != "nvlink" else "symmetric memory "
    assert passed in result.stdout, result.stdout[-3000:]


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


@contextlib.contextmanager
def gemm_outputs():
    """The result of every nvfp4_dist.gemm call inside the block (the package's modules that imported it included)."""
    import nvfp4_dist
    original, outputs = nvfp4_dist.gemm, []

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        outputs.append(out.detach().clone())
        return out
    patched = [(module, name) for module in list(sys.modules.values())
               if getattr(module, "__name__", "").startswith("nvfp4_dist")
               for name, value in list(vars(module).items()) if value is original]
    for module, name in patched:
        setattr(module, name, recording)
    try:
        yield outputs
    finally:
        for module, name in patched:
            setattr(module, name, original)


def run_layer(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    torch.manual_seed(BACKWARD_SEED)  # the SR seed of backward, drawn alike on every rank and in both runs
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad,
            "db": None if layer.bias is None else layer.bias.grad}


# The functions of each overlap path, by the name its calls are recorded under.
PATH_FUNCTIONS = {"ring": {"gather": "ring_all_gather_consume", "scatter": "ring_reduce_scatter_produce"},
                  "collectives": {"gather": "split_gathered_gemm", "scatter": "split_gemm_reduce_scatter"}}


def plain_and_overlapped(make_layer, x, dy, transport):
    """(plain results, overlapped results on `transport`, sorted "<path> gather|scatter" calls of the latter)."""
    from nvfp4_dist.parallel import overlap
    plain = run_layer(make_layer(), x, dy)
    layer = make_layer()
    layer.comm = overlap.overlapped_comm(layer.comm, transport=transport)
    calls = []
    originals = {name: getattr(overlap, name) for functions in PATH_FUNCTIONS.values() for name in functions.values()}

    def recorded(tag, function):
        return lambda *a, **k: (calls.append(tag), function(*a, **k))[1]
    for path, functions in PATH_FUNCTIONS.items():
        for kind, name in functions.items():
            setattr(overlap, name, recorded(f"{path} {kind}", originals[name]))
    try:
        result = run_layer(layer, x, dy)
    finally:
        for name, function in originals.items():
            setattr(overlap, name, function)
    return plain, result, sorted(calls)


def inputs(world_size, in_features, out_features, seed):
    generator = torch.Generator().manual_seed(seed)
    seq = TOKENS_PER_RANK // 2 * world_size
    x = torch.randn(seq, 2, in_features, generator=generator) * torch.logspace(-1, 1, in_features)
    dy = torch.randn(seq, 2, out_features, generator=generator)
    return x.bfloat16().cuda(), dy.bfloat16().cuda()


def check_column(recipe, exact_gemms, transport, keep_input_columnwise=False):
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

    plain, overlapped, calls = plain_and_overlapped(make_layer, x_local, dy_local, transport)
    what = f"column {recipe} keep={keep_input_columnwise} {transport} rank={rank}"
    assert calls == [f"{transport} gather", f"{transport} scatter"], (what, calls)
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


def check_row(recipe, exact_gemms, transport):
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

    plain, overlapped, calls = plain_and_overlapped(make_layer, x_local, dy_local, transport)
    what = f"row {recipe} {transport} rank={rank}"
    assert calls == [f"{transport} gather", f"{transport} scatter"], (what, calls)
    compare = assert_equal if exact_gemms else assert_gemm_close
    for name in ("dx", "dw", "db"):
        compare(overlapped[name], plain[name], f"{what} {name}")
    layer = make_layer()
    weight_q = layer.weight_cache.get(layer.weight, recipe)
    xq = quantize_operand(x_local.reshape(-1, LOCAL_FFN), "activation", recipe, columnwise=False)
    partial = gemm(xq, weight_q, out_dtype=torch.bfloat16)
    assert_reduce_scatter_close(overlapped["y"], plain["y"], partial, exact_gemms, what + " y")


def check_pair(recipe):
    """Column -> gelu -> row with SP, forward and backward, with exact (fused) GEMMs: plain, overlapped (every layer on
    the ring, or on split collectives, the row layer starting the column input's re-gather) and automatic. Every GEMM's output is the same
    in each mode, so the weight gradients are exact, and y and dx, reduce-scatters of identical partials in ring
    vs NCCL order, are within the summation-order bound of those partials (recorded in the plain run)."""
    from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear, overlap
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, dy = inputs(world_size, HIDDEN, HIDDEN, 3)
    tokens = x.shape[0] * x.shape[1]
    results, early_starts, choices, partials = {}, [], None, {}
    original_start = overlap.InputRegathers.start
    for mode in ("plain", "overlapped", "split", "auto"):
        torch.manual_seed(4)
        layer_recipe = (recipe.replace(overlap=True, overlap_min_chunk_gflops=0, overlap_transport="auto")
                        if mode == "auto" else recipe)
        column = ColumnParallelLinear(HIDDEN, LOCAL_FFN * world_size, sequence_parallel=True, recipe=layer_recipe,
                                      device="cuda")
        # skip_bias_add: y is the reduced sum itself
        row = RowParallelLinear(LOCAL_FFN * world_size, HIDDEN, sequence_parallel=True, recipe=layer_recipe,
                                device="cuda", skip_bias_add=True)
        if mode in ("overlapped", "split"):
            transport = "ring" if mode == "overlapped" else "collectives"
            column.comm = overlap.overlapped_comm(column.comm, transport=transport)
            row.comm = overlap.overlapped_comm(row.comm, transport=transport)
        x_local = x.chunk(world_size)[rank].clone().requires_grad_(True)
        with gemm_outputs() as forward:
            y = row(torch.nn.functional.gelu(column(x_local)[0]))[0]
        torch.manual_seed(BACKWARD_SEED)
        overlap.InputRegathers.start = lambda self, entry: (early_starts.append(mode), original_start(self, entry))[1]
        try:
            with gemm_outputs() as backward:
                y.backward(dy.chunk(world_size)[rank])
        finally:
            overlap.InputRegathers.start = original_start
        results[mode] = (y.detach(), x_local.grad, column.weight.grad, row.weight.grad)
        if mode == "plain":  # the [tokens, HIDDEN] GEMMs: the row layer's fprop and the column layer's dgrad partials
            (partials["y"],) = [out for out in forward if tuple(out.shape) == (tokens, HIDDEN)]
            (partials["dx"],) = [out for out in backward if tuple(out.shape) == (tokens, HIDDEN)]
        if mode == "split":  # the link speed is known (check_link_speed): this small pair's transfers outlast its
            # GEMMs, so its reduce-scatters' pieces grow; its all-gathers' stay equal
            gather, scatter = (column.comm.split_pieces("all_gather", TOKENS_PER_RANK),
                               row.comm.split_pieces("reduce_scatter", TOKENS_PER_RANK))
            assert len(set(gather)) == 1 and scatter == sorted(scatter) and len(set(scatter)) > 1, (gather, scatter)
        if mode == "auto":
            choices = (column._overlapped_comm.path, row._overlapped_comm.path)
    what = f"pair {recipe} rank={rank}"
    assert early_starts.count("overlapped") == early_starts.count("split") == 1, (what, early_starts)
    y0, dx0, dwc0, dwr0 = results["plain"]
    for mode in ("overlapped", "split", "auto"):
        y1, dx1, dwc1, dwr1 = results[mode]
        assert_reduce_scatter_close(y1, y0, partials["y"], True, f"{what} {mode} y")
        assert_reduce_scatter_close(dx1, dx0, partials["dx"], True, f"{what} {mode} dx")
        # The column output is exact, so the row layer's input and everything backward of y is too, up to the
        # column dgrad's reduce-scatter (dx).
        assert_equal(dwr1, dwr0, f"{what} {mode} row dW")
        assert_equal(dwc1, dwc0, f"{what} {mode} column dW")
    all_choices = [None] * world_size
    dist.all_gather_object(all_choices, choices)
    assert len(set(all_choices)) == 1, f"{what}: ranks took different paths {all_choices}"
    return choices


def check_link_speed():
    """The group's measured link speed: the same on every rank; what it says of the MLP pair (TP4 shapes)."""
    from nvfp4_dist.parallel import link_speed, overlap
    world_size = dist.get_world_size()
    speed = overlap.group_link_speed(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
    speeds = [None] * world_size
    dist.all_gather_object(speeds, speed)
    assert len(set(speeds)) == 1, f"ranks disagree on the link speed: {speeds}"
    rows, ffn_local, hidden = 16384 // world_size, 28672 // world_size, 8192
    step_gflops = overlap.ring_step_gflops(rows, ffn_local, hidden)
    loads = [link_speed.RingLoad("all_gather", link_speed.nvfp4_bytes(rows, hidden), step_gflops),
             link_speed.RingLoad("reduce_scatter", rows * hidden * 2, step_gflops)]
    return speed, speed.ring_saving_ms(loads, world_size)


def main():
    import nvfp4_dist as nv
    from nvfp4_dist.parallel import symmetric
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    recipes = [nv.NVFP4Recipe(), nv.NVFP4Recipe(rht=False, stochastic_rounding=False, weight_2d=False),
               nv.NVFP4Recipe(rht=False, stochastic_rounding=False, row_scaled_activation=True)]
    try:
        for path in GEMM_PATHS:
            os.environ["NVFP4_HOPPER_GEMM"] = path
            exact = path == "fused"
            for transport in ("ring", "collectives"):
                for recipe in recipes:
                    check_column(recipe, exact, transport)
                    check_row(recipe, exact, transport)
                check_column(recipes[0], exact, transport, keep_input_columnwise=True)
        os.environ["NVFP4_HOPPER_GEMM"] = "fused"
        speed, pair_saving_ms = check_link_speed()
        choices = check_pair(recipes[0])
        symmetric_memory = "on" if symmetric.enabled() else "off"
        torch.cuda.synchronize()
        dist.barrier()
        if dist.get_rank() == 0:
            nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
            print(f"link speed: {speed.describe()}; MLP pair (16384, 8192, 28672) column layer's rings expected to "
                  f"save {pair_saving_ms:.2f} ms; this test's small pair, automatic choice: "
                  f"{choices[0]}", flush=True)
            print(f"overlap GPU checks passed on {dist.get_world_size()} ranks ({nodes} torchrun node(s), "
                  f"symmetric memory {symmetric_memory})", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
