"""Overlapped TP+SP layers (on the ring and on split collectives) vs the plain layers on gloo groups of 2 and 4 ranks.

The same layer is run with its plain comm and with overlapped_comm(plain comm), from the same weights, inputs,
output gradients and stochastic-rounding seed. Expected, with the reference GEMM:
- all-gather side (column fprop, row dgrad, both wgrads, biases): bit-identical;
- reduce-scatter side (row fprop output, column dgrad): the ring sums in its own order, in FP32 rounded to BF16
  at each hop, split collectives in their collective's order. Exact at W=2 (one rounding of a two-term sum
  either way). At W=4 each side is within (W-1) * 2^-8 * S of the exact sum, S = sum over ranks of |partial|,
  so they differ by at most twice that.
Spies check that the overlapped run really took its path (and the plain path was not used).
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist import ops
from nvfp4_dist.gemm import gemm
from nvfp4_dist.linear import operand_amaxes, quantize_operand
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear, all_gather_nvfp4, all_reduce_amax
from nvfp4_dist.parallel import collectives
from nvfp4_dist.parallel import overlap as O
from tests.helpers.distributed import run_distributed

TOKENS_PER_RANK = 32          # [seq/tp = 16, batch = 2]
HIDDEN, LOCAL_FFN = 64, 32    # column: HIDDEN -> LOCAL_FFN per rank; row: LOCAL_FFN per rank -> HIDDEN
BACKWARD_SEED = 7
RECIPES = {
    "default": nv.NVFP4Recipe(),
    "no_rht_no_sr_1d": nv.NVFP4Recipe(rht=False, stochastic_rounding=False, weight_2d=False),
    "row_scaled": nv.NVFP4Recipe(rht=False, stochastic_rounding=False, row_scaled_activation=True),
}


@contextlib.contextmanager
def count_calls(*targets):
    """Count calls of module functions (module, name) while inside; yields {name: count}."""
    counts, originals = {}, []
    for module, name in targets:
        original = getattr(module, name)
        originals.append((module, name, original))
        counts[name] = 0

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        setattr(module, name, counted)
    try:
        yield counts
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


SPIED = ((O, "ring_all_gather_consume"), (O, "ring_reduce_scatter_produce"),
         (collectives, "all_gather_nvfp4"), (collectives, "reduce_scatter_bf16"),
         (O, "split_gathered_gemm"), (O, "split_gemm_reduce_scatter"))


def inputs(world_size, in_features, out_features, sequence_split):
    """x and dy for this test: full tensors [seq, batch, features] from a fixed generator."""
    generator = torch.Generator().manual_seed(123)
    seq = TOKENS_PER_RANK // 2 * world_size
    x = (torch.randn(seq, 2, in_features, generator=generator) * torch.logspace(-1, 1, in_features)).bfloat16()
    dy = torch.randn(seq, 2, out_features, generator=generator).bfloat16()
    return x, dy


def run_layer(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y, returned_bias = layer(x)
    torch.manual_seed(BACKWARD_SEED)
    y.backward(dy)
    bias_grad = None if layer.bias is None else layer.bias.grad
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": bias_grad}


def plain_and_overlapped(make_layer, x, dy, transport):
    """(plain results, overlapped results, call counts of the overlapped run)."""
    plain = run_layer(make_layer(), x, dy)
    layer = make_layer()
    layer.comm = O.overlapped_comm(layer.comm, transport=transport)
    with count_calls(*SPIED) as counts:
        overlapped = run_layer(layer, x, dy)
    return plain, overlapped, counts


def assert_equal(got, expected, what):
    if expected is None:
        assert got is None, what
        return
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    assert torch.equal(got, expected), f"{what}: max diff {(got.float() - expected.float()).abs().max().item()}"


def assert_reduce_scatter_close(got, expected, partial, world_size, what):
    """Two reduce-scatters of `partial` (this rank's [M, N] partial) summed in different orders."""
    if world_size == 2:
        assert_equal(got, expected, what)
        return
    magnitude = partial.double().abs()
    dist.all_reduce(magnitude)
    magnitude = magnitude.chunk(world_size)[dist.get_rank()].reshape(got.shape)
    bound = 2 * (world_size - 1) * 2.0 ** -8 * magnitude
    excess = (got.double() - expected.double()).abs() - bound
    assert bool((excess <= 0).all()), f"{what}: exceeds the ring/NCCL summation-order bound by {excess.max().item()}"


def expected_path_counts(transport: str, ring_gathers: int) -> dict:
    """Call counts of an overlapped layer's forward + backward on `transport` (one all-gather side, one
    reduce-scatter side). On the ring, `ring_gathers` all_gather_nvfp4 calls happen outside it. On split
    collectives, each side's collectives are one per row piece (COLLECTIVE_PIECES of this test's rows), plus one
    all-gather of the columnwise copy (carried, or re-gathered for wgrad)."""
    pieces = O.collective_pieces(TOKENS_PER_RANK)
    assert pieces == 2  # 32 rows: pipelined, and a test of how pieces are placed
    if transport == "ring":
        return {"ring_all_gather_consume": 1, "ring_reduce_scatter_produce": 1, "all_gather_nvfp4": ring_gathers,
                "reduce_scatter_bf16": 0, "split_gathered_gemm": 0, "split_gemm_reduce_scatter": 0}
    return {"ring_all_gather_consume": 0, "ring_reduce_scatter_produce": 0, "all_gather_nvfp4": pieces + 1,
            "reduce_scatter_bf16": pieces, "split_gathered_gemm": 1, "split_gemm_reduce_scatter": 1}


def check_column(rank, world_size, recipe, sequence_parallel=True, keep_input_columnwise=False, transport="ring"):
    out_features = LOCAL_FFN * world_size
    x, dy = inputs(world_size, HIDDEN, out_features, sequence_parallel)
    x_local = x.chunk(world_size)[rank] if sequence_parallel else x
    dy_local = dy.chunk(world_size, dim=-1)[rank]

    def make_layer():
        torch.manual_seed(1)  # same weights and bias for both runs
        layer = ColumnParallelLinear(HIDDEN, out_features, sequence_parallel=sequence_parallel, recipe=recipe,
                                     keep_input_columnwise=keep_input_columnwise)
        with torch.no_grad():
            layer.bias.uniform_(-1, 1)
        return layer

    plain, overlapped, counts = plain_and_overlapped(make_layer, x_local, dy_local, transport)
    what = f"column {recipe} sp={sequence_parallel} keep={keep_input_columnwise} {transport} rank={rank}"
    for name in ("y", "dw", "db"):
        assert_equal(overlapped[name], plain[name], f"{what} {name}")
    if not sequence_parallel:
        assert_equal(overlapped["dx"], plain["dx"], what + " dx")
        assert counts == dict.fromkeys(counts, 0), (what, counts)
        return
    assert counts == expected_path_counts(transport, 0 if keep_input_columnwise else 1), (what, counts)
    # This rank's dgrad partial [tokens, in], as both paths compute it, for the summation bound.
    layer = make_layer()
    weight_q = layer.weight_cache.get(layer.weight, recipe)
    dy2d = dy_local.reshape(-1, LOCAL_FFN)
    torch.manual_seed(BACKWARD_SEED)
    sr_seed = ops.draw_sr_seed() if recipe.stochastic_rounding else None
    dyq = quantize_operand(dy2d, "gradient", recipe, rowwise=True, columnwise=False, sr_seed=sr_seed)
    partial = gemm(dyq, weight_q, a_copy="rowwise", b_copy="columnwise", out_dtype=torch.bfloat16)
    assert_reduce_scatter_close(overlapped["dx"], plain["dx"], partial, world_size, what + " dx")


def check_row(rank, world_size, recipe, sequence_parallel=True, transport="ring"):
    in_features = LOCAL_FFN * world_size
    x, dy = inputs(world_size, in_features, HIDDEN, sequence_parallel)
    x_local = x.chunk(world_size, dim=-1)[rank]
    dy_local = dy.chunk(world_size)[rank] if sequence_parallel else dy

    def make_layer():
        torch.manual_seed(2)
        # skip_bias_add: y is the reduced sum itself (the bias add after it is common code).
        return RowParallelLinear(in_features, HIDDEN, sequence_parallel=sequence_parallel, recipe=recipe,
                                 skip_bias_add=True)

    plain, overlapped, counts = plain_and_overlapped(make_layer, x_local, dy_local, transport)
    what = f"row {recipe} sp={sequence_parallel} {transport} rank={rank}"
    for name in ("dx", "dw", "db"):
        assert_equal(overlapped[name], plain[name], f"{what} {name}")
    if not sequence_parallel:
        assert_equal(overlapped["y"], plain["y"], what + " y")
        assert counts == dict.fromkeys(counts, 0), (what, counts)
        return
    assert counts == expected_path_counts(transport, 0), (what, counts)
    layer = make_layer()
    weight_q = layer.weight_cache.get(layer.weight, recipe)
    xq = quantize_operand(x_local.reshape(-1, LOCAL_FFN), "activation", recipe, columnwise=False)
    partial = gemm(xq, weight_q, out_dtype=torch.bfloat16)
    assert_reduce_scatter_close(overlapped["y"], plain["y"], partial, world_size, what + " y")


def check_minimum_ring_step(rank, world_size):
    """recipe.overlap_min_chunk_gflops: a layer whose ring steps are smaller takes the plain path in forward and
    backward (its results are the plain layer's, bit for bit); at 0 it goes round the ring."""
    recipe = RECIPES["default"].replace(overlap_measure_links=False)  # the floor alone decides here

    def make_column(overlap, minimum):
        torch.manual_seed(1)
        return ColumnParallelLinear(HIDDEN, LOCAL_FFN * world_size, sequence_parallel=True, keep_input_columnwise=True,
                                    recipe=recipe.replace(overlap=overlap, overlap_min_chunk_gflops=minimum))

    def make_row(overlap, minimum):
        torch.manual_seed(2)
        return RowParallelLinear(LOCAL_FFN * world_size, HIDDEN, sequence_parallel=True, skip_bias_add=True,
                                 recipe=recipe.replace(overlap=overlap, overlap_min_chunk_gflops=minimum))

    column_x, column_dy = inputs(world_size, HIDDEN, LOCAL_FFN * world_size, True)
    row_x, row_dy = inputs(world_size, LOCAL_FFN * world_size, HIDDEN, True)
    for make, x, dy in ((make_column, column_x.chunk(world_size)[rank], column_dy.chunk(world_size, dim=-1)[rank]),
                        (make_row, row_x.chunk(world_size, dim=-1)[rank], row_dy.chunk(world_size)[rank])):
        plain = run_layer(make(False, 0), x, dy)
        small = make(True, 1)  # these layers' ring steps are ~1e-4 GFLOP
        with count_calls(*SPIED) as counts:
            got = run_layer(small, x, dy)
        assert counts["ring_all_gather_consume"] == counts["ring_reduce_scatter_produce"] == 0, counts
        assert not small._overlapped_comm.pipelined
        for name in ("y", "dx", "dw", "db"):
            assert_equal(got[name], plain[name], f"{make.__name__} below the minimum: {name}")
        with count_calls(*SPIED) as counts:
            run_layer(make(True, 0), x, dy)
        assert counts["ring_all_gather_consume"] == counts["ring_reduce_scatter_produce"] == 1, counts


def test_ring_step_gflops():
    assert O.ring_step_gflops(8192, 8192, 2048) == 2 * 8192 * 8192 * 2048 / 1e9
    with pytest.raises(ValueError, match="min_chunk_gflops"):
        O.overlapped_comm(O.OverlappedRowParallelComm(None, True), -1)


def gradient_shard_and_weight(rank, world_size, tokens_per_rank=TOKENS_PER_RANK):
    """This rank's quantized gradient rows (both copies, amaxes shared over the group), a quantized weight, and the
    plain all-gather of the gradient: the operands of the pipelined GEMMs' own checks."""
    recipe = RECIPES["default"]
    torch.manual_seed(3)
    full = torch.randn(world_size * tokens_per_rank, HIDDEN).bfloat16()
    local = full.chunk(world_size)[rank]
    amaxes = list(operand_amaxes(local, "gradient", recipe))
    all_reduce_amax(amaxes)
    q = quantize_operand(local, "gradient", recipe, amax_rowwise=amaxes[0], amax_columnwise=amaxes[1], sr_seed=99,
                         sr_row_offset=rank * tokens_per_rank)
    weight_q = ops.quantize(torch.randn(LOCAL_FFN, HIDDEN), "weight", recipe=recipe)
    return q, weight_q, all_gather_nvfp4(q)


def check_ring_gemms(rank, world_size):
    """The pipelined GEMMs on their own: chunk order, the rows each step produces, the carried columnwise copy."""
    q, weight_q, gathered = gradient_shard_and_weight(rank, world_size)

    # All-gather side: chunks consumed from ranks rank, rank-1, ...; each fills its own rows.
    sources = []
    with count_calls((O, "gemm")) as counts:
        original_chunk = O.rowwise_chunk

        def recording_chunk(q_, pieces):
            chunk = original_chunk(q_, pieces)
            matches = [r for r in range(world_size) if torch.equal(
                chunk.rowwise_data, gathered.rowwise_data[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK])]
            sources.append(matches)
            return chunk
        O.rowwise_chunk = recording_chunk
        try:
            carry = O.ColumnwiseCarry(q.columnwise_only(), None)
            y = O.ring_gathered_gemm(q.rowwise_only(), weight_q, b_copy="rowwise", out_dtype=torch.float32,
                                     carry=carry)
        finally:
            O.rowwise_chunk = original_chunk
    assert counts["gemm"] == world_size
    assert sources == [[source] for source in O.all_gather_order(rank, world_size)], sources
    assert torch.equal(y, gemm(gathered, weight_q, out_dtype=torch.float32))
    carried = carry.finish()
    expected = gathered.columnwise_only()
    for name in ("columnwise_data", "columnwise_scale", "amax_columnwise"):
        assert torch.equal(getattr(carried, name).view(torch.uint8), getattr(expected, name).view(torch.uint8)), name
    assert carried.shape == expected.shape and carried.rht == expected.rht
    # Without a ring to ride, the carry gathers on demand.
    assert torch.equal(O.ColumnwiseCarry(q.columnwise_only(), None).finish().columnwise_data,
                       expected.columnwise_data)

    # Reduce-scatter side: step i computes the rows destined for rank (rank - i - 1) mod W.
    produced = []
    original_gemm = O.gemm

    def recording_gemm(a, *args, **kwargs):
        start = (a.rowwise_data.data_ptr() - gathered_rows.rowwise_data.data_ptr()) // a.rowwise_data.stride(0)
        produced.append((start, a.rows))
        return original_gemm(a, *args, **kwargs)
    gathered_rows = gathered.rowwise_only()
    O.gemm = recording_gemm
    try:
        summed = O.ring_gemm_reduce_scatter(gathered_rows, weight_q, b_copy="rowwise", out_dtype=torch.float32)
    finally:
        O.gemm = original_gemm
    chunk_rows = TOKENS_PER_RANK
    assert produced == [(c * chunk_rows, chunk_rows) for c in O.reduce_scatter_order(rank, world_size)], produced
    # Every rank's partial is the same gathered GEMM here, so the exact sum is W times this rank's rows.
    own_rows = gemm(gathered, weight_q, out_dtype=torch.float32)[rank * chunk_rows:(rank + 1) * chunk_rows]
    torch.testing.assert_close(summed, own_rows * world_size, rtol=world_size * 2.0 ** -23, atol=0)
    with pytest.raises(ValueError, match="divisible"):
        O.ring_gemm_reduce_scatter(q.rowwise_rows(0, TOKENS_PER_RANK - 1), weight_q,
                                   b_copy="rowwise", out_dtype=torch.float32)


def check_split_gemms(rank, world_size):
    """The GEMMs on split collectives on their own: every piece's rows land where the plain gather puts them, the
    carried columnwise copy, the reduce-scatter's sums, the work that hides the last transfer."""
    q, weight_q, gathered = gradient_shard_and_weight(rank, world_size)
    expected = gemm(gathered, weight_q, out_dtype=torch.float32)
    for pieces in (None, 1, 2, 4):
        carry = O.ColumnwiseCarry(q.columnwise_only(), None)
        with count_calls((O, "gemm")) as counts:
            y = O.split_gathered_gemm(q.rowwise_only(), weight_q, b_copy="rowwise", out_dtype=torch.float32,
                                      carry=carry, pieces=pieces)
        assert counts["gemm"] == 1 + (world_size - 1) * (pieces or 2), (pieces, counts)  # own rows: one GEMM
        assert torch.equal(y, expected), pieces
        carried = carry.finish()
        for name in ("columnwise_data", "columnwise_scale"):
            assert torch.equal(getattr(carried, name).view(torch.uint8), getattr(gathered, name).view(torch.uint8))
        assert carried.shape == gathered.shape
    with pytest.raises(ValueError, match="pieces=3"):
        O.split_gathered_gemm(q.rowwise_only(), weight_q, b_copy="rowwise", out_dtype=torch.float32, pieces=3)

    # Reduce-scatter: every rank's partial is the same gathered GEMM here, so the exact sum is W times its rows.
    own_rows = expected[rank * TOKENS_PER_RANK:(rank + 1) * TOKENS_PER_RANK]
    gathered_rows = gathered.rowwise_only()
    for pieces in (None, 1, 4):
        events = []
        original_gemm = O.gemm

        def recording_gemm(a, *args, **kwargs):
            events.append("gemm")
            return original_gemm(a, *args, **kwargs)
        O.gemm = recording_gemm
        try:
            summed = O.split_gemm_reduce_scatter(gathered_rows, weight_q, b_copy="rowwise", out_dtype=torch.float32,
                                                 pieces=pieces, during_last_transfer=lambda: events.append("last"))
        finally:
            O.gemm = original_gemm
        # one GEMM per piece, on every destination's rows of it
        assert events == ["gemm"] * (pieces or 2) + ["last"], events
        torch.testing.assert_close(summed, own_rows * world_size, rtol=world_size * 2.0 ** -23, atol=0)
    with pytest.raises(ValueError, match="divisible"):
        O.split_gemm_reduce_scatter(q.rowwise_rows(0, TOKENS_PER_RANK - 1), weight_q, b_copy="rowwise",
                                    out_dtype=torch.float32)
    with pytest.raises(ValueError, match="pieces=0"):
        O.split_gemm_reduce_scatter(gathered_rows, weight_q, b_copy="rowwise", out_dtype=torch.float32, pieces=0)
    check_sized_split_gemms(rank, world_size)
    # The reduce-scatter into a given slice, asynchronously, and a slice that does not fit.
    partial = torch.arange(world_size * 4 * 3, dtype=torch.float32).reshape(world_size * 4, 3) * (rank + 1)
    out = torch.zeros(2 * 4, 3)
    work, finish = collectives.reduce_scatter_bf16(partial, async_op=True, out=out[4:])
    total = sum(range(1, world_size + 1))
    assert torch.equal(finish(), partial.chunk(world_size)[rank] / (rank + 1) * total)
    assert torch.equal(out[4:], partial.chunk(world_size)[rank] / (rank + 1) * total) and not out[:4].any()
    with pytest.raises(ValueError, match="expected a contiguous"):
        collectives.reduce_scatter_bf16(partial, out=torch.zeros(4, 2))


def check_sized_split_gemms(rank, world_size):
    """Pieces of unequal row counts (split_pieces' growing and shrinking ones, and uneven ones given by hand): the
    same rows as the plain gather and the same sums as equal pieces, one collective per piece."""
    rows = 128
    q, weight_q, gathered = gradient_shard_and_weight(rank, world_size, rows)
    expected = gemm(gathered, weight_q, out_dtype=torch.float32)
    own_rows = expected[rank * rows:(rank + 1) * rows]
    for counts in (O.split_pieces(rows, 0.5), O.split_pieces(rows, 2.0), [16, 112], [96, 16, 16]):
        assert len(set(counts)) > 1 and sum(counts) == rows, counts
        with count_calls((collectives, "all_gather_nvfp4"), (collectives, "reduce_scatter_bf16")) as calls:
            y = O.split_gathered_gemm(q.rowwise_only(), weight_q, b_copy="rowwise", out_dtype=torch.float32,
                                      pieces=counts)
            summed = O.split_gemm_reduce_scatter(gathered.rowwise_only(), weight_q, b_copy="rowwise",
                                                 out_dtype=torch.float32, pieces=counts)
        assert calls == {"all_gather_nvfp4": len(counts), "reduce_scatter_bf16": len(counts)}, (counts, calls)
        assert torch.equal(y, expected), counts
        torch.testing.assert_close(summed, own_rows * world_size, rtol=world_size * 2.0 ** -23, atol=0)
    for counts in ([16, 96], [0, 128], [64.0, 64], []):
        with pytest.raises(ValueError, match="adding up to 128"):
            O.split_gathered_gemm(q.rowwise_only(), weight_q, b_copy="rowwise", out_dtype=torch.float32,
                                  pieces=counts)


@pytest.mark.parametrize("row_scaled", [False, True])
def test_rowwise_row_ranges_stack_the_rows_as_quantized(row_scaled):
    """The stacked row blocks (one GEMM operand of a split reduce-scatter's piece) hold exactly the bytes, scales
    and per-row amaxes of those rows, and the GEMM on them equals those rows of the GEMM on the whole tensor."""
    recipe = RECIPES["row_scaled" if row_scaled else "no_rht_no_sr_1d"]
    torch.manual_seed(3)
    q = quantize_operand(torch.randn(96, HIDDEN), "activation", recipe, columnwise=True)
    weight_q = quantize_operand(torch.randn(LOCAL_FFN, HIDDEN), "weight", recipe)
    ranges = [(64, 80), (16, 32), (32, 48)]
    stacked = q.rowwise_row_ranges(ranges)
    rows = torch.cat([torch.arange(start, stop) for start, stop in ranges])
    assert stacked.shape == (48, HIDDEN) and not stacked.has_columnwise
    assert torch.equal(stacked.rowwise_data, q.rowwise_data[rows])
    assert torch.equal(stacked.rowwise_scale.view(torch.uint8), q.rowwise_scale.view(torch.uint8)[rows])
    assert torch.equal(stacked.amax_rowwise, q.amax_rowwise[rows] if row_scaled else q.amax_rowwise)
    assert torch.equal(gemm(stacked, weight_q, out_dtype=torch.float32),
                       gemm(q.rowwise_only(), weight_q, out_dtype=torch.float32)[rows])
    assert q.rowwise_row_ranges([(16, 48)]).rowwise_data.data_ptr() == q.rowwise_data[16:].data_ptr()  # a view


def test_collective_pieces():
    """Up to COLLECTIVE_PIECES pieces of whole 16-row blocks, else one."""
    assert [O.collective_pieces(rows) for rows in (4096, 64, 48, 32, 40, 16, 8)] == [4, 4, 3, 2, 1, 1, 1]
    assert O.collective_pieces(4096, most=2) == 2


def test_split_pieces_sizes():
    """collective_pieces(rows) pieces of whole 16-row blocks in geometric proportion, adding up to rows."""
    assert O.split_pieces(4096) == [1024] * 4
    assert O.split_pieces(4096, 2.0) == [272, 544, 1088, 2192]  # 256 blocks in the shares 1 : 2 : 4 : 8
    assert O.split_pieces(4096, 0.5) == [2192, 1088, 544, 272]
    assert O.split_pieces(128, 2.0) == [16, 16, 32, 64]  # every piece keeps at least one block
    assert O.split_pieces(64, 2.0) == [16] * 4 and O.split_pieces(40, 2.0) == [40] and O.split_pieces(8) == [8]
    for rows in range(16, 2048 + 1, 16):
        for ratio in (0.5, 0.8, 1.0, 1.5, 2.0):
            counts = O.split_pieces(rows, ratio)
            assert sum(counts) == rows and len(counts) == O.collective_pieces(rows), (rows, ratio, counts)
            assert all(c > 0 and c % 16 == 0 for c in counts), (rows, ratio, counts)
            ordered = counts if ratio >= 1 else counts[::-1]
            assert ordered == sorted(ordered), (rows, ratio, counts)
    assert O.piece_bounds(96, [16, 80]) == [(0, 16), (16, 96)]
    assert O.piece_bounds(96, None) == [(0, 32), (32, 64), (64, 96)]
    with pytest.raises(ValueError, match="ratio"):
        O.split_pieces(4096, 0.0)


def _check(rank, world_size, which):
    if which == "ring":
        check_ring_gemms(rank, world_size)
        check_minimum_ring_step(rank, world_size)
    elif which == "split":
        check_split_gemms(rank, world_size)
    elif which.startswith("column"):
        transport = which.partition(" ")[2]
        check_column(rank, world_size, RECIPES["default"], transport=transport)
        check_column(rank, world_size, RECIPES["default"], keep_input_columnwise=True, transport=transport)
        check_column(rank, world_size, RECIPES["no_rht_no_sr_1d"], transport=transport)
        check_column(rank, world_size, RECIPES["row_scaled"], transport=transport)
        check_column(rank, world_size, RECIPES["default"], sequence_parallel=False, transport=transport)
    else:
        transport = which.partition(" ")[2]
        check_row(rank, world_size, RECIPES["default"], transport=transport)
        check_row(rank, world_size, RECIPES["no_rht_no_sr_1d"], transport=transport)
        check_row(rank, world_size, RECIPES["row_scaled"], transport=transport)
        check_row(rank, world_size, RECIPES["default"], sequence_parallel=False, transport=transport)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("which", ["ring", "split", "column ring", "row ring", "column collectives",
                                   "row collectives"])
def test_overlapped_layers_match_plain(which, world_size):
    run_distributed(_check, world_size, which)


def test_overlapped_comm_selects_twin_and_rejects_others():
    from nvfp4_dist.linear import LinearComm
    from nvfp4_dist.parallel.layer_comm import ColumnParallelComm, RowParallelComm
    column = O.overlapped_comm(ColumnParallelComm(None, True, True))
    assert isinstance(column, O.OverlappedColumnParallelComm) and column.keep_input_columnwise
    row = O.overlapped_comm(RowParallelComm(None, True))
    assert isinstance(row, O.OverlappedRowParallelComm) and row.sequence_parallel
    assert O.overlapped_comm(row) is row
    with pytest.raises(ValueError, match="ColumnParallelComm and RowParallelComm"):
        O.overlapped_comm(LinearComm())
