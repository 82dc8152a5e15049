"""What an nvfp4-train checkpoint holds (model, optimizer, RNG, step, the job's shape) and resuming from one.

Each rank's file holds its own tensors: its TP shards, and with --fsdp its FSDP2 shards (as plain tensors)."""
from __future__ import annotations

import shutil

import torch
import torch.distributed as dist

from nvfp4_dist.launch import checkpoint, sharding
from nvfp4_dist.launch.plan import CHECKPOINT_DIRECTORY, SettingError

# Flags a resumed run must share with its checkpoint (the state's shapes, sharding and keys depend on them), and
# the value of those that checkpoints of older versions do not record.
CHECKPOINT_FLAGS = ("model", "layers", "hidden", "heads", "ffn", "seq_length", "tp", "sp", "world_size",
                    "fused_producers", "fsdp")
UNRECORDED_FLAG_VALUES = {"fused_producers": False, "fsdp": False}


def mismatch_detail(key: str, old, new) -> str:
    """One flag's difference between a checkpoint and this run, with the flag that resumes it where that is a
    switch with two spellings (checkpoints made before --fused-producers was on by default have it off)."""
    flag = "--" + key.replace("_", "-")
    hint = f" (resume with {flag if old else '--no-' + flag[2:]})" if key == "fused_producers" else ""
    return f"{flag}: checkpoint {old}, now {new}{hint}"


def checkpoints_directory(plan):
    return plan.args.out_dir / CHECKPOINT_DIRECTORY


def checkpoint_config(plan) -> dict:
    args = plan.args
    return {"model": plan.model, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "ffn": plan.ffn, "seq_length": args.seq_length, "tp": plan.tp, "sp": args.sp,
            "world_size": plan.world_size, "fused_producers": plan.fused_producers, "fsdp": plan.fsdp}


def rng_state(device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(plan, step: int, model, optimizer, *, rank: int, device):
    """Checkpoint this rank's state after `step` (collective); returns the step directory."""
    state = {"step": step, "model": sharding.local_state(model.state_dict()),
             "optimizer": sharding.local_state(optimizer.state_dict()), "rng": rng_state(device),
             "config": checkpoint_config(plan)}
    hook = plan.fault.crash_before_rename(step, rank) if plan.fault is not None else None
    return checkpoint.save_checkpoint(checkpoints_directory(plan), step, state, rank=rank,
                                      world_size=plan.world_size, keep=plan.args.keep_checkpoints,
                                      before_rename=hook)


def resume(plan, model, optimizer, *, rank: int, device) -> tuple:
    """(step, message): load the newest verified checkpoint into model, optimizer and the RNG (collective).

    step 0: nothing to resume. message: one line for the log saying where training resumes from and which
    newer checkpoints were passed over and why (or None). SettingError (the same on every rank) when the
    checkpoints cannot be used: none usable, or of another shape.
    """
    root = checkpoints_directory(plan)
    if plan.args.no_resume and rank == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()
    if plan.args.no_resume:
        return 0, None
    try:
        resumed = checkpoint.resume_newest(root, rank=rank, world_size=plan.world_size)
    except checkpoint.CheckpointError as error:
        raise SettingError(str(error)) from None
    passed_over = f" ({'; '.join(resumed.passed_over)})" if resumed.passed_over else ""
    if resumed.state is None:
        return 0, (f"no complete checkpoint in {root}{passed_over}: starting at step 1" if passed_over else None)
    saved = resumed.state["config"]
    recorded = {key: saved.get(key, UNRECORDED_FLAG_VALUES.get(key)) for key in CHECKPOINT_FLAGS}
    mismatched = {key: (recorded[key], value) for key, value in checkpoint_config(plan).items()
                  if recorded[key] != value}
    if mismatched:
        details = ", ".join(mismatch_detail(key, old, new) for key, (old, new) in mismatched.items())
        raise SettingError(f"the step-{resumed.step} checkpoint in {root} does not fit this run ({details}); use "
                           f"the same flags, another --out-dir, or --no-resume")
    model.load_state_dict(sharding.sharded_model_state(model, resumed.state["model"]))
    optimizer.load_state_dict(sharding.sharded_optimizer_state(optimizer, resumed.state["optimizer"]))
    restore_rng(resumed.state["rng"], device)
    newest = ", the newest complete and verified one" if passed_over else ""
    return resumed.step, f"resumed from the step-{resumed.step} checkpoint in {root}{newest}{passed_over}"
