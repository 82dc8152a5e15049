"""benchmarks/param_gather.py counts exactly the bytes FSDP2 gathers: every parameter twice per step (forward and
backward's re-gather), the NVFP4 weights as their wire pieces, everything else in BF16."""
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
