"""FSDP2 gathering the NVFP4 layers' weights in NVFP4 (parallel/fsdp.py) with CUDA tensors.

    torchrun --nproc-per-node 2 -m pytest tests_multigpu/test_fsdp_gpu.py -q     # DP=2 (also 4)

With a GPU per rank the ranks join an NCCL group; with more ranks than GPUs (one GPU: the ranks share it) they
join a gloo group, which carries CUDA tensors through host memory: the kernels, FSDP2's CUDA streams and the
gathered weights are the GPU's either way, only the transport differs.

At every gather the weight the layers run on is byte for byte the CUDA quantization of the whole weight (its
first gather, and later ones into FSDP2's reused buffers with the precomputed amaxes); training with the NVFP4
gather equals training with FSDP2's own gather, step for step (losses and FP32 master weights), for the recipes'
gather forms; a checkpoint round trip resumes bit for bit.
"""
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import nvfp4_dist as nv
from nvfp4_dist.linear import WeightCache, needs_columnwise_weight
from nvfp4_dist.parallel import collectives
from nvfp4_dist.parallel import fsdp as nvfp4_fsdp
from tests.test_fsdp_nvfp4 import _checkpoint_round_trip, _fsdp_equals_plain_gather, shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECIPES = {
    "16x16": nv.NVFP4Recipe(),                                # one copy travels, the columnwise one derived
    "1x16": nv.NVFP4Recipe(weight_2d=False),                  # both copies travel
    "4over6": nv.NVFP4Recipe(nvfp4_4over6="weights"),         # both copies travel
    "dequantized": nv.NVFP4Recipe(backward_mode="dequantized"),  # the rowwise copy only
}


@pytest.fixture(scope="module")
def device(request):
    """This rank's GPU, its process group joined: NCCL with a GPU per local rank, else gloo."""
    if "LOCAL_RANK" not in os.environ:
        pytest.fail(f"launch with torchrun --nproc-per-node N -m pytest {os.path.relpath(request.module.__file__)}")
    gpus = torch.cuda.device_count()
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    if local_ranks <= gpus:
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        print(f"\nFSDP2 over {dist.get_world_size()} ranks, {dist.get_backend()}, {gpus} x "
              f"{torch.cuda.get_device_name(device)}")
    yield device
    dist.destroy_process_group()


def full_weight(layer) -> torch.Tensor:
    """The whole weight, gathered from the ranks' sharded master weights (no padding: rows split evenly)."""
    return collectives.all_gather_bf16(layer.weight._local_tensor._tensor.detach())


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_gathered_weight_is_the_whole_weight_quantized(device, recipe_name):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(nv.Linear(256, 512), torch.nn.GELU(), nv.Linear(512, 256)).to(device)
    layers = {"0": model[0], "2": model[2]}
    shard(model, init_device_mesh("cuda", (dist.get_world_size(),)), True, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = {}

    def record(name):
        def hook(module, args):
            assert isinstance(module.weight, nvfp4_fsdp.NVFP4GatheredWeight), type(module.weight)
            seen[name] = [None if t is None else t.clone() for t in module.weight.nvfp4.tensors()]
        return hook
    for name, layer in layers.items():
        layer.register_forward_pre_hook(record(name))

    for step in range(3):  # the first gather allocates; later ones refill FSDP2's buffers, amaxes precomputed
        expected = {}
        for name, layer in layers.items():
            whole = full_weight(layer).to(torch.bfloat16)
            expected[name] = WeightCache().get(whole, recipe, columnwise=needs_columnwise_weight(recipe)).tensors()
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        with nv.autocast(recipe):
            loss = model(torch.randn(64, 256, device=device, dtype=torch.bfloat16)).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step < 2:
            assert nvfp4_fsdp.precompute_weight_amaxes(model) == 2
        for name in layers:
            for index, (got, want) in enumerate(zip(seen[name], expected[name])):
                assert (got is None) == (want is None), (step, name, index)
                if got is not None:
                    assert torch.equal(got, want), (recipe_name, step, name, index)
        assert torch.isfinite(loss)


@pytest.mark.parametrize("param_dtype,recipe_name", [(None, "16x16"), (torch.bfloat16, "16x16"),
                                                     (torch.bfloat16, "1x16"), (torch.bfloat16, "4over6"),
                                                     (torch.bfloat16, "dequantized")],
                         ids=["fp32-16x16", "bf16-16x16", "bf16-1x16", "bf16-4over6", "bf16-dequantized"])
def test_training_with_nvfp4_gather_equals_plain_gather(device, param_dtype, recipe_name):
    _fsdp_equals_plain_gather(dist.get_rank(), dist.get_world_size(), param_dtype, RECIPES[recipe_name], device)


def test_checkpoint_round_trip(device):
    directory = [tempfile.mkdtemp(prefix="nvfp4_fsdp_gpu_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    try:
        _checkpoint_round_trip(dist.get_rank(), dist.get_world_size(), os.path.join(directory[0], "step2"), device)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory[0])
