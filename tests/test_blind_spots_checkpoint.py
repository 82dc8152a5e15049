"""Checkpoint digests of files larger than one read chunk (launch/checkpoint.py reads READ_CHUNK bytes at a time):
the digest and size cover the whole file, and damage past the first chunk is found before loading."""
import hashlib
import os

import pytest
import torch

from nvfp4_dist.launch import checkpoint


def big_state(step: int) -> dict:
    """A state whose file holds more than one read chunk (and a partial last chunk)."""
    elements = (checkpoint.READ_CHUNK + checkpoint.READ_CHUNK // 3) // 4
    return {"step": step, "model": {"weight": torch.full((elements,), float(step))}}


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0x5A]))


@pytest.mark.parametrize("extra", [0, 1, checkpoint.READ_CHUNK - 1])
def test_digest_covers_every_chunk(tmp_path, extra):
    data = os.urandom(2 * checkpoint.READ_CHUNK + extra)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert checkpoint.file_digest(path) == (len(data), hashlib.sha256(data).digest())


def test_damage_past_the_first_chunk_is_found(tmp_path):
    for step in (2, 4):
        checkpoint.save_checkpoint(tmp_path, step, big_state(step), rank=0, world_size=1)
    path = checkpoint.rank_file(tmp_path, 4, 0)
    size = path.stat().st_size
    assert size > checkpoint.READ_CHUNK + 4096, size
    flip_byte(path, checkpoint.READ_CHUNK + (size - checkpoint.READ_CHUNK) // 2)  # inside the tensor, chunk 2
    assert path.stat().st_size == size
    with pytest.raises(checkpoint.CheckpointError, match="rank_00000.pt does not match its sha256 checksum"):
        checkpoint.load_checkpoint(tmp_path, rank=0, world_size=1)
    resumed = checkpoint.resume_newest(tmp_path, rank=0, world_size=1)
    assert resumed.step == 2 and torch.equal(resumed.state["model"]["weight"], big_state(2)["model"]["weight"])
    assert resumed.passed_over == ["step 4: rank_00000.pt does not match its sha256 checksum (the file is damaged)"]
