"""A layer's collective that times out (3 gloo ranks, a tensor-parallel group with a short timeout): the ranks that
waited raise CollectiveTimeoutError naming the layer, the operation, the group and the rank that did not arrive,
instead of gloo's bare "Timed out waiting ... for recv operation".

- in forward: one rank never reaches the layer (the others wait in its first collective);
- in backward: one rank ran the forward under torch.no_grad() at a later call (compared only at the first call),
  so it never runs the backward's reduction.
"""
import contextlib
import datetime

import pytest
import torch
import torch.distributed as dist

from nvfp4_dist.parallel import ColumnParallelLinear
from nvfp4_dist.parallel.collectives import CollectiveTimeoutError
from tests.helpers.distributed import run_distributed

WORLD = 3
ABSENT = 2
GROUP_TIMEOUT = datetime.timedelta(seconds=6)  # long enough for a loaded 2-core machine between collectives
LAYER = "decoder.layers.0.mlp.linear_fc1"


def layer(group, **options):
    torch.manual_seed(1)
    made = ColumnParallelLinear(64, 96, tp_group=group, **options)
    made.layer_name = LAYER
    return made


def tokens(rank, rows):
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).requires_grad_()


def expect_timeout(run, operation):
    pattern = (rf"layer {LAYER}: the {operation} over the tensor-parallel group of global ranks \[0, 1, 2\] timed out "
               rf"on rank \d; rank\(s\) \[{ABSENT}\] did not arrive")
    with pytest.raises(CollectiveTimeoutError, match=pattern):
        run()


def _timeouts(rank, world_size):
    # One group per case, all made first (a group's timeout bounds its set-up too: rank ABSENT runs ahead).
    forward_group, backward_group = (dist.new_group(list(range(world_size)), timeout=GROUP_TIMEOUT) for _ in "fb")
    # Forward: rank ABSENT never calls the layer; the others wait in its first collective (the consistency check).
    if rank != ABSENT:
        expect_timeout(lambda: layer(forward_group, sequence_parallel=True)(tokens(rank, 16)), "all-gather")
    dist.barrier()  # over the world group (its own, longer timeout): the cases start together
    # Backward: at a later call rank ABSENT runs the forward under no_grad, so never the backward's collectives
    # (the first: the NaN/Inf check's amax all-reduce).
    model = layer(backward_group)
    model(tokens(0, 32))[0].float().sum().backward()
    with torch.no_grad() if rank == ABSENT else contextlib.nullcontext():
        y, _ = model(tokens(0, 32))
    if rank != ABSENT:
        expect_timeout(lambda: y.float().sum().backward(), "all-reduce of amaxes")
    # Rank ABSENT stays until the others timed out: its exit would close their connections first on a slow machine
    # (gloo's "Connection closed by peer" instead of the timeout).
    dist.barrier()


def test_a_rank_that_never_arrives_is_named():
    run_distributed(_timeouts, WORLD, timeout_s=180)
