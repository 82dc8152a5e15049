"""The overlap's link-aware choice (parallel/link_speed.py, overlap._RingChoice) on its own and on gloo groups.

The model: a ring step saves (c + g - max(r, g)) over the plain path, c / r the collective's / ring's transfer of
the step's bytes, g its GEMM; split collectives of k pieces save (k-1)/k min(C, G) of the plain path's collective
C = (W-1) c and GEMMs G = W g. Checked by hand on small numbers, on the speeds that 4 x H100 links show (NVLink,
no peer-to-peer through host memory, NCCL's socket transport) for the MLP pair (16384 tokens, 8192 -> 28672 ->
8192, TP4), and through real processes: the measurement runs on the group's own rings and collectives, is
agreed (MAX of ring times, MIN of collective and GEMM times) so every rank takes the same path even where
their own timings disagree, is measured once per group, and the layers' results equal the plain path's.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from nvfp4_dist.parallel import link_speed as L
from nvfp4_dist.parallel import overlap as O
from tests.helpers.distributed import run_distributed

MB = 2 ** 20
TOKENS, HIDDEN, FFN, TP = 16384, 8192, 28672, 4


def speed(collective_ms_per_mb, ring_over_collective, gemm_ms_per_gflop):
    return L.LinkSpeed(all_gather_ms_per_mb=collective_ms_per_mb,
                       ring_all_gather_ms_per_mb=collective_ms_per_mb * ring_over_collective,
                       reduce_scatter_ms_per_mb=collective_ms_per_mb,
                       ring_reduce_scatter_ms_per_mb=collective_ms_per_mb * ring_over_collective,
                       gemm_ms_per_gflop=gemm_ms_per_gflop)


def test_saving_follows_the_step_model():
    link = speed(1.0, 2.0, 1.0)  # c = 1 ms/MB, r = 2 ms/MB, g = 1 ms/GFLOP
    # r > g: (W-1) (c + g - r); 2 MB, 3 GFLOP per step on 4 ranks: 3 * (2 + 3 - 4) = 3
    assert link.ring_saving_ms([L.RingLoad("all_gather", 2 * MB, 3.0)], 4) == pytest.approx(3.0)
    # r <= g: the whole collective is saved, 3 * c
    assert link.ring_saving_ms([L.RingLoad("reduce_scatter", 1 * MB, 5.0)], 4) == pytest.approx(3.0)
    # transfers much slower than the GEMM can hide, and slower on the ring: a loss of 3 * (4 + 0.5 - 8)
    assert link.ring_saving_ms([L.RingLoad("all_gather", 4 * MB, 0.5)], 4) == pytest.approx(-10.5)
    # the rings of a layer add up
    loads = [L.RingLoad("all_gather", 2 * MB, 3.0), L.RingLoad("all_gather", 4 * MB, 0.5)]
    assert link.ring_saving_ms(loads, 4) == pytest.approx(3.0 - 10.5)
    assert L.nvfp4_bytes(32, 64) == 32 * 64 // 2 + 32 * 64 // 16


def test_split_saving_follows_its_model():
    link = speed(1.0, 2.0, 1.0)
    # 2 MB, 3 GFLOP per step on 4 ranks: C = 3 * 2 = 6, G = 4 * 3 = 12; 4 pieces hide 3/4 of min(C, G)
    load = L.RingLoad("all_gather", 2 * MB, 3.0)
    assert link.split_saving_ms([load], 4, 4) == pytest.approx(4.5)
    assert link.plain_ms([load], 4) == pytest.approx(18.0)
    # one piece hides nothing; the loads of a layer add up
    assert link.split_saving_ms([load], 4, 1) == 0
    assert link.split_saving_ms([load, L.RingLoad("reduce_scatter", 4 * MB, 0.5)], 4, 2) == pytest.approx(3 + 1)


def test_split_piece_ratio_follows_its_model():
    link = speed(1.0, 2.0, 1.0)  # c = 1 ms/MB, g = 1 ms/GFLOP
    # reduce-scatter: pieces growing 3x where C = (W-1) c >= 2 G = 2 W g, else equal
    assert link.split_piece_ratio(L.RingLoad("reduce_scatter", 4 * MB, 0.5), 4) == 3.0      # C = 12, G = 2
    assert link.split_piece_ratio(L.RingLoad("reduce_scatter", 8 * MB, 3.0), 4) == 3.0      # C = 24, G = 12
    assert link.split_piece_ratio(L.RingLoad("reduce_scatter", 8 * MB, 3.01), 4) == 1.0     # just under 2 G
    assert link.split_piece_ratio(L.RingLoad("reduce_scatter", 1 * MB, 3.0), 4) == 1.0      # GEMMs outlast
    # all-gather: equal pieces, whatever the speeds
    for load in (L.RingLoad("all_gather", 8 * MB, 1.0), L.RingLoad("all_gather", 1 * MB, 8.0)):
        assert link.split_piece_ratio(load, 4) == 1.0
    assert L.piece_fractions(3, 2.0) == pytest.approx([1 / 7, 2 / 7, 4 / 7]) and L.piece_fractions(1, 0.5) == [1.0]
    for pieces, ratio in ((0, 1.0), (2, 0.0), (2, float("nan"))):
        with pytest.raises(ValueError, match="ratio"):
            L.piece_fractions(pieces, ratio)


def mlp_pair_loads(tp=TP):
    """The rings of the MLP pair's column and row layer (forward and backward), as the comms describe them."""
    rows, ffn_local = TOKENS // tp, FFN // tp
    step_gflops = O.ring_step_gflops(rows, ffn_local, HIDDEN)  # the same for both layers
    column = [L.RingLoad("all_gather", L.nvfp4_bytes(rows, HIDDEN), step_gflops),
              L.RingLoad("reduce_scatter", rows * HIDDEN * 2, step_gflops)]
    row = [L.RingLoad("reduce_scatter", rows * HIDDEN * 2, step_gflops),
           L.RingLoad("all_gather", 2 * L.nvfp4_bytes(rows, HIDDEN), step_gflops)]
    return column, row


# ms per MB of one ring step and ms per GFLOP, in the class of 4 x H100 links: NVLink (~250 GB/s bus), no
# peer-to-peer through host memory (~25 GB/s; ring 9 % slower), NCCL sockets over loopback (~2.8 GB/s; ring 1.6x).
H100_GEMM_MS_PER_GFLOP = 16.4 / (6 * 4 * 481.0)   # the pair's 24 ring-step GEMMs of 481 GFLOP in 16.4 ms
LINKS = {"nvlink": speed(0.004, 1.14, H100_GEMM_MS_PER_GFLOP),
         "slow": speed(0.04, 1.09, H100_GEMM_MS_PER_GFLOP),
         "socket": speed(0.36, 1.6, H100_GEMM_MS_PER_GFLOP)}


@pytest.mark.parametrize("links, ring_wins", [("nvlink", True), ("slow", True), ("socket", False)])
def test_mlp_pair_choice_by_link_class(links, ring_wins):
    for loads in mlp_pair_loads():
        assert (LINKS[links].ring_saving_ms(loads, TP) > 0) == ring_wins


# Point-to-point transfers three times slower than the collective's (slow links' collective speed): the ring
# loses, split collectives hide most of the GEMMs' worth of communication.
SLOW_RINGS = speed(0.04, 3.0, H100_GEMM_MS_PER_GFLOP)


@pytest.mark.parametrize("transport, links, path", [
    ("auto", LINKS["nvlink"], "ring"),
    # the reduce-scatters' transfers outlast the GEMMs: the ring hides one GEMM per step, split collectives 3/4
    # of all of them
    ("auto", LINKS["slow"], "collectives"), ("ring", LINKS["slow"], "ring"),
    # split collectives over NVLink expected to save 11 % to 14 %: under MIN_SAVING_SHARE
    ("collectives", LINKS["nvlink"], "plain"),
    ("auto", SLOW_RINGS, "collectives"), ("ring", SLOW_RINGS, "plain"),
    # the GEMMs are too small against the transfers for either to pay
    ("auto", LINKS["socket"], "plain"), ("collectives", LINKS["socket"], "plain")])
def test_mlp_pair_path_by_link_class(transport, links, path, caplog):
    """The choice between the plain path, the ring and split collectives for the MLP pair's layers, logged once."""
    pieces = O.collective_pieces(TOKENS // TP)
    for loads in mlp_pair_loads():
        comm = O.OverlappedColumnParallelComm(None, True, False, measure_links=True, transport=transport)
        comm.world_size = TP  # the model only: no process group here
        L.set_link_speed(None, links)
        caplog.clear()
        try:
            with caplog.at_level("INFO", logger="nvfp4_dist"):
                assert comm.choose(481.0, loads, pieces, torch.device("cpu")) == path
                assert comm.choose(481.0, loads, pieces, torch.device("cpu")) == path
        finally:
            L.set_link_speed(None, None)
        (message,) = [record.getMessage() for record in caplog.records]
        assert f"OverlappedColumnParallelComm of the 4-rank group takes the {path} path" in message, message


def test_split_collectives_size_their_pieces_by_the_links(monkeypatch):
    """On slow links the MLP pair's column layer takes split collectives with its reduce-scatter's pieces growing
    (its transfers outlast its GEMMs) and its all-gather's equal; the pieces reach the split GEMMs. Without
    a known link speed all pieces are equal; on the ring there are none."""
    rows = TOKENS // TP
    column_loads, _ = mlp_pair_loads()
    calls = []
    monkeypatch.setattr(O, "split_gathered_gemm", lambda a, b, **kwargs: calls.append(("gather", kwargs["pieces"])))
    monkeypatch.setattr(O, "split_gemm_reduce_scatter",
                        lambda a, b, **kwargs: calls.append(("scatter", kwargs["pieces"])))
    a = dataclasses.make_dataclass("Rows", ["rows"])
    scatter_ratio = LINKS["slow"].split_piece_ratio(column_loads[1], TP)
    assert scatter_ratio == 3.0  # C = 2.8 G
    for links, known, path in (("slow", True, "collectives"), ("slow", False, "collectives"), ("nvlink", True, "ring")):
        comm = O.OverlappedColumnParallelComm(None, True, False, measure_links=known,
                                              transport="collectives" if path == "collectives" else "auto")
        comm.world_size = TP
        L.set_link_speed(None, LINKS[links] if known else None)
        try:
            assert comm.choose(481.0, column_loads, O.collective_pieces(rows), torch.device("cpu")) == path
        finally:
            L.set_link_speed(None, None)
        if path == "ring":
            assert comm.piece_ratios == {}
            continue
        calls.clear()
        comm.gathered_gemm(a(rows), None)
        comm.gemm_reduce_scatter(a(TP * rows), None)
        expected = [("gather", [1024] * 4), ("scatter", O.split_pieces(rows, scatter_ratio if known else 1.0))]
        assert calls == expected, (links, known, calls)
        assert (calls[1][1] == [1024] * 4) == (not known)


# Speeds that 2 x H100 groups measured (benchmarks/overlap.py): over NVLink the ring is expected to save 8 % to 12 %
# of the layers' plain time, under MIN_SAVING_SHARE (the pair ran 2 % to 5 % slower on the ring there); over slow
# links both paths save over a fifth, split collectives the most.
TP2_LINKS = {"nvlink": L.LinkSpeed(0.00774, 0.00840, 0.00812, 0.02924, 0.001931),
             "nvlink, another run": L.LinkSpeed(0.009068, 0.0115, 0.01018, 0.02152, 0.001874),
             "slow": L.LinkSpeed(0.04863, 0.05176, 0.04472, 0.05078, 0.001955)}


@pytest.mark.parametrize("transport, links, path", [
    ("ring", "nvlink", "plain"), ("auto", "nvlink", "plain"), ("collectives", "nvlink", "plain"),
    ("ring", "nvlink, another run", "plain"), ("auto", "nvlink, another run", "plain"),
    ("ring", "slow", "ring"), ("auto", "slow", "collectives"), ("collectives", "slow", "collectives")])
def test_a_saving_under_the_minimum_share_keeps_the_plain_path(transport, links, path):
    pieces = O.collective_pieces(TOKENS // 2)
    for loads in mlp_pair_loads(tp=2):
        speed = TP2_LINKS[links]
        best = max(speed.ring_saving_ms(loads, 2), speed.split_saving_ms(loads, 2, pieces))
        assert best > 0 and (best < O.MIN_SAVING_SHARE * speed.plain_ms(loads, 2)) == links.startswith("nvlink")
        comm = O.OverlappedColumnParallelComm(None, True, False, measure_links=True, transport=transport)
        comm.world_size = 2  # the model only: no process group here
        L.set_link_speed(None, speed)
        try:
            assert comm.choose(1924.0, loads, pieces, torch.device("cpu")) == path
        finally:
            L.set_link_speed(None, None)


def test_bad_speeds_and_loads_are_refused():
    with pytest.raises(ValueError, match="gemm_ms_per_gflop=0"):
        dataclasses.replace(LINKS["slow"], gemm_ms_per_gflop=0)
    with pytest.raises(ValueError, match="all_gather_ms_per_mb=nan"):
        dataclasses.replace(LINKS["slow"], all_gather_ms_per_mb=float("nan"))
    with pytest.raises(ValueError, match="kind='broadcast'"):
        L.RingLoad("broadcast", 1, 1.0)
    with pytest.raises(ValueError, match="step_bytes=-1"):
        L.RingLoad("all_gather", -1, 1.0)
    with pytest.raises(ValueError, match="speed must be a LinkSpeed"):
        L.set_link_speed(None, 1.0)
    with pytest.raises(ValueError, match="measure_links=1"):
        O.overlapped_comm(O.OverlappedRowParallelComm(None, True), 0, 1)


# ----------------------------------------------------------------------------------------------------------
# On gloo groups.

TOKENS_PER_RANK, LAYER_HIDDEN, LAYER_FFN_LOCAL = 32, 64, 32
PROBE_NAMES = ("all_gather", "ring_all_gather", "reduce_scatter", "ring_reduce_scatter", "gemm")


def fake_timings(per_rank_ms):
    """A stand-in for overlap._median_ms: the probes' ms in measure_link_speed's call order (4 transfers, GEMM)."""
    calls = []

    def median_ms(step, device, repeats, group=None):
        calls.append(step)
        return per_rank_ms[PROBE_NAMES[len(calls) - 1]]
    return median_ms, calls


def gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def check_agreement_across_ranks(rank, world_size):
    # Each rank sees other timings; alone, rank 0 would go round the ring (ring transfers faster than the
    # collective) and the last rank would not (ring 3x slower, tiny GEMMs).
    ring = 0.5 if rank == 0 else 3.0
    mine = {"all_gather": 1.0 + rank, "ring_all_gather": ring, "reduce_scatter": 2.0 - 0.1 * rank,
            "ring_reduce_scatter": ring, "gemm": 1e-3 * (rank + 1)}
    original = O._median_ms
    O._median_ms, calls = fake_timings(mine)
    try:
        link = O.measure_link_speed()
    finally:
        O._median_ms = original
    assert len(calls) == len(PROBE_NAMES)
    steps = world_size - 1
    gather_mb = steps * L.nvfp4_bytes(*O.PROBE_SHAPES["cpu"][0]) / MB
    scatter_mb = steps * O.PROBE_SHAPES["cpu"][1][0] * O.PROBE_SHAPES["cpu"][1][1] * 2 / MB
    size = O.PROBE_SHAPES["cpu"][2]
    expected = L.LinkSpeed(all_gather_ms_per_mb=1.0 / gather_mb, ring_all_gather_ms_per_mb=3.0 / gather_mb,
                           reduce_scatter_ms_per_mb=(2.0 - 0.1 * (world_size - 1)) / scatter_mb,
                           ring_reduce_scatter_ms_per_mb=3.0 / scatter_mb,
                           gemm_ms_per_gflop=1e-3 / O.ring_step_gflops(size, size, size))
    for name in PROBE_NAMES[:-1]:
        field = f"{name}_ms_per_mb"
        assert getattr(link, field) == pytest.approx(getattr(expected, field), rel=1e-12), field
    assert link.gemm_ms_per_gflop == pytest.approx(expected.gemm_ms_per_gflop, rel=1e-12)
    assert len(set(gathered(link))) == 1
    loads = [L.RingLoad("all_gather", 4096, 1e-4)]
    assert gathered(link.ring_saving_ms(loads, world_size) > 0) == [False] * world_size


def check_real_measurement(rank, world_size):
    """measure_link_speed on the gloo group's own rings and collectives: positive, the same on every rank, measured
    at the first use only, without drawing from torch's generator."""
    assert L.known_link_speed(None) is None
    counted = []
    original = O.measure_link_speed

    def counting(*args, **kwargs):
        counted.append(1)
        return original(*args, **kwargs)
    O.measure_link_speed = counting
    rng_state = torch.get_rng_state()
    try:
        first = O.group_link_speed(None, torch.device("cpu"))
        again = O.group_link_speed(dist.group.WORLD, torch.device("cpu"))
    finally:
        O.measure_link_speed = original
    assert counted == [1] and again is first and L.known_link_speed(None) is first
    assert torch.equal(torch.get_rng_state(), rng_state)  # SR seeds are drawn from it: the probes leave it alone
    assert all(getattr(first, field.name) > 0 for field in dataclasses.fields(first))
    assert len(set(gathered(first))) == 1
    L.set_link_speed(None, None)
    assert L.known_link_speed(dist.group.WORLD) is None


def run_pair(column, row, x, dy):
    x = x.clone().requires_grad_(True)
    y = row(torch.nn.functional.gelu(column(x)[0]))[0]
    torch.manual_seed(7)
    y.backward(dy)
    return [y.detach(), x.grad, column.weight.grad, column.bias.grad, row.weight.grad, row.bias.grad]


def make_pair(world_size, recipe):
    torch.manual_seed(3)
    column = ColumnParallelLinear(LAYER_HIDDEN, LAYER_FFN_LOCAL * world_size, sequence_parallel=True, recipe=recipe)
    row = RowParallelLinear(LAYER_FFN_LOCAL * world_size, LAYER_HIDDEN, sequence_parallel=True, recipe=recipe)
    return column, row


def check_layers_follow_the_agreed_choice(rank, world_size):
    """recipe.overlap=True with measured links: plain where the rings lose, ring where they win, the same on every
    rank; recipe.overlap_measure_links=False: the floor alone (no measurement). Weight and bias gradients equal the
    plain pair's bit for bit; outputs and input gradients too where the path is plain or the group has two ranks
    (the ring's reduce-scatter adds in another order)."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(world_size * TOKENS_PER_RANK, LAYER_HIDDEN, generator=generator).bfloat16().chunk(world_size)[rank]
    dy = torch.randn(world_size * TOKENS_PER_RANK, LAYER_HIDDEN, generator=generator).bfloat16().chunk(world_size)[rank]
    base = nv.NVFP4Recipe(overlap_min_chunk_gflops=0)
    plain = run_pair(*make_pair(world_size, base), x, dy)
    # Probe timings (ms): the collectives, the rings and the GEMM probe (see fake_timings).
    cases = {"losing rings, tiny GEMMs": ({"all_gather": 1.0, "ring_all_gather": 1.6 + 0.1 * rank,
                                           "reduce_scatter": 1.0, "ring_reduce_scatter": 1.6, "gemm": 1e-9}, "plain"),
             # rings faster than the collectives by more than MIN_SAVING_SHARE on every rank
             "winning rings": ({"all_gather": 1.0, "ring_all_gather": 0.6 + 0.05 * rank, "reduce_scatter": 1.0,
                                "ring_reduce_scatter": 0.7, "gemm": 1e-9}, "ring"),
             # transfers as long as the GEMMs, three times slower on the ring: split collectives hide them
             "slow rings": ({"all_gather": 1.0, "ring_all_gather": 3.0 + 0.1 * rank, "reduce_scatter": 1.0,
                             "ring_reduce_scatter": 3.0, "gemm": 4.0 + rank}, "collectives")}
    for name, (timings, expected_path) in cases.items():
        L.set_link_speed(None, None)
        original = O._median_ms
        O._median_ms, _ = fake_timings(timings)
        try:
            column, row = make_pair(world_size, base.replace(overlap=True, overlap_transport="auto"))
            with count_rings() as rings:
                got = run_pair(column, row, x, dy)
        finally:
            O._median_ms = original
        choices = (column._overlapped_comm.path, row._overlapped_comm.path)
        assert gathered(choices) == [(expected_path, expected_path)] * world_size, name
        # Forward and backward: column all-gather + row reduce-scatter, row all-gather + column reduce-scatter.
        expected_counts = dict.fromkeys(rings, 0)
        if expected_path == "ring":
            expected_counts.update(gather=2, scatter=2)
        elif expected_path == "collectives":
            expected_counts.update(split_gather=2, split_scatter=2)
        assert rings == expected_counts, (name, rings)
        for index in (2, 3, 4, 5):  # weight and bias gradients: all-gather side, bit-identical on every path
            assert torch.equal(got[index], plain[index]), (name, index)
        if world_size == 2 or expected_path == "plain":
            for a, b in zip(got, plain):
                assert torch.equal(a, b), name
    # The override: the floor alone decides, and nothing is measured.
    measured = []
    original = O.measure_link_speed
    O.measure_link_speed = lambda *a, **k: measured.append(1)
    try:
        L.set_link_speed(None, None)
        column, row = make_pair(world_size, base.replace(overlap=True, overlap_measure_links=False))
        with count_rings() as rings:
            run_pair(column, row, x, dy)
    finally:
        O.measure_link_speed = original
    assert not measured and rings["gather"] == 2 and rings["scatter"] == 2


class count_rings:
    """Counts the rings ("gather", "scatter") and split collectives ("split_gather", "split_scatter") run inside."""

    NAMES = {"gather": "ring_all_gather_consume", "scatter": "ring_reduce_scatter_produce",
             "split_gather": "split_gathered_gemm", "split_scatter": "split_gemm_reduce_scatter"}

    def __enter__(self):
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.originals = {key: getattr(O, name) for key, name in self.NAMES.items()}

        def counted(key):
            def call(*args, **kwargs):
                self.counts[key] += 1
                return self.originals[key](*args, **kwargs)
            return call
        for key, name in self.NAMES.items():
            setattr(O, name, counted(key))
        return self.counts

    def __exit__(self, *exc):
        for key, name in self.NAMES.items():
            setattr(O, name, self.originals[key])


def _check(rank, world_size, which):
    {"agreement": check_agreement_across_ranks, "measurement": check_real_measurement,
     "layers": check_layers_follow_the_agreed_choice}[which](rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("which", ["agreement", "measurement", "layers"])
def test_link_choice_on_gloo(which, world_size):
    run_distributed(_check, world_size, which)


def test_recipe_switch(monkeypatch):
    monkeypatch.delenv("NVFP4_OVERLAP_IGNORE_LINKS", raising=False)
    assert nv.NVFP4Recipe().overlap_measure_links and nv.NVFP4Recipe.from_env().overlap_measure_links
    monkeypatch.setenv("NVFP4_OVERLAP_IGNORE_LINKS", "1")
    assert not nv.NVFP4Recipe.from_env(overlap=True).overlap_measure_links
    monkeypatch.delenv("NVFP4_OVERLAP_TRANSPORT", raising=False)
    assert nv.NVFP4Recipe().overlap_transport == nv.NVFP4Recipe.from_env().overlap_transport == "auto"
    monkeypatch.setenv("NVFP4_OVERLAP_TRANSPORT", "collectives")
    assert nv.NVFP4Recipe.from_env().overlap_transport == "collectives"
    monkeypatch.setenv("NVFP4_OVERLAP_TRANSPORT", "split")
    with pytest.raises(ValueError, match="NVFP4_OVERLAP_TRANSPORT"):
        nv.NVFP4Recipe.from_env()
    with pytest.raises(ValueError, match="transport='split'"):
        O.overlapped_comm(O.OverlappedRowParallelComm(None, True), 0, False, "split")
