"""Faults: a killed or hung rank stops the whole job naming the rank; crashes mid-save keep the last
checkpoint; NaN/Inf values are reported with step and layer, then stop the job or skip the step."""
import datetime
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from nvfp4_dist.launch import checkpoint, faults

QUICK = ["--micro-batch", "4", "--warmup-steps", "2", "--no-progress", "--log-every", "1"]


def run_train(out_dir, *flags, timeout=180):
    command = [sys.executable, "-m", "nvfp4_dist.launch.train", *QUICK, "--out-dir", str(out_dir), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return result, time.monotonic() - started


def test_killed_rank_stops_the_job_naming_it(tmp_path):
    result, seconds = run_train(tmp_path, "--steps", "30", "--inject-fault", "kill:3:1", "--watchdog-timeout", "10")
    assert result.returncode != 0
    assert "rank 1 exited first (killed by SIGKILL)" in result.stderr, result.stderr[-3000:]
    assert seconds < 90


def test_hung_rank_stops_the_job_naming_it(tmp_path):
    result, seconds = run_train(tmp_path, "--steps", "30", "--inject-fault", "hang:3:1", "--watchdog-timeout", "6")
    assert result.returncode != 0
    assert "hung rank 1 at step 3 (not in a collective" in result.stderr, result.stderr[-3000:]
    assert seconds < 90


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    crashed, _ = run_train(tmp_path, "--steps", "6", "--save-every", "2", "--inject-fault", "crash-in-save:4:1")
    assert crashed.returncode != 0
    assert "crashing while saving the step-4 checkpoint" in crashed.stderr
    root = tmp_path / "checkpoints"
    assert checkpoint.latest_step(root) == 2
    for rank in range(2):
        state = checkpoint.load_checkpoint(root, rank=rank, world_size=2)
        assert state["step"] == 2 and state["model"]
    resumed, _ = run_train(tmp_path, "--steps", "6", "--save-every", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the step-2 checkpoint" in resumed.stdout
    assert checkpoint.latest_step(root) == 6
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[-4:] == [3, 4, 5, 6]


def test_nonfinite_amax_stops_with_step_and_layer(tmp_path):
    result, _ = run_train(tmp_path, "--steps", "4", "--inject-fault", "nan:2")
    assert result.returncode == 4, result.stderr[-3000:]
    assert "non-finite value at step 2 in layer layers.0.qkv (forward)" in result.stderr
    assert re.search(r"amax_(rowwise|columnwise) is not finite", result.stderr)


def test_nonfinite_amax_step_is_skipped_on_request(tmp_path):
    result, _ = run_train(tmp_path, "--steps", "4", "--inject-fault", "nan:2", "--on-nonfinite", "skip")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2: skipped the update: non-finite value in layer layers.0.qkv (forward)" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["loss"] is None and "layers.0.qkv" in records[1]["skipped"]
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in records[2:])


def test_atomic_save_crash_leaves_last_checkpoint_and_stale_temp_is_replaced(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 1, {"step": 1, "value": torch.arange(4)}, rank=0, world_size=1)

    def crash(temporary):
        raise KeyboardInterrupt("simulated crash before the rename")

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, 2, {"step": 2, "value": torch.arange(8)}, rank=0, world_size=1,
                                   before_rename=crash)
    assert checkpoint.latest_step(tmp_path) == 1
    assert list(checkpoint.step_directory(tmp_path, 2).glob(".rank_00000.pt.tmp-*"))
    assert torch.equal(checkpoint.load_checkpoint(tmp_path, rank=0, world_size=1)["value"], torch.arange(4))
    checkpoint.save_checkpoint(tmp_path, 2, {"step": 2, "value": torch.arange(8)}, rank=0, world_size=1, keep=1)
    assert checkpoint.latest_step(tmp_path) == 2
    assert not list(checkpoint.step_directory(tmp_path, 2).glob(".*tmp*"))
    assert not checkpoint.step_directory(tmp_path, 1).exists()  # keep=1
    with pytest.raises(ValueError, match="has 1 rank files; this job has 2 ranks"):
        checkpoint.load_checkpoint(tmp_path, rank=0, world_size=2)


def _watchdogs(timeout_s):
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    exits = {}
    dogs = [faults.Watchdog(store, rank, 2, timeout_s, interval_s=0.1,
                            exit_fn=lambda code, rank=rank: exits.setdefault(rank, code)) for rank in range(2)]
    return dogs, exits


def _keep_training(dog, seconds):
    """Advance `dog`'s step every 50 ms for `seconds` (a rank that makes progress)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        dog.beat(dog.step + 1)
        time.sleep(0.05)


def test_watchdog_names_a_silent_rank(capsys):
    dogs, exits = _watchdogs(timeout_s=0.6)
    for dog in dogs:
        dog.start()
    _keep_training(dogs[0], 0.3)
    dogs[1]._stopping.set()  # rank 1 goes silent without saying it finished (as a killed process would)
    dogs[1]._thread.join()
    _keep_training(dogs[0], 2.0)
    dogs[0]._thread.join(timeout=5)
    assert exits == {0: faults.WATCHDOG_EXIT_CODE}
    assert "no heartbeat from rank 1 (last completed step 0" in dogs[0].verdict
    assert "stopping the job" in capsys.readouterr().err


def test_watchdog_ignores_a_rank_that_finished():
    dogs, exits = _watchdogs(timeout_s=0.4)
    for dog in dogs:
        dog.start()
    _keep_training(dogs[0], 0.3)
    dogs[1].stop()
    _keep_training(dogs[0], 1.0)
    dogs[0].stop()
    assert exits == {} and dogs[0].verdict is None


def test_fault_flag_parsing():
    assert faults.FaultInjection.parse("kill:3:1") == faults.FaultInjection("kill", 3, 1)
    assert faults.FaultInjection.parse("nan:2") == faults.FaultInjection("nan", 2, 0)
    for bad in ("kill", "kill:x", "melt:3", "hang:1:2:3"):
        with pytest.raises(ValueError, match="KIND:STEP"):
            faults.FaultInjection.parse(bad)
    assert faults.describe_exit(-9) == "killed by SIGKILL" and faults.describe_exit(1) == "exit code 1"
