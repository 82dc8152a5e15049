"""nvfp4-train's data: a text file read as bytes (one token per byte) and the batch of each step."""
from __future__ import annotations

import pathlib

import torch


def load_corpus(path: pathlib.Path, seq_length: int) -> torch.Tensor:
    """The file's bytes as a uint8 tensor (at least seq_length + 2 of them)."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    if data.numel() < seq_length + 2:
        raise ValueError(f"--data={path}: {data.numel()} bytes, fewer than --seq-length + 2")
    return data


def batch_for_step(data: torch.Tensor, *, seed: int, step: int, dp_rank: int, micro_batch: int, seq_length: int,
                   device) -> tuple:
    """(tokens, labels) [micro_batch, seq_length] int64: a pure function of (seed, step, data-parallel rank).

    Each row is a window of the corpus at a random start; labels are the tokens shifted by one. Being a
    pure function of the step, a resumed run reads the batches the interrupted one would have read.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 4_099 + dp_rank)
    starts = torch.randint(0, data.numel() - seq_length - 1, (micro_batch,), generator=generator)
    windows = torch.stack([data[s:s + seq_length + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].to(device), windows[:, 1:].to(device)
