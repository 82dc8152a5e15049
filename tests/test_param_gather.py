"""The NVFP4 parameter all-gather on real gloo groups: DP=2 and DP=4, alone and beside TP=2.

The gathered weight equals quantizing the whole weight byte for byte; unaligned shards are refused clearly; a
NaN on one rank stops every rank.
"""
import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist import sharded_weight
from nvfp4_dist.parallel import param_gather
from nvfp4_dist.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.helpers.distributed import run_distributed
from tests.test_parallel_comm import assert_bytes_equal

RECIPES = [nv.NVFP4Recipe(), nv.NVFP4Recipe(weight_2d=False), nv.NVFP4Recipe(nvfp4_4over6="weights")]
SHAPES = [(64, 48), (128, 32), (256, 96)]  # rows: multiples of 16 * 4


def whole_weights(seed):
    """Weights whose largest magnitude sits in one row block only, so a shard's own amax is not the weight's."""
    torch.manual_seed(seed)
    weights = []
    for index, (rows, cols) in enumerate(SHAPES):
        w = torch.randn(rows, cols) * torch.logspace(-1, 1, cols)
        w[(index * 37) % rows] *= 40.0
        weights.append(w.to(torch.bfloat16))
    return weights


def _gathered_equals_whole(rank, world_size):
    weights = whole_weights(seed=3)
    shards = [sharded_weight.shard_rows(w, world_size, rank) for w in weights]
    for recipe in RECIPES:
        for columnwise in (True, False):
            gathered = param_gather.gather_weights_nvfp4(shards, recipe, columnwise=columnwise)
            for weight, got in zip(weights, gathered):
                expected = nv.quantize(weight, role="weight", columnwise=columnwise, recipe=recipe)
                assert_bytes_equal(got, expected, (recipe.weight_2d, recipe.nvfp4_4over6, columnwise))
    # The unquantized gather (the baseline) gives the weights back.
    for weight, got in zip(weights, param_gather.all_gather_weights(shards)):
        assert torch.equal(got, weight)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_weight_equals_whole_quantization(world_size):
    run_distributed(_gathered_equals_whole, world_size)


def _amax_is_one_all_reduce(rank, world_size):
    weights = whole_weights(seed=5)
    shards = [sharded_weight.shard_rows(w, world_size, rank) for w in weights]
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)
    dist.all_reduce = counting
    try:
        amaxes = param_gather.all_reduce_weight_amaxes(shards)
    finally:
        dist.all_reduce = original
    assert calls == [len(weights)], calls  # one collective for every weight's amax
    for weight, amax in zip(weights, amaxes):
        assert torch.equal(amax, weight.float().abs().amax().reshape(1))


def test_amaxes_reduced_in_one_collective():
    run_distributed(_amax_is_one_all_reduce, 2)


def _with_tensor_parallel(rank, world_size, tp):
    """Ranks (dp, tp) on a dp x tp grid: the TP layers' weight shards gathered over the DP group equal
    quantizing each TP shard with its own amax (docs/numerics.md §9)."""
    dp = world_size // tp
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    dp_rank, tp_rank = divmod(rank, tp)
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    torch.manual_seed(11)
    fc1 = ColumnParallelLinear(64, 256, tp_group=tp_group, params_dtype=torch.bfloat16)
    fc2 = RowParallelLinear(256, 64, tp_group=tp_group, params_dtype=torch.bfloat16)
    with torch.no_grad():
        fc1.weight[3 + 16 * tp_rank] *= 30.0  # the TP shards' amaxes differ
    tp_weights = [fc1.weight, fc2.weight]
    shards = [sharded_weight.shard_rows(w.detach(), dp, dp_rank) for w in tp_weights]
    recipe = nv.NVFP4Recipe()
    for got, weight in zip(param_gather.gather_weights_nvfp4(shards, recipe, dp_group), tp_weights):
        assert_bytes_equal(got, nv.quantize(weight.detach(), role="weight", recipe=recipe), ("tp", tp_rank))


@pytest.mark.parametrize("world_size", [4, 8])
def test_gathered_weight_equals_tensor_parallel_shard(world_size):
    run_distributed(_with_tensor_parallel, world_size, 2)


def test_unaligned_shards_refused():
    with pytest.raises(ValueError, match=r"weight.shape=\(96, 64\): 96 rows do not split into 4 shards .* "
                                         r"multiple of 16 \* 4 = 64"):
        sharded_weight.check_weight_sharding((96, 64), 4)
    with pytest.raises(ValueError, match=r"in_features \(40\) must be a positive multiple of 16"):
        sharded_weight.check_weight_sharding((64, 40), 2)
    with pytest.raises(ValueError, match=r"world_size=0"):
        sharded_weight.check_weight_sharding((64, 64), 0)
    with pytest.raises(ValueError, match=r"rank=2: must be an integer in \[0, 2\)"):
        sharded_weight.shard_rows(torch.zeros(64, 64), 2, 2)
    sharded_weight.check_weight_sharding((128, 64), 8)


def _unaligned_shard_in_group(rank, world_size):
    with pytest.raises(ValueError, match=r"shards\[1\] gathered over 2 ranks"):
        param_gather.gather_weights_nvfp4([torch.zeros(16, 32), torch.zeros(8, 32)])


def test_unaligned_shard_refused_before_any_collective():
    run_distributed(_unaligned_shard_in_group, 2)


def _nan_on_one_rank(rank, world_size):
    shard = torch.randn(32, 64)
    if rank == 1:
        shard[5, 7] = float("nan")
    with pytest.raises(nv.NonFiniteAmaxError):
        param_gather.gather_weights_nvfp4([shard], nv.NVFP4Recipe())


def test_nan_on_one_rank_stops_every_rank():
    run_distributed(_nan_on_one_rank, 2)


def test_wire_bytes_match_the_pieces():
    torch.manual_seed(0)
    shard = torch.randn(64, 96)
    for recipe in RECIPES:
        q = sharded_weight.quantize_shard(shard, sharded_weight.local_weight_amax(shard), recipe)
        moved = sum(t.numel() for t in sharded_weight.wire_pieces(q).values())
        assert moved == sharded_weight.wire_bytes(shard.shape, recipe), recipe
    # 16x16 blocks: 0.5 byte per weight plus one byte per 256 weights.
    assert sharded_weight.wire_bytes((64, 96), nv.NVFP4Recipe()) == 64 * 96 // 2 + 64 * 96 // 256
