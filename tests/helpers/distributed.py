"""Run a function on N real processes joined in a gloo process group (CPU multi-rank tests)."""
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)


def _worker(rank: int, world_size: int, store_path: str, fn, args) -> None:
    torch.set_num_threads(1)
    # A file store: no TCP port to pick, so concurrent test runs cannot join each other's groups.
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=RENDEZVOUS_TIMEOUT)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 300.0) -> None:
    """Call fn(rank, world_size, *args) on world_size forked ranks; a failure on any rank fails the caller.

    Processes are forked (spawning re-imports torch per rank: tens of seconds on CI). A run that has
    not finished after timeout_s seconds is killed and raises TimeoutError instead of hanging CI.
    """
    with tempfile.TemporaryDirectory(prefix="nvfp4_dist_gloo_") as directory:
        context = mp.start_processes(_worker, args=(world_size, os.path.join(directory, "store"), fn, args),
                                     nprocs=world_size, join=False, start_method="fork")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in "
                                   f"{timeout_s:.0f} s")
