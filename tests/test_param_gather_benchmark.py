"""benchmarks/param_gather.py counts exactly the bytes FSDP2 gathers: every parameter twice per step (forward and
backward's re-gather), the NVFP4 weights as their wire pieces, everything else in BF16; and, with --megatron, the
bytes Megatron-Core's distributed optimizer hands to its param all-gather: its buckets' shards in BF16, or what the
NVFP4 gather reports it sent."""
import argparse

import pytest

import nvfp4_dist as nv
from nvfp4_dist import sharded_weight
from tests.helpers.benchmarks import load_benchmark_module
from tests.helpers.distributed import run_distributed

HIDDEN, LAYERS = 64, 1


def expected_bytes(world_size: int, recipe) -> dict:
    """Bytes per rank and step of each mode, from the model's parameter shapes."""
    weights = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN)]
    others = 3 * HIDDEN + HIDDEN + 4 * HIDDEN + HIDDEN + 4 * HIDDEN  # biases, two LayerNorms' weight and bias
    weight_elements = sum(rows * cols for rows, cols in weights)
    nvfp4_weights = sum(sharded_weight.wire_bytes((rows // world_size, cols), recipe) for rows, cols in weights)
    gathers = 2 * LAYERS
    return {"bf16": gathers * 2 * (weight_elements + others) // world_size,
            "nvfp4": gathers * (nvfp4_weights + 2 * others // world_size)}


def _count(rank, world_size):
    bench = load_benchmark_module("param_gather")
    args = argparse.Namespace(hidden=HIDDEN, layers=LAYERS, steps=2)
    for recipe in (nv.NVFP4Recipe(), nv.NVFP4Recipe(weight_2d=False)):
        expected = expected_bytes(world_size, recipe)
        for mode in ("bf16", "nvfp4"):
            counted = bench.run(mode, recipe, args, rank, world_size)
            assert counted["gathered_bytes_per_rank"] == expected[mode], (mode, recipe.weight_2d)
            assert counted["amax_allreduces"] == (1 if mode == "nvfp4" else 0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_counted_bytes_are_the_parameters(world_size):
    run_distributed(_count, world_size)


def test_ratio_below_target_for_16x16_blocks():
    expected = expected_bytes(2, nv.NVFP4Recipe())
    assert expected["nvfp4"] / expected["bf16"] <= load_benchmark_module("param_gather").TARGET_RATIO


def _megatron(rank, world_size):
    bench = load_benchmark_module("param_gather")
    args = argparse.Namespace(hidden=HIDDEN, layers=LAYERS, steps=2)
    everyone = bench.megatron_worker(rank, world_size, args)
    record = bench.megatron_record(everyone)
    weights = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN)]
    others = 3 * HIDDEN + HIDDEN + 4 * HIDDEN + HIDDEN + 4 * HIDDEN
    parameters = sum(rows * cols for rows, cols in weights) + others
    for counts, row in zip(everyone, record["per_rank"]):
        # Megatron's gather: one per step, every bucket's shard (the buckets padded for the distributed optimizer).
        assert counts["bf16"]["gathered_bytes_per_rank"] == counts["bf16"]["bucket_bf16_bytes_per_rank"]
        assert 2 * parameters // world_size <= row["bf16_bytes"] < 2 * parameters // world_size + 4096
        # The NVFP4 gather: all of it counted, the NVFP4 weights' shards plus the BF16 rest.
        assert row["nvfp4_bytes"] == counts["nvfp4"]["handle_bytes_sent"] > 0
        assert row["nvfp4_bytes"] >= sum(sharded_weight.wire_bytes((r // world_size, c), nv.NVFP4Recipe())
                                         for r, c in weights)
        assert row["ratio"] == row["nvfp4_bytes"] / row["bf16_bytes"] <= bench.TARGET_RATIO
    assert record["ratio"] == max(row["ratio"] for row in record["per_rank"])


def test_megatron_counts_the_distributed_optimizers_gather():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    run_distributed(_megatron, 2)
