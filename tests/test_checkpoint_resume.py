"""nvfp4-train resuming from damaged checkpoints (2 CPU processes): it resumes from the newest checkpoint that
verifies on every rank and says in one line which newer one it passed over and why, or stops with one line;
a damaged file never loads and a crafted one runs nothing."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from nvfp4_dist.launch import checkpoint

QUICK = ["--micro-batch", "4", "--warmup-steps", "2", "--no-progress", "--log-every", "1", "--save-every", "2"]


def run_train(out_dir, *flags):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "nvfp4_dist.launch.train", *QUICK, "--out-dir", str(out_dir),
                           *flags], capture_output=True, text=True, timeout=240, env=env)


def losses(out_dir):
    return [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step job with complete checkpoints at steps 2 and 4, and its losses."""
    out_dir = tmp_path_factory.mktemp("trained")
    result = run_train(out_dir, "--steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir, losses(out_dir)


@pytest.fixture
def copy(trained, tmp_path):
    out_dir = tmp_path / "job"
    shutil.copytree(trained[0], out_dir)
    return out_dir, out_dir / "checkpoints"


class RunsCode:
    """Pickles as a call of exec: unpickling it with weights_only=False runs the code."""

    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def overwrite_16_kib(path):
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        handle.write(os.urandom(16384))


def plant_payload(root, marker):
    """Replace rank 1's step-4 file by one that runs code when unpickled, and vouch for it in the manifest."""
    path = checkpoint.rank_file(root, 4, 1)
    torch.save({"step": 4, "model": RunsCode(f"open({str(marker)!r}, 'w').write('ran')")}, path)
    manifest_path = checkpoint.step_directory(root, 4) / checkpoint.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    data = path.read_bytes()
    manifest["files"][1].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, reason", [
    (lambda root: overwrite_16_kib(checkpoint.rank_file(root, 4, 1)),
     "step 4: rank_00001.pt does not match its sha256 checksum (the file is damaged)"),
    (lambda root: os.truncate(checkpoint.rank_file(root, 4, 0), 1000),
     "step 4: rank_00000.pt is truncated (1000 bytes; the manifest says"),
    (lambda root: checkpoint.rank_file(root, 4, 1).unlink(), "step 4: rank_00001.pt is missing"),
    (lambda root: shutil.rmtree(checkpoint.step_directory(root, 4)),
     "'latest' names step 4, whose directory is missing"),
])
def test_resume_passes_over_a_damaged_checkpoint_and_reproduces_the_run(trained, copy, damage, reason):
    out_dir, root = copy
    damage(root)
    result = run_train(out_dir, "--steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("resumed from")]
    assert len(lines) == 1 and lines[0].startswith(f"resumed from the step-2 checkpoint in {root}, the newest "
                                                   f"complete and verified one ("), result.stdout
    assert reason in lines[0]
    assert losses(out_dir)[-2:] == trained[1][2:]  # steps 3 and 4 again, exactly
    assert checkpoint.load_checkpoint(root, rank=1, world_size=2)["step"] == 4  # step 4 saved anew


def test_a_garbage_latest_pointer_is_ignored(copy):
    out_dir, root = copy
    (root / checkpoint.LATEST).write_text("banana\n")
    result = run_train(out_dir, "--steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"resumed from the step-4 checkpoint in {root}, the newest complete and verified one ({root}/latest "
            "holds 'banana', not a step number (ignored))") in result.stdout
    assert "nothing to train" in result.stdout


def test_a_crafted_pickle_is_refused_and_runs_nothing(trained, copy, tmp_path):
    out_dir, root = copy
    marker = tmp_path / "payload_ran"
    plant_payload(root, marker)
    result = run_train(out_dir, "--steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists()
    assert ("resumed from the step-2 checkpoint" in result.stdout
            and "step 4: rank_00001.pt is not a checkpoint that loads safely" in result.stdout), result.stdout
    assert losses(out_dir)[-2:] == trained[1][2:]


def test_no_usable_checkpoint_stops_the_job_in_one_line(copy):
    out_dir, root = copy
    overwrite_16_kib(checkpoint.rank_file(root, 4, 0))
    os.truncate(checkpoint.rank_file(root, 2, 1), 10)
    result = run_train(out_dir, "--steps", "6")
    assert result.returncode == 2
    assert result.stderr.startswith(f"nvfp4-train: error: no usable checkpoint in {root} (step 4: rank_00000.pt "
                                    "does not match its sha256 checksum"), result.stderr[-3000:]
    assert "step 2: rank_00001.pt is truncated (10 bytes" in result.stderr and "--no-resume" in result.stderr
    assert result.stderr.count("\n") == 1
