"""nvfp4-train --fsdp: the model sharded over the data-parallel replicas by FSDP2, its NVFP4 linears' weights
all-gathered in NVFP4 (nvfp4_dist.parallel.fsdp; docs/data_parallel.md), and the local shards of its state.

Parameters become DTensors sharded along dim 0 over the data-parallel mesh; every rank keeps 1/DP of each
parameter, of its gradient and of the optimizer state. Checkpoints hold each rank's local shards as plain tensors
(one file per rank, as without --fsdp), which load back into the DTensors of a job of the same shape.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from nvfp4_dist.parallel.fsdp import enable_nvfp4_param_gather

# Parameter attributes the launcher's gradient code reads; FSDP2's sharded parameters are new tensors without them.
PARAMETER_MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel")


def parallel_mesh(world_size: int, tp: int, device: torch.device) -> DeviceMesh:
    """The (dp, tp) mesh: TP groups of consecutive ranks, DP groups strided by tp (as trainer.parallel_groups)."""
    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def shard_model(model: torch.nn.Module, dp_mesh: DeviceMesh, blocks) -> list:
    """fully_shard each module of `blocks`, then the model (the rest: embeddings, final norm, head), over
    dp_mesh, the NVFP4 layers' weights gathered in NVFP4; the parameters keep their marks. Parameters stay in
    their dtype (no mixed-precision policy), so the job computes as without --fsdp. Returns the names of the
    layers gathered in NVFP4."""
    marks = {name: {mark: getattr(p, mark) for mark in PARAMETER_MARKS if hasattr(p, mark)}
             for name, p in model.named_parameters()}
    gathered = enable_nvfp4_param_gather(model, dp_mesh.size())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for name, p in model.named_parameters():
        for mark, value in marks[name].items():
            setattr(p, mark, value)
    return gathered


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_state(state):
    """`state` (a state dict, or any nest of containers) with every DTensor replaced by its local shard."""
    with torch.no_grad():
        return pytree.tree_map_only(DTensor, lambda t: t.to_local().detach(), state)


def _like(template: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(local.to(template.device), template.device_mesh, template.placements,
                              run_check=False, shape=template.shape, stride=template.stride())


def sharded_model_state(model: torch.nn.Module, saved: dict) -> dict:
    """saved (local_state of a model state dict) with each entry that is a DTensor in model's state dict made
    one again, for model.load_state_dict."""
    current = model.state_dict()
    return {key: _like(current[key], value) if isinstance(current.get(key), DTensor) else value
            for key, value in saved.items()}


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """saved (local_state of an optimizer state dict) with each per-parameter tensor of a DTensor parameter's
    shape (AdamW's moments; not its scalar step) made a DTensor like its parameter, for optimizer.load_state_dict."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entries in saved["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            local_shape = param.to_local().shape
            entries = {name: _like(param, value) if isinstance(value, torch.Tensor) and value.dim() > 0
                       and value.shape == local_shape else value for name, value in entries.items()}
        state[index] = entries
    return {**saved, "state": state}
