"""Ring schedules of parallel/overlap.py on real gloo process groups (chunk order, rows produced)."""
import pytest
import torch

from nvfp4_dist.parallel.overlap import (all_gather_order, reduce_scatter_order, ring_all_gather_consume,
                                         ring_reduce_scatter_produce)
from tests.helpers.distributed import run_distributed


def test_orders_cover_every_rank_once_and_end_on_own_chunk():
    for world in (1, 2, 3, 4, 8):
        for rank in range(world):
            gather = all_gather_order(rank, world)
            scatter = reduce_scatter_order(rank, world)
            assert sorted(gather) == sorted(scatter) == list(range(world))
            assert gather[0] == rank and scatter[-1] == rank
    assert all_gather_order(1, 4) == [1, 0, 3, 2]
    assert reduce_scatter_order(1, 4) == [0, 3, 2, 1]


def _chunk(rank, rows=4, cols=6):
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1000 * rank


def _partial(rank, chunk, rows=4, cols=6):
    """Rank `rank`'s partial output rows for `chunk`: distinct per (rank, chunk), exact in BF16."""
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) % 7 + 8 * rank + chunk).bfloat16()


def _check_ring_schedules(rank, world):
    seen = []
    gathered = torch.zeros(world * 4, 6)

    def consume(tensors, source):
        seen.append(source)
        data, scale = tensors
        gathered[source * 4:(source + 1) * 4] = data + scale.float().sum()

    ring_all_gather_consume([_chunk(rank), torch.ones(2, dtype=torch.uint8) * rank], consume)
    assert seen == all_gather_order(rank, world), seen
    expected = torch.cat([_chunk(r) + 2 * r for r in range(world)])
    assert torch.equal(gathered, expected)

    produced = []

    def produce(chunk):
        produced.append(chunk)
        return _partial(rank, chunk)

    summed = ring_reduce_scatter_produce(produce)
    assert produced == reduce_scatter_order(rank, world), produced
    assert torch.equal(summed.float(), sum(_partial(r, rank).float() for r in range(world)))


@pytest.mark.parametrize("world", [2, 4])
def test_ring_schedules_on_gloo(world):
    run_distributed(_check_ring_schedules, world)
