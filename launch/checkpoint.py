"""Atomic, verified, resumable checkpoints of a distributed job.

Layout under `root`:
    step_00000040/rank_00000.pt ... rank_<W-1>.pt   one file per rank (its model shard, optimizer, RNG, step)
    step_00000040/manifest.json                     the step, the world size, each rank file's size and sha256
    latest                                          the last step whose manifest was written (for people)
Each rank writes its file to a temporary name and renames it into place; once every rank has (the ranks'
checksums are gathered, which waits for all of them), rank 0 writes the manifest and then `latest`, each
the same way. A step directory with a manifest is therefore complete, and a crash at any point leaves the
previous complete checkpoint as it was; a half-written step directory has no manifest and is ignored.

Loading checks the manifest, each file's size and checksum, and unpickles with torch.load(weights_only=True),
which builds tensors and plain containers only: a file that would run code is refused. Resuming takes the
newest checkpoint that passes on every rank and says which newer ones it passed over and why.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import pathlib
import re
import shutil

import torch
import torch.distributed as dist

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = "nvfp4-dist checkpoint 1"
STEP_DIRECTORY = re.compile(r"step_(\d{8})")
DIGEST_BYTES = 32
READ_CHUNK = 1 << 24


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and why."""


class Finding(enum.IntEnum):
    """One rank's verdict on a checkpoint step (exchanged between ranks as an integer)."""

    GOOD = 0
    MISSING = 1
    SIZE = 2
    CHECKSUM = 3
    REFUSED = 4
    NO_MANIFEST = 5
    BAD_MANIFEST = 6
    WORLD_SIZE = 7


def step_directory(root, step: int) -> pathlib.Path:
    return pathlib.Path(root) / f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def rank_file(root, step: int, rank: int) -> pathlib.Path:
    return step_directory(root, step) / rank_file_name(rank)


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


def file_digest(path) -> tuple:
    """(size in bytes, sha256 digest bytes) of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.digest()


def latest_step(root) -> int | None:
    """The step that `root`/latest names, or None when there is no such file."""
    pointer = pathlib.Path(root) / LATEST
    if not pointer.exists():
        return None
    text = pointer.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer} holds {text[:40]!r}, not a step number")
    return int(text)


def saved_steps(root) -> list:
    """The steps that have a step directory under `root`, newest first."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    steps = [int(match.group(1)) for path in root.iterdir()
             if (match := STEP_DIRECTORY.fullmatch(path.name)) and path.is_dir()]
    return sorted(steps, reverse=True)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_integers(values: list) -> list:
    """Every rank's `values` (int64s of the same count on every rank), in rank order; collective when
    torch.distributed is initialised. Exchanged as a tensor: nothing is unpickled."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    local = torch.tensor(values, dtype=torch.int64, device=_collective_device())
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [tensor.tolist() for tensor in gathered]


def _digest_integers(digest: bytes) -> list:
    return [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in range(0, DIGEST_BYTES, 8)]


def _digest_hex(integers: list) -> str:
    return b"".join(value.to_bytes(8, "little", signed=True) for value in integers).hex()


def save_checkpoint(root, step: int, state: dict, *, rank: int, world_size: int, keep: int = 2,
                    before_rename=None) -> pathlib.Path:
    """Write this rank's `state` for `step` (collective over the default group); returns the step directory.

    keep: complete checkpoints to keep (rank 0 deletes older ones and unfinished ones), >= 1.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1")
    directory = step_directory(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # a manifest left from an earlier save of this step no longer describes the files
        (directory / MANIFEST).unlink(missing_ok=True)
    for stale in directory.glob(f".{rank_file_name(rank)}.tmp-*"):  # left by an earlier crash at this step
        stale.unlink()
    path = rank_file(root, step, rank)
    atomic_write(path, lambda temporary: torch.save(state, temporary), before_rename)
    size, digest = file_digest(path)
    entries = gather_integers([size, *_digest_integers(digest)])  # returns once every rank's file is in place
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                    "files": [{"name": rank_file_name(r), "bytes": entry[0], "sha256": _digest_hex(entry[1:])}
                              for r, entry in enumerate(entries)]}
        atomic_write(directory / MANIFEST, lambda temporary: temporary.write_text(json.dumps(manifest, indent=1)))
        atomic_write(pathlib.Path(root) / LATEST, lambda temporary: temporary.write_text(f"{step}\n"))
        _delete_old(root, step, keep)
    return directory


def _delete_old(root, step: int, keep: int) -> None:
    """Delete step directories older than `step`, except the newest keep - 1 complete ones."""
    older = [s for s in saved_steps(root) if s < step]
    complete = [s for s in older if (step_directory(root, s) / MANIFEST).is_file()]
    kept = set(complete[:keep - 1])
    for old in older:
        if old not in kept:
            shutil.rmtree(step_directory(root, old), ignore_errors=True)


def _read_manifest(root, step: int) -> tuple:
    """(Finding, manifest or None): the manifest of `step`, checked for form."""
    path = step_directory(root, step) / MANIFEST
    if not path.is_file():
        return Finding.NO_MANIFEST, None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        well_formed = (manifest["format"] == FORMAT and manifest["step"] == step
                       and isinstance(manifest["world_size"], int) and len(files) == manifest["world_size"]
                       and all(entry["name"] == rank_file_name(r) and isinstance(entry["bytes"], int)
                               and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) for r, entry in enumerate(files)))
    except (ValueError, KeyError, TypeError, OSError):
        well_formed = False
    return (Finding.GOOD, manifest) if well_formed else (Finding.BAD_MANIFEST, None)


def _check_rank_file(root, step: int, manifest: dict, rank: int) -> tuple:
    """(Finding, detail, state): this rank's file of `step` checked against the manifest, then loaded."""
    entry = manifest["files"][rank]
    path = rank_file(root, step, rank)
    if not path.is_file():
        return Finding.MISSING, 0, None
    size, digest = file_digest(path)
    if size != entry["bytes"]:
        return Finding.SIZE, size, None
    if digest.hex() != entry["sha256"]:
        return Finding.CHECKSUM, 0, None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 (any failure to unpickle safely means the same: do not use the file)
        return Finding.REFUSED, 0, None
    if not isinstance(state, dict) or state.get("step") != step:
        return Finding.REFUSED, 0, None
    return Finding.GOOD, 0, state


def describe_finding(rank: int, finding: Finding, detail: int, manifest: dict | None) -> str:
    """One clause naming the file and what is wrong with it."""
    name = rank_file_name(rank)
    if finding == Finding.MISSING:
        return f"{name} is missing"
    if finding == Finding.SIZE:
        expected = manifest["files"][rank]["bytes"] if manifest else "another size"
        how = "truncated" if isinstance(expected, int) and detail < expected else "resized"
        return f"{name} is {how} ({detail} bytes; the manifest says {expected})"
    if finding == Finding.CHECKSUM:
        return f"{name} does not match its sha256 checksum (the file is damaged)"
    if finding == Finding.REFUSED:
        return (f"{name} is not a checkpoint that loads safely (torch.load with weights_only=True refused it or "
                f"found something else)")
    if finding == Finding.NO_MANIFEST:
        return f"no {MANIFEST}: its save did not finish"
    if finding == Finding.BAD_MANIFEST:
        return f"{MANIFEST} is damaged"
    return f"written by {detail} processes"


def load_checkpoint(root, *, rank: int, world_size: int, step: int | None = None) -> dict:
    """This rank's verified state of the checkpoint at `step` (default: the one `latest` names).

    CheckpointError says what is wrong: no checkpoint, another world size, a missing, truncated, damaged
    or unsafe file.
    """
    step = latest_step(root) if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint under {root} (no '{LATEST}' file)")
    if not step_directory(root, step).is_dir():
        raise CheckpointError(f"the step-{step} checkpoint directory {step_directory(root, step)} is missing")
    finding, manifest = _read_manifest(root, step)
    if finding != Finding.GOOD:
        raise CheckpointError(f"the step-{step} checkpoint under {root}: {describe_finding(0, finding, 0, None)}")
    if manifest["world_size"] != world_size:
        raise CheckpointError(f"the step-{step} checkpoint under {root} was written by {manifest['world_size']} "
                              f"processes; this job has {world_size}: resume with {manifest['world_size']}")
    finding, detail, state = _check_rank_file(root, step, manifest, rank)
    if finding != Finding.GOOD:
        raise CheckpointError(f"the step-{step} checkpoint under {root}: "
                              f"{describe_finding(rank, finding, detail, manifest)}")
    return state


@dataclasses.dataclass
class Resumed:
    """The outcome of resume_newest: the step and this rank's state (None, 0: nothing to resume), and one
    clause per newer checkpoint passed over, saying why."""

    step: int
    state: dict | None
    passed_over: list


def _pointer_note(root) -> tuple:
    """(note or None, whether `latest` exists): what is wrong with the `latest` file, if anything."""
    try:
        step = latest_step(root)
    except CheckpointError as error:
        return f"{error} (ignored)", True
    if step is not None and not step_directory(root, step).is_dir():
        return f"'{LATEST}' names step {step}, whose directory is missing", True
    return None, step is not None


def resume_newest(root, *, rank: int, world_size: int) -> Resumed:
    """This rank's state of the newest checkpoint under `root` that every rank verified (collective).

    Returns Resumed(0, None, notes) when there is nothing to resume: no checkpoint, or only unfinished saves.
    Raises CheckpointError (the same on every rank) when checkpoints exist but none is usable, or when the
    newest usable one was written by another number of processes.
    """
    notes = []
    pointer_note, has_pointer = _pointer_note(root)
    if pointer_note:
        notes.append(pointer_note)
    damaged = pointer_note is not None
    for step in saved_steps(root):
        finding, manifest = _read_manifest(root, step)
        detail, state = 0, None
        if finding == Finding.GOOD and manifest["world_size"] != world_size:
            finding, detail = Finding.WORLD_SIZE, manifest["world_size"]
        elif finding == Finding.GOOD:
            finding, detail, state = _check_rank_file(root, step, manifest, rank)
        findings = gather_integers([int(finding), detail])
        worst = max(Finding(f) for f, _ in findings)
        if worst == Finding.GOOD:
            return Resumed(step, state, notes)
        if worst == Finding.WORLD_SIZE:
            written_by = max(d for f, d in findings if f == Finding.WORLD_SIZE)
            raise CheckpointError(f"the step-{step} checkpoint in {root} was written by {written_by} processes; "
                                  f"this job has {world_size}: resume with {written_by} processes, or start over "
                                  f"with --no-resume (or another --out-dir)")
        if worst in (Finding.NO_MANIFEST, Finding.BAD_MANIFEST):
            notes.append(f"step {step}: {describe_finding(0, worst, 0, None)}")
            damaged = damaged or worst == Finding.BAD_MANIFEST
            continue
        problems = [describe_finding(r, Finding(f), d, manifest)
                    for r, (f, d) in enumerate(findings) if f != Finding.GOOD]
        notes.append(f"step {step}: {', '.join(problems)}")
        damaged = True
    if damaged or has_pointer:
        raise CheckpointError(f"no usable checkpoint in {root} ({'; '.join(notes) or 'none found'}): start over "
                              f"with --no-resume, or use another --out-dir")
    return Resumed(0, None, notes)
