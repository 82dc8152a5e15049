"""CPU benchmarks' process groups: `fn` run on spawned gloo ranks of this machine, rank 0's result returned."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world_size: int, store: str, queue, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(fn, world_size: int, *args):
    """fn(rank, world_size, *args) on `world_size` spawned processes joined in one gloo group (a file store in a
    temporary directory), one thread each; returns what rank 0's call returned. fn must be a module-level function
    (the processes are spawned)."""
    queue = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory(prefix="gloo_ranks_") as directory:
        processes = mp.start_processes(_rank, args=(world_size, os.path.join(directory, "store"), queue, fn, args),
                                       nprocs=world_size, join=False, start_method="spawn")
        result = queue.get()
        processes.join()
    return result
