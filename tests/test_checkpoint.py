"""Checkpoints: atomic saves, a sha256 manifest per step, weights-only loading, and resuming from the newest
checkpoint that verifies, saying which newer ones were passed over and why. In one process (no process
group) here; tests/test_checkpoint_resume.py damages the checkpoints of a real 2-process job."""
import hashlib
import json
import shutil

import pytest
import torch

from nvfp4_dist.launch import checkpoint


def state(step):
    return {"step": step, "model": {"weight": torch.full((64, 64), float(step))}, "rng": torch.get_rng_state(),
            "config": {"hidden": 64}}


@pytest.fixture
def root(tmp_path):
    """Complete checkpoints at steps 2 and 4 (world size 1)."""
    for step in (2, 4):
        checkpoint.save_checkpoint(tmp_path, step, state(step), rank=0, world_size=1)
    return tmp_path


class RunsCode:
    """Pickles as a call of exec: unpickling it with weights_only=False runs the code."""

    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def rewrite_manifest_for(root, step):
    """Make the manifest agree with the files as they are now (what someone who crafts a file would do)."""
    path = checkpoint.step_directory(root, step) / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    for entry in manifest["files"]:
        data = (checkpoint.step_directory(root, step) / entry["name"]).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    path.write_text(json.dumps(manifest))


def overwrite_16_kib(path):
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2 - 8192)
        handle.write(b"\xa5" * 16384)


def truncate(path):
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 3)


def test_save_writes_files_a_manifest_and_the_pointer(root):
    assert checkpoint.latest_step(root) == 4
    manifest = json.loads((checkpoint.step_directory(root, 4) / checkpoint.MANIFEST).read_text())
    data = checkpoint.rank_file(root, 4, 0).read_bytes()
    assert manifest["step"] == 4 and manifest["world_size"] == 1
    assert manifest["files"] == [{"name": "rank_00000.pt", "bytes": len(data),
                                  "sha256": hashlib.sha256(data).hexdigest()}]
    loaded = checkpoint.load_checkpoint(root, rank=0, world_size=1)
    assert loaded["step"] == 4 and torch.equal(loaded["model"]["weight"], torch.full((64, 64), 4.0))
    resumed = checkpoint.resume_newest(root, rank=0, world_size=1)
    assert (resumed.step, resumed.passed_over) == (4, [])


@pytest.mark.parametrize("damage, reason", [
    (lambda root: overwrite_16_kib(checkpoint.rank_file(root, 4, 0)),
     "step 4: rank_00000.pt does not match its sha256 checksum (the file is damaged)"),
    (lambda root: truncate(checkpoint.rank_file(root, 4, 0)), "step 4: rank_00000.pt is truncated ("),
    (lambda root: checkpoint.rank_file(root, 4, 0).unlink(), "step 4: rank_00000.pt is missing"),
    (lambda root: (checkpoint.step_directory(root, 4) / checkpoint.MANIFEST).unlink(),
     "step 4: no manifest.json: its save did not finish"),
    (lambda root: (checkpoint.step_directory(root, 4) / checkpoint.MANIFEST).write_text("{not json"),
     "step 4: manifest.json is damaged"),
    (lambda root: shutil.rmtree(checkpoint.step_directory(root, 4)),
     "'latest' names step 4, whose directory is missing"),
    (lambda root: (root / checkpoint.LATEST).write_bytes(b"\x00garbage\xff"), "not a step number (ignored)"),
])
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one(root, damage, reason):
    damage(root)
    resumed = checkpoint.resume_newest(root, rank=0, world_size=1)
    expected_step = 4 if "not a step number" in reason else 2  # a garbage pointer alone leaves step 4 intact
    assert resumed.step == expected_step and resumed.state["step"] == expected_step
    assert any(reason in note for note in resumed.passed_over), resumed.passed_over


@pytest.mark.parametrize("damage, message", [
    (overwrite_16_kib, "does not match its sha256 checksum"),
    (truncate, "is truncated"),
    (lambda path: path.unlink(), "is missing"),
])
def test_loading_a_damaged_file_says_which_and_why(root, damage, message):
    damage(checkpoint.rank_file(root, 4, 0))
    with pytest.raises(checkpoint.CheckpointError, match=f"the step-4 checkpoint under .*: rank_00000.pt {message}"):
        checkpoint.load_checkpoint(root, rank=0, world_size=1)


def test_a_file_that_would_run_code_is_refused_and_runs_nothing(root, tmp_path_factory):
    marker = tmp_path_factory.mktemp("marker") / "ran"
    path = checkpoint.rank_file(root, 4, 0)
    torch.save({"step": 4, "model": RunsCode(f"open({str(marker)!r}, 'w').write('ran')")}, path)
    rewrite_manifest_for(root, 4)  # the checksum cannot tell: the file is exactly what its writer meant
    torch.load(path, weights_only=False)  # the payload is real: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="rank_00000.pt is not a checkpoint that loads safely"):
        checkpoint.load_checkpoint(root, rank=0, world_size=1)
    resumed = checkpoint.resume_newest(root, rank=0, world_size=1)
    assert resumed.step == 2 and "step 4: rank_00000.pt is not a checkpoint that loads safely" in resumed.passed_over[0]
    assert not marker.exists()


def test_no_usable_checkpoint_is_an_error_that_names_each_one(root):
    overwrite_16_kib(checkpoint.rank_file(root, 4, 0))
    checkpoint.rank_file(root, 2, 0).unlink()
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.resume_newest(root, rank=0, world_size=1)
    message = str(error.value)
    assert message.startswith(f"no usable checkpoint in {root} (step 4: rank_00000.pt does not match")
    assert "step 2: rank_00000.pt is missing" in message and "--no-resume" in message
    assert "\n" not in message


def test_another_world_size_is_an_error_not_a_fallback(root):
    with pytest.raises(checkpoint.CheckpointError, match="the step-4 checkpoint in .* was written by 1 processes; "
                                                         "this job has 2: resume with 1 processes"):
        checkpoint.resume_newest(root, rank=0, world_size=2)
    with pytest.raises(checkpoint.CheckpointError, match="written by 1 processes; this job has 2"):
        checkpoint.load_checkpoint(root, rank=0, world_size=2)


def test_nothing_to_resume_without_checkpoints_or_with_only_an_unfinished_first_save(tmp_path):
    assert checkpoint.resume_newest(tmp_path / "absent", rank=0, world_size=1).state is None

    def crash(temporary):
        raise KeyboardInterrupt("simulated crash before the rename")

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, 2, state(2), rank=0, world_size=1, before_rename=crash)
    resumed = checkpoint.resume_newest(tmp_path, rank=0, world_size=1)
    assert resumed.step == 0 and resumed.state is None
    assert resumed.passed_over == ["step 2: no manifest.json: its save did not finish"]


def test_a_crash_mid_save_keeps_the_last_checkpoint_and_a_later_save_replaces_the_leftovers(root):
    def crash(temporary):
        raise KeyboardInterrupt("simulated crash before the rename")

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(root, 6, state(6), rank=0, world_size=1, before_rename=crash)
    assert checkpoint.latest_step(root) == 4
    assert list(checkpoint.step_directory(root, 6).glob(".rank_00000.pt.tmp-*"))
    assert checkpoint.load_checkpoint(root, rank=0, world_size=1)["step"] == 4
    checkpoint.save_checkpoint(root, 6, state(6), rank=0, world_size=1, keep=1)
    assert checkpoint.latest_step(root) == 6
    assert not list(checkpoint.step_directory(root, 6).glob(".*tmp*"))
    assert checkpoint.saved_steps(root) == [6]  # keep=1


def test_saving_a_step_again_replaces_its_old_manifest(root):
    """A step saved again after falling back past it: its old manifest never vouches for new files."""
    overwrite_16_kib(checkpoint.rank_file(root, 4, 0))

    def crash(temporary):
        raise KeyboardInterrupt("simulated crash before the rename")

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(root, 4, state(4), rank=0, world_size=1, before_rename=crash)
    assert not (checkpoint.step_directory(root, 4) / checkpoint.MANIFEST).exists()
    checkpoint.save_checkpoint(root, 4, state(4), rank=0, world_size=1)
    assert checkpoint.load_checkpoint(root, rank=0, world_size=1, step=4)["step"] == 4


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep=0: must be >= 1"):
        checkpoint.save_checkpoint(tmp_path, 1, state(1), rank=0, world_size=1, keep=0)
