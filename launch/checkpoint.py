"""Atomic, resumable checkpoints of a distributed job.

Layout under `root`:
    step_00000040/rank_00000.pt ... rank_<W-1>.pt   one file per rank (its model shard, optimizer, RNG, step)
    latest                                          the last step whose files all ranks finished writing
Every file is written to a temporary name and renamed into place, and `latest` is rewritten (the same way)
only after a barrier that follows all ranks' renames. A crash at any point therefore leaves `latest`
naming a complete checkpoint; a half-written step directory is ignored and overwritten later.
"""
from __future__ import annotations

import os
import pathlib
import shutil

import torch
import torch.distributed as dist

LATEST = "latest"


def step_directory(root, step: int) -> pathlib.Path:
    return pathlib.Path(root) / f"step_{step:08d}"


def rank_file(root, step: int, rank: int) -> pathlib.Path:
    return step_directory(root, step) / f"rank_{rank:05d}.pt"


def _fsync_directory(directory: pathlib.Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write(path, write, before_rename=None) -> None:
    """Run write(temporary_path), fsync, then rename onto `path`. before_rename(temporary_path) is a test hook."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    if before_rename is not None:
        before_rename(temporary)
    os.replace(temporary, path)
    _fsync_directory(path.parent)


def latest_step(root) -> int | None:
    """The step of the last complete checkpoint under `root`, or None when there is none."""
    pointer = pathlib.Path(root) / LATEST
    if not pointer.exists():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer} holds {text!r}, not a step number: the checkpoint directory is damaged")
    return int(text)


def save_checkpoint(root, step: int, state: dict, *, rank: int, world_size: int, keep: int = 2,
                    before_rename=None) -> pathlib.Path:
    """Write this rank's `state` for `step` (collective over the default group); returns the step directory.

    keep: complete checkpoints to keep (older ones are deleted by rank 0), >= 1.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1")
    directory = step_directory(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f".rank_{rank:05d}.pt.tmp-*"):  # left by an earlier crash at this step
        stale.unlink()
    atomic_write(rank_file(root, step, rank), lambda path: torch.save(state, path), before_rename)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        atomic_write(pathlib.Path(root) / LATEST, lambda path: path.write_text(f"{step}\n"))
        complete = sorted(p for p in pathlib.Path(root).glob("step_*") if p.is_dir() and p != directory
                          and int(p.name.split("_")[1]) < step)
        for old in complete[:max(0, len(complete) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    return directory


def load_checkpoint(root, *, rank: int, world_size: int, step: int | None = None) -> dict:
    """This rank's state from the checkpoint at `step` (default: the latest complete one)."""
    step = latest_step(root) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no complete checkpoint under {root} (no '{LATEST}' file)")
    saved_ranks = len(list(step_directory(root, step).glob("rank_*.pt")))
    if saved_ranks != world_size:
        raise ValueError(f"the checkpoint at step {step} under {root} has {saved_ranks} rank files; this job has "
                         f"{world_size} ranks: resume with the same number of processes")
    return torch.load(rank_file(root, step, rank), map_location="cpu", weights_only=False)
