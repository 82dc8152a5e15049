"""The NCCL process group of a benchmark started by torchrun: one GPU per local rank."""
import os

import torch
import torch.distributed as dist


def init_nccl() -> tuple:
    """Bind this process to GPU LOCAL_RANK, join the NCCL group; returns (rank, world size)."""
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("start this benchmark with torchrun (LOCAL_RANK is not set)")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return dist.get_rank(), dist.get_world_size()
