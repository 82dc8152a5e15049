"""FSDP2 (fully_shard) gathering the NVFP4 layers' weights in NVFP4, on real gloo groups.

Training with the NVFP4 gather equals training with FSDP2's own gather followed by the layers' quantization, step
for step (losses and the sharded FP32 master weights), at DP=2 and DP=4, alone and beside TP=2; the checkpoint
round trip; unaligned weights refused.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import nvfp4_dist as nv
from nvfp4_dist.parallel import collectives
from nvfp4_dist.parallel import fsdp as nvfp4_fsdp
from nvfp4_dist.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.helpers.distributed import run_distributed

RECIPE = nv.NVFP4Recipe()


class MLP(torch.nn.Module):
    """Two NVFP4 layers, one whose recipe keeps the unquantized weight for backward, one BF16 layer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nv.Linear(64, 128)
        self.fc2 = nv.Linear(128, 128, recipe=nv.NVFP4Recipe(backward_mode="high_precision"))
        self.fc3 = nv.Linear(128, 64)
        self.head = nv.Linear(64, 32, bf16_fallback=True)

    def forward(self, x):
        x = torch.nn.functional.gelu(self.fc1(x))
        x = torch.nn.functional.gelu(self.fc2(x))
        return self.head(self.fc3(x))


class TensorParallelMLP(torch.nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        self.fc1 = ColumnParallelLinear(64, 256, tp_group=tp_group)
        self.fc2 = RowParallelLinear(256, 64, tp_group=tp_group)

    def forward(self, x):
        hidden, _ = self.fc1(x)
        y, _ = self.fc2(torch.nn.functional.gelu(hidden))
        return y


def shard(model, mesh, nvfp4_gather, param_dtype):
    if nvfp4_gather:
        nvfp4_fsdp.enable_nvfp4_param_gather(model, mesh.size())
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for child in model.children():
        fully_shard(child, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class GatherProbe:
    """Counts the bytes FSDP2 all-gathers and the amax all-reduces; records the weights the NVFP4 layers see."""

    def __init__(self, model):
        self.gathered_bytes, self.amax_reductions, self.weight_types = 0, 0, set()
        self.read_error = None
        for module in model.modules():
            if isinstance(getattr(module, "weight_cache", None), nv.linear.WeightCache):
                module.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        self.weight_types.add(type(module.weight).__name__)
        if isinstance(module.weight, nvfp4_fsdp.NVFP4GatheredWeight) and self.read_error is None:
            try:
                module.weight.sum()
            except RuntimeError as error:
                self.read_error = str(error)

    # The all-gather FSDP2 calls (all_gather_into_tensor in torch releases without all_gather_single).
    GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def __enter__(self):
        self.gather, self.reduce = getattr(dist, self.GATHER), collectives.all_reduce_amax

        def gather(output, input, *args, **kwargs):
            self.gathered_bytes += input.numel() * input.element_size()
            return self.gather(output, input, *args, **kwargs)

        def reduce(amaxes, *args, **kwargs):
            self.amax_reductions += 1
            return self.reduce(amaxes, *args, **kwargs)
        setattr(dist, self.GATHER, gather)
        collectives.all_reduce_amax = reduce
        return self

    def __exit__(self, *exc):
        setattr(dist, self.GATHER, self.gather)
        collectives.all_reduce_amax = self.reduce


def train(model, data_rank, steps, nvfp4_gather, optimizer=None, first_step=0, recipe=RECIPE, device="cpu"):
    """(losses, amax all-reduces per step, probe, optimizer); precompute_weight_amaxes after each step."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, reductions = [], []
    with GatherProbe(model) as probe:
        for step in range(first_step, first_step + steps):
            torch.manual_seed(1000 * step + data_rank)  # different data per replica; the same SR seeds per run
            x = torch.randn(32, 64).to(device)
            before = probe.amax_reductions
            with nv.autocast(recipe):
                loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            reductions.append(probe.amax_reductions - before)
            if nvfp4_gather:
                nvfp4_fsdp.precompute_weight_amaxes(model)
            losses.append(loss.item())
    return losses, reductions, probe, optimizer


def master_weights(model):
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def assert_same_training(got, expected, what):
    (losses, weights), (expected_losses, expected_weights) = got, expected
    assert losses == expected_losses, (what, losses, expected_losses)
    assert weights.keys() == expected_weights.keys()
    for name in weights:
        assert weights[name].dtype == expected_weights[name].dtype == torch.float32, name
        assert torch.equal(weights[name], expected_weights[name]), (what, name)


def _fsdp_equals_plain_gather(rank, world_size, param_dtype, recipe, device=torch.device("cpu")):
    """Also run on GPUs (tests_multigpu/test_fsdp_gpu.py) with the group torchrun's ranks joined."""
    mesh = init_device_mesh(device.type, (world_size,))
    runs = {}
    for nvfp4_gather in (True, False):
        torch.manual_seed(0)
        model = shard(MLP().to(device), mesh, nvfp4_gather, param_dtype)
        losses, reductions, probe, _ = train(model, rank, 3, nvfp4_gather, recipe=recipe, device=device)
        runs[nvfp4_gather] = (losses, master_weights(model)), probe, reductions, model
    (nvfp4_run, nvfp4_probe, reductions, model), (plain_run, plain_probe, _, _) = runs[True], runs[False]
    assert_same_training(nvfp4_run, plain_run, (world_size, param_dtype))
    # The NVFP4 layers ran on the gathered NVFP4 copy; the BF16 layer and the high-precision one on values.
    assert nvfp4_probe.weight_types == {"NVFP4GatheredWeight", "Parameter"}, nvfp4_probe.weight_types
    assert "gathered in NVFP4" in nvfp4_probe.read_error
    model_layers = dict(nvfp4_fsdp.nvfp4_layers(model))
    assert model_layers["fc3"].weight_cache.quantizations == 0  # never quantized from a gathered BF16 weight
    # Step 1 reduces each NVFP4 weight's amax on its own, forward and backward; later steps use the precomputed.
    assert reductions[0] > 0 and reductions[1:] == [0, 0], reductions
    assert nvfp4_probe.gathered_bytes < plain_probe.gathered_bytes


@pytest.mark.parametrize("world_size,param_dtype,recipe", [
    (2, None, RECIPE), (4, torch.bfloat16, RECIPE),
    (2, torch.bfloat16, nv.NVFP4Recipe(weight_2d=False)),        # 1x16 weight blocks: both copies travel
    (2, torch.bfloat16, nv.NVFP4Recipe(nvfp4_4over6="weights")),  # 4over6 weights: both copies travel
    (2, torch.bfloat16, nv.NVFP4Recipe(backward_mode="dequantized")),  # backward needs the rowwise copy only
], ids=["dp2-fp32", "dp4-bf16", "dp2-1x16", "dp2-4over6", "dp2-dequantized"])
def test_training_with_nvfp4_gather_equals_plain_gather(world_size, param_dtype, recipe):
    run_distributed(_fsdp_equals_plain_gather, world_size, param_dtype, recipe)


def _with_tensor_parallel(rank, world_size, tp):
    dp = world_size // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = rank // tp
    runs = {}
    for nvfp4_gather in (True, False):
        torch.manual_seed(0)
        model = shard(TensorParallelMLP(mesh["tp"].get_group()), mesh["dp"], nvfp4_gather, torch.bfloat16)
        losses, _, probe, _ = train(model, dp_rank, 2, nvfp4_gather)
        runs[nvfp4_gather] = (losses, master_weights(model)), probe
    assert_same_training(runs[True][0], runs[False][0], ("tp", tp, "dp", dp))
    assert runs[True][1].weight_types == {"NVFP4GatheredWeight"}


@pytest.mark.parametrize("world_size", [4, 8])
def test_training_with_tensor_parallel(world_size):
    run_distributed(_with_tensor_parallel, world_size, 2)


def _checkpoint_round_trip(rank, world_size, directory, device=torch.device("cpu")):
    mesh = init_device_mesh(device.type, (world_size,))

    def fresh(nvfp4_gather):
        torch.manual_seed(0)
        model = shard(MLP().to(device), mesh, nvfp4_gather, None)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = fresh(True)
    uninterrupted, *_ = train(model, rank, 3, True, optimizer, device=device)
    expected = master_weights(model)

    model, optimizer = fresh(True)
    first, *_ = train(model, rank, 2, True, optimizer, device=device)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    local = [v.to_local() if hasattr(v, "to_local") else v for v in model_state.values()]
    assert all(type(t) is torch.Tensor for t in local), [type(t) for t in local]  # saved as without the option
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)

    for nvfp4_gather in (True, False):  # the checkpoint loads with and without NVFP4 gathers
        model, optimizer = fresh(nvfp4_gather)
        if nvfp4_gather:  # amaxes of the fresh weights: the load must make them stale
            train(model, rank, 1, nvfp4_gather, torch.optim.SGD(model.parameters(), lr=0.0), device=device)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        last, *_ = train(model, rank, 1, nvfp4_gather, optimizer, first_step=2, device=device)
        assert_same_training((first + last, master_weights(model)), (uninterrupted, expected), nvfp4_gather)


def test_checkpoint_round_trip():
    with tempfile.TemporaryDirectory(prefix="nvfp4_fsdp_ckpt_") as directory:
        run_distributed(_checkpoint_round_trip, 2, os.path.join(directory, "step2"))


def test_unaligned_weights_refused_before_any_change():
    model = torch.nn.Sequential(nv.Linear(64, 128), nv.Linear(128, 48))
    with pytest.raises(ValueError, match=r"1.weight.shape=\(48, 128\): 48 rows do not split into 2 shards .* "
                                         r"multiple of 16 \* 2 = 32"):
        nvfp4_fsdp.enable_nvfp4_param_gather(model, 2)
    assert not any(isinstance(p, nvfp4_fsdp.NVFP4ShardedWeight) for p in model.parameters())
    assert nvfp4_fsdp.enable_nvfp4_param_gather(model, 1) == ["0", "1"]


def test_sharded_weight_behaves_as_its_values():
    torch.manual_seed(0)
    layer = nv.Linear(64, 32)
    expected = layer.weight.detach().clone()
    nvfp4_fsdp.enable_nvfp4_param_gather(layer, 2)
    assert isinstance(layer.weight, nvfp4_fsdp.NVFP4ShardedWeight)
    assert torch.equal(layer.weight * 2, expected * 2) and type(layer.weight * 2) is torch.Tensor
    assert type(layer.state_dict()["weight"]) is torch.Tensor
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert torch.equal(layer.weight._tensor, expected + 1)
    x = torch.randn(16, 64)
    with nv.autocast(RECIPE):  # unsharded (no FSDP): the layer quantizes the values as usual
        y = layer(x)
    reference = nv.Linear(64, 32)
    with torch.no_grad():
        reference.weight.copy_(expected + 1)
        reference.bias.copy_(layer.bias)
    with nv.autocast(RECIPE):
        assert torch.equal(y, reference(x))
