"""benchmarks/moe.py counts exactly the dispatch bytes: every routed row once, H*2 bytes in BF16 and
H/2 + H/16 + 4 bytes in NVFP4, and the rows it dispatches arrive (EP=2 and 4 on gloo)."""
import argparse

import pytest
import torch

from nvfp4_dist.parallel import moe_dispatch
from tests.helpers.benchmarks import load_benchmark_module
from tests.helpers.distributed import run_distributed

HIDDEN, TOKENS, EXPERTS, TOPK = 256, 48, 8, 2


def _count(rank, world_size):
    bench = load_benchmark_module("moe")
    args = argparse.Namespace(hidden=HIDDEN, tokens=TOKENS, experts=EXPERTS, topk=TOPK, ep=world_size)
    counted = bench.count_bytes(args, rank, torch.device("cpu"))
    routed = TOKENS * TOPK
    assert counted["routed_rows"] == routed
    assert counted["bf16_bytes"] == routed * HIDDEN * 2
    assert counted["nvfp4_bytes"] == routed * moe_dispatch.row_bytes(HIDDEN)
    assert counted["probs_bytes"] == routed * 4
    rows, sent = bench.routed_tokens(args, rank, torch.device("cpu"))
    assert sum(sent) == routed and counted["rows_leaving_rank"] == routed - sent[rank]


@pytest.mark.parametrize("world_size", [2, 4])
def test_counted_bytes_are_the_routed_rows(world_size):
    run_distributed(_count, world_size)


def test_ratio_and_target():
    bench = load_benchmark_module("moe")
    args = argparse.Namespace(hidden=4096)
    rows = [{"bf16_bytes": 1024 * 4096 * 2, "nvfp4_bytes": 1024 * moe_dispatch.row_bytes(4096), "probs_bytes": 4096}]
    summary = bench.summarise(rows, args)
    assert summary["ratio"] == pytest.approx(summary["expected_ratio"]) == pytest.approx(0.28125 + 2 / 4096)
    assert summary["ratio"] <= bench.TARGET_BYTE_RATIO
