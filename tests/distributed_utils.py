"""Run a function on N real processes joined in a gloo process group (CPU multi-rank tests)."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Call fn(rank, world_size, *args) on world_size spawned ranks; a failure on any rank fails the caller.

    Processes are forked (spawning re-imports torch per rank: tens of seconds on CI).
    """
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True,
                       start_method="fork")
