"""The tensor-parallel agreement checks (parallel/group_checks.py) on GPUs, over both transports: NVLink
symmetric memory (the world group) and NCCL (a second group built with NVFP4_SYMMETRIC_MEMORY=0).

    torchrun --nproc-per-node 2 -m pytest tests_multigpu/test_group_checks_gpu.py -q

A NaN/Inf in one rank's input, weight or output gradient must raise NonFiniteAmaxError on every rank; ranks
that disagree on shapes, features or recipes must raise TensorParallelMismatchError on every rank; empty shards
and weights written behind the cache must give the right result. CUDA checks are deferred (no host sync per
quantize): each faulty call runs while the GPU is kept busy, so that no rank raises inside the call, and every
rank then raises at nvfp4_dist.raise_pending_nonfinite(), leaving no collective unmatched for the next case.
"""
import os

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear, all_reduce_amax, symmetric
from nvfp4_dist.parallel.group_checks import TensorParallelMismatchError

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs GPUs"),
              pytest.mark.usefixtures("nccl_group")]
RECIPE = nv.NVFP4Recipe()
NAN = float("nan")
BUSY_CYCLES = 200_000_000  # keeps the GPU busy ~0.1 s: the deferred check cannot land inside the faulty call


@pytest.fixture(scope="module")
def groups():
    """{"symmetric memory": the world group, "nccl": a group of the same ranks without symmetric memory}."""
    os.environ["NVFP4_SYMMETRIC_MEMORY"] = "0"
    try:
        plain = dist.new_group(list(range(dist.get_world_size())), backend="nccl")
        assert not symmetric.enabled(plain)
    finally:
        del os.environ["NVFP4_SYMMETRIC_MEMORY"]
    assert symmetric.enabled(dist.group.WORLD), "2-8 NCCL ranks on one host take the symmetric-memory path"
    return {"symmetric memory": dist.group.WORLD, "nccl": plain}


TRANSPORTS = ["symmetric memory", "nccl"]


def layer(kind, group, sequence_parallel=True, recipe=RECIPE, **options):
    torch.manual_seed(1)
    build = ColumnParallelLinear if kind == "column" else RowParallelLinear
    extra = {} if kind == "column" else {"input_is_parallel": True}
    return build(256, 256, sequence_parallel=sequence_parallel, recipe=recipe, tp_group=group, device="cuda",
                 params_dtype=torch.bfloat16, **extra, **options)


def checked_layer(kind, group, sequence_parallel=True, recipe=RECIPE):
    """A layer after its first call (which compares the ranks' configuration with a host sync)."""
    module = layer(kind, group, sequence_parallel, recipe)
    module(local_input(module, dist.get_rank()))
    torch.cuda.synchronize()
    return module


def local_input(module, rank, seed=3):
    size = dist.get_world_size(module.tp_group)
    features = module.in_features // (size if isinstance(module, RowParallelLinear) else 1)
    rows = 64 if isinstance(module, ColumnParallelLinear) and module.sequence_parallel else 64 * size
    generator = torch.Generator(device="cuda").manual_seed(seed + rank)
    return torch.randn(rows, features, device="cuda", generator=generator).to(torch.bfloat16)


def raises_on_every_rank(error, pattern, run):
    """run() with the GPU busy, then the deferred checks: `error` matching `pattern` on this rank."""
    nv.raise_pending_nonfinite()
    with pytest.raises(error, match=pattern):
        torch.cuda._sleep(BUSY_CYCLES)
        run()
        nv.raise_pending_nonfinite()
    torch.cuda.synchronize()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_amax_all_reduce_carries_nan_of_any_rank(groups, transport):
    rank = dist.get_rank()
    for bad_rank in range(dist.get_world_size()):
        amaxes = [torch.tensor([1.0 + rank], device="cuda"),
                  torch.tensor([NAN if rank == bad_rank else 2.0], device="cuda")]
        all_reduce_amax(amaxes, groups[transport])
        assert amaxes[0].item() == dist.get_world_size() and torch.isinf(amaxes[1]).all()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind,sequence_parallel", [("column", True), ("column", False), ("row", True),
                                                    ("row", False)])
def test_nan_on_one_rank_raises_on_every_rank(groups, transport, kind, sequence_parallel):
    group, rank = groups[transport], dist.get_rank()
    name = "ColumnParallelLinear" if kind == "column" else "RowParallelLinear"
    for bad_rank in range(dist.get_world_size()):
        module = checked_layer(kind, group, sequence_parallel)
        if rank == bad_rank:
            with torch.no_grad():
                module.weight[3, 4] = NAN
        raises_on_every_rank(nv.NonFiniteAmaxError, f"the weight of {name}",
                             lambda: module(local_input(module, rank)))
        module = checked_layer(kind, group, sequence_parallel)
        x = local_input(module, rank)
        sharded = kind == "row" or sequence_parallel
        if rank == bad_rank or not sharded:
            x[1, 2] = NAN
        raises_on_every_rank(nv.NonFiniteAmaxError, f"the input of {name}", lambda: module(x))
        module = checked_layer(kind, group, sequence_parallel)
        y, _ = module(local_input(module, rank).requires_grad_())
        dy = torch.ones_like(y)
        if rank == bad_rank or (kind == "row" and not sequence_parallel):
            dy[0, 1] = NAN
        raises_on_every_rank(nv.NonFiniteAmaxError, f"the gradient of {name}", lambda: y.backward(dy))
    module = layer(kind, group, sequence_parallel)  # the group is still in step
    y, _ = module(local_input(module, rank))
    torch.cuda.synchronize()
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_overlapped_layers_report_nan_of_one_rank(groups, transport):
    group, rank = groups[transport], dist.get_rank()
    recipe = RECIPE.replace(overlap=True, overlap_min_chunk_gflops=0)
    for kind in ("column", "row"):
        module = checked_layer(kind, group, True, recipe)
        if rank == 1:
            with torch.no_grad():
                module.weight[0, 0] = float("inf")
        raises_on_every_rank(nv.NonFiniteAmaxError, "the weight of", lambda: module(local_input(module, rank)))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_that_disagree_raise_on_every_rank(groups, transport):
    group, rank = groups[transport], dist.get_rank()
    module = layer("column", group)
    with pytest.raises(TensorParallelMismatchError, match=r"input shape \(rank 0: \(64, 256\), rank 1: \(32, 256\)"):
        module(local_input(module, rank)[:64 if rank == 0 else 32])
    module = layer("column", group, recipe=RECIPE.replace(rht=rank == 0))
    with pytest.raises(TensorParallelMismatchError, match=r"recipe.rht \(rank 0: 1, rank 1: 0\)"):
        module(local_input(module, rank))
    module = layer("row", group, sequence_parallel=rank == 0)
    with pytest.raises(TensorParallelMismatchError, match=r"sequence_parallel \(rank 0: 1, rank 1: 0\)"):
        module(local_input(module, rank))
    recipe = RECIPE.replace(rht=False, stochastic_rounding=False, row_scaled_activation=rank == 1)
    module = layer("column", group, recipe=recipe)
    with pytest.raises(TensorParallelMismatchError, match=r"recipe.row_scaled_activation"):
        module(local_input(module, rank))
    y, _ = layer("column", group)(local_input(layer("column", group), rank))  # still in step
    assert y.shape == (64 * dist.get_world_size(), 256 // dist.get_world_size())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_empty_shards_and_changed_weights(groups, transport):
    group, rank = groups[transport], dist.get_rank()
    for kind in ("column", "row"):
        module = layer(kind, group, bias=False)
        features = module.in_features // (dist.get_world_size() if kind == "row" else 1)
        x = torch.empty(0, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y, _ = module(x)
        y.float().sum().backward()
        assert y.shape[0] == 0 and module.weight.grad.abs().sum().item() == 0
        x = local_input(module, rank)
        module(x)
        module.weight.data.mul_(0)
        y, _ = module(x)
        assert (y == 0).all().item(), "a weight zeroed through .data is seen"
        module.weight.grad = torch.ones_like(module.weight)
        torch.optim.AdamW([module.weight], lr=1.0, fused=True).step()
        y, _ = module(x)
        assert (y != 0).any().item(), "a fused optimizer step is seen"


def test_verified_cache_sees_writes_through_a_held_alias(groups):
    """CUDA weights are compared with their cached values only with NVFP4_VERIFY_WEIGHT_CACHE=1."""
    rank = dist.get_rank()
    os.environ["NVFP4_VERIFY_WEIGHT_CACHE"] = "1"
    try:
        module = layer("column", groups["nccl"], bias=False)
        weight = module.weight
        alias = torch.empty(0, device="cuda", dtype=weight.dtype).set_(
            weight.untyped_storage(), weight.storage_offset(), weight.shape, weight.stride())
        x = local_input(module, rank)
        module(x)
        alias.zero_()  # a write that no version counter or .data access records
        y, _ = module(x)
        assert (y == 0).all().item()
    finally:
        del os.environ["NVFP4_VERIFY_WEIGHT_CACHE"]
