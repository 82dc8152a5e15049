"""Faults: a killed or hung rank stops the whole job naming the rank; crashes mid-save keep the last
checkpoint; NaN/Inf values are reported with step and layer, then stop the job or skip the step."""
import datetime
import json
import os
import re
import subprocess
import sys
import threading
import time
import types

import pytest
import torch.distributed as dist

from nvfp4_dist.launch import checkpoint, faults

QUICK = ["--micro-batch", "4", "--warmup-steps", "2", "--no-progress", "--log-every", "1"]
# The watchdog's judgement has quick tests below; these jobs show it stopping real processes.
WAITS_OUT_A_TIMEOUT = pytest.mark.slow(reason="a 2-process training job that runs until the watchdog's 10 s timeout "
                                              "or the launcher's 10 s grace stops it")
SECRET = bytes(range(32))  # the job's shared secret in the watchdog tests


def run_train(out_dir, *flags, timeout=180):
    command = [sys.executable, "-m", "nvfp4_dist.launch.train", *QUICK, "--out-dir", str(out_dir), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return result, time.monotonic() - started


def assert_one_line_reports(stderr: str, most: int) -> None:
    """No C++ stack frames, no Python traceback, and at most `most` lines in all."""
    assert "frame #" not in stderr and "Exception raised from" not in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(stderr.strip().splitlines()) <= most, stderr[-3000:]


@WAITS_OUT_A_TIMEOUT
@pytest.mark.parametrize("rank", [0, 1])
def test_killed_rank_stops_the_job_naming_it_in_one_line(tmp_path, rank):
    """Rank 0 hosts the job's store: its death reaches the other rank's watchdog as well as the launcher."""
    result, seconds = run_train(tmp_path, "--steps", "30", "--inject-fault", f"kill:3:{rank}",
                                "--watchdog-timeout", "10")
    assert result.returncode != 0
    assert f"rank {rank} exited first (killed by SIGKILL)" in result.stderr, result.stderr[-3000:]
    assert_one_line_reports(result.stderr, most=3)
    assert seconds < 90


@WAITS_OUT_A_TIMEOUT
@pytest.mark.parametrize("step", [1, 3])
def test_hung_rank_stops_the_job_naming_it_and_its_step(tmp_path, step):
    """At step 1 the hung rank never joined a collective: it is named within the watchdog timeout all the same."""
    # A timeout that a slow first step on a loaded machine (one-time work, 2 shared cores) stays below
    result, seconds = run_train(tmp_path, "--steps", "30", "--inject-fault", f"hang:{step}:1",
                                "--watchdog-timeout", "10")
    assert result.returncode == faults.WATCHDOG_EXIT_CODE, result.stderr[-3000:]
    assert f"hung rank 1 at step {step} (not in a collective" in result.stderr, result.stderr[-3000:]
    assert "waiting for it in a collective: rank(s) 0" in result.stderr
    assert_one_line_reports(result.stderr, most=2)
    assert seconds < 75


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    crashed, _ = run_train(tmp_path, "--steps", "6", "--save-every", "2", "--inject-fault", "crash-in-save:4:1")
    assert crashed.returncode != 0
    assert "crashing while saving the step-4 checkpoint" in crashed.stderr
    root = tmp_path / "checkpoints"
    assert checkpoint.latest_step(root) == 2
    assert not (checkpoint.step_directory(root, 4) / checkpoint.MANIFEST).exists()
    for rank in range(2):
        state = checkpoint.load_checkpoint(root, rank=rank, world_size=2)
        assert state["step"] == 2 and state["model"]
    resumed, _ = run_train(tmp_path, "--steps", "6", "--save-every", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("resumed from the step-2 checkpoint in " f"{root}, the newest complete and verified one (step 4: no "
            "manifest.json: its save did not finish)") in resumed.stdout
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


def _watchdogs(timeout_s, announce=False):
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    exits = {}
    dogs = [faults.Watchdog(store, rank, 2, timeout_s, interval_s=0.1, secret=SECRET, announce=announce,
                            exit_fn=lambda code, rank=rank: exits.setdefault(rank, code)) for rank in range(2)]
    return dogs, exits


def _keep_training(dog, seconds):
    """Advance `dog`'s step every 50 ms for `seconds` (a rank that makes progress)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        dog.beat(dog.step + 1)
        time.sleep(0.05)


def test_watchdog_names_a_silent_rank_with_its_latest_step(capsys):
    dogs, exits = _watchdogs(timeout_s=0.6)
    for dog in dogs:
        dog.start()
    _keep_training(dogs[0], 0.3)
    dogs[1].beat(7)  # published at once, not at the next heartbeat
    dogs[1]._stopping.set()  # rank 1 goes silent without saying it finished (as a killed process would)
    dogs[1]._thread.join()
    _keep_training(dogs[0], 2.0)
    dogs[0]._thread.join(timeout=5)
    assert exits == {0: faults.WATCHDOG_EXIT_CODE}
    assert "no heartbeat from rank 1 (last completed step 7," in dogs[0].verdict
    err = capsys.readouterr().err
    assert err.count("stopping the job") == 1 and "last completed step 7," in err


def test_watchdog_ignores_a_verdict_the_jobs_ranks_did_not_sign(capsys):
    """Anything that reaches the store's port can write its verdict key: unsigned, or signed with another secret,
    such a verdict stops nothing and is said once; the job's own verdict still stops it."""
    dogs, exits = _watchdogs(timeout_s=5.0, announce=True)
    for dog in dogs:
        dog.start()
    forged = ["0|rank 1 is dead", faults.sign_verdict(bytes(32), 0, "rank 1 is dead"),
              "0|" + faults.sign_verdict(SECRET, 0, "rank 1 is dead").split("|", 2)[1] + "|rank 1 hung"]
    for value in forged:
        dogs[0].store.set(faults.VERDICT_KEY, value)
        for dog in dogs:
            _keep_training(dog, 0.3)
    assert exits == {} and dogs[0].verdict is None and dogs[1].verdict is None
    err = capsys.readouterr().err
    for rank in range(2):
        assert err.count(f"nvfp4-train watchdog (rank {rank}): ignoring a verdict in the job's store that no rank of "
                         f"this job signed") == len(forged), err
    dogs[0].store.set(faults.VERDICT_KEY, faults.sign_verdict(SECRET, 0, "rank 1 hung"))
    for dog in dogs:
        dog._thread.join(timeout=5)
    assert exits == {0: faults.WATCHDOG_EXIT_CODE, 1: faults.WATCHDOG_EXIT_CODE}
    assert dogs[1].verdict == "rank 1 hung"


def test_a_following_rank_says_whose_verdict_stopped_the_job(capsys):
    """The first process of a node (announce) names the verdict it follows and the rank that gave it; the others
    stay quiet (the reporting rank printed it already)."""
    dogs, exits = _watchdogs(timeout_s=5.0)
    dogs[1].announce = True
    dogs[0].store.set(faults.VERDICT_KEY, faults.sign_verdict(SECRET, 3, "no heartbeat from rank 2"))
    for dog in dogs:
        dog.start()
    for dog in dogs:
        dog._thread.join(timeout=5)
    assert exits == {0: faults.WATCHDOG_EXIT_CODE, 1: faults.WATCHDOG_EXIT_CODE}
    assert dogs[0].verdict == dogs[1].verdict == "no heartbeat from rank 2"
    assert capsys.readouterr().err == ("nvfp4-train watchdog (rank 1): stopping: rank 3's watchdog stopped the job: "
                                       "no heartbeat from rank 2\n")


def test_a_verdict_is_signed_by_the_secret_and_the_rank():
    value = faults.sign_verdict(SECRET, 1, "hung rank 0 | at step 3")
    assert faults.open_verdict(SECRET, value) == (1, "hung rank 0 | at step 3")
    assert faults.open_verdict(bytes(32), value) is None
    assert faults.open_verdict(SECRET, "0" + value[1:]) is None  # another rank's name on rank 1's signature
    assert faults.open_verdict(SECRET, value[:-1]) is None
    with pytest.raises(ValueError, match="secret: empty"):
        faults.Watchdog(dist.HashStore(), 0, 1, 5.0, secret=b"")


def test_a_rank_is_starting_up_until_its_first_beat():
    store = dist.HashStore()
    dog = faults.Watchdog(store, 0, 1, 5.0, interval_s=0.05, secret=SECRET)
    dog._publish(1)
    assert faults.Activity.decode(store.get("activity/0").decode()).starting_up is True
    dog.beat(0)  # set up: resuming from step 0
    dog._publish(2)
    assert faults.Activity.decode(store.get("activity/0").decode()).starting_up is False


def test_watchdog_store_values_are_plain_text():
    """What a rank publishes is text of a fixed form: nothing a peer sends is unpickled."""
    store = dist.HashStore()
    dog = faults.Watchdog(store, 0, 1, 5.0, interval_s=0.05, secret=SECRET)
    dog.beat(3)
    dog._publish(1)
    assert store.get("step/0") == b"3" and store.get("alive/0") == b"1"
    activity = faults.Activity.decode(store.get("activity/0").decode())
    assert activity.in_collective is False and activity.starting_up is False
    assert activity.where.startswith("faults.py:")  # the main thread, here inside the call itself
    assert faults.Activity.decode(faults.Activity(True, False, "a|b").encode()) == faults.Activity(True, False, "a|b")


def test_a_thread_in_torch_distributed_counts_as_waiting_in_a_collective():
    """Collectives are recognised by the module their frames belong to (faults.COLLECTIVE_MODULES)."""
    entered, release = threading.Event(), threading.Event()

    def wait():
        entered.set()
        release.wait(10)
    # the same code, run as a function of torch.distributed's c10d module
    in_c10d = types.FunctionType(wait.__code__, vars(dist.distributed_c10d), "wait", closure=wait.__closure__)
    thread = threading.Thread(target=in_c10d)
    thread.start()
    try:
        entered.wait(10)
        assert faults.thread_activity(threading.get_ident()).in_collective is True
    finally:
        release.set()
        thread.join()
    assert faults.thread_activity(threading.get_ident()).in_collective is False


def _stalled_ranks(*activities, step=0):
    """Rank states whose step has not changed for an hour, with the given activities."""
    return {rank: faults.RankState(alive="1", alive_since=1e9, step=step, step_since=1.0,
                                   activity=faults.Activity(*activity, f"where {rank}"))
            for rank, activity in enumerate(activities)}


@pytest.mark.parametrize("activities, step, verdict", [
    # rank 1 never reached a collective while rank 0 waits in one: hung, even before the first step
    (((True, False), (False, False)), 0, "hung rank 1 at step 1 (not in a collective; at where 1); waiting for it "
                                         "in a collective: rank(s) 0"),
    (((True, False), (False, False)), 4, "hung rank 1 at step 5"),
    # setting up or building the kernels (load_extension) is start-up, however long it takes
    (((True, False), (False, True)), 0, None),
    (((True, True), (True, False)), 0, None),
    # every rank busy before the first step (start-up work): no verdict; after it, all of them hang
    (((False, False), (False, False)), 0, None),
    (((False, False), (False, False)), 2, "hung rank 0 at step 3 (not in a collective; at where 0); rank 1 at step 3"),
    (((True, False), (True, False)), 2, "while every rank waits in a collective (rank 0 after step 2, rank 1 after "
                                        "step 2): mismatched collectives or a network hang"),
])
def test_watchdog_judges_a_stalled_job(activities, step, verdict):
    dog = faults.Watchdog(dist.HashStore(), 0, len(activities), timeout_s=5.0, secret=SECRET)
    message, _ = dog._judge(_stalled_ranks(*activities, step=step), now=1e9)
    if verdict is None:
        assert message is None
    else:
        assert verdict in message


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


def test_a_rank_that_died_just_after_a_step_is_named_dead_not_hung():
    """Its step and its heartbeat went quiet together: the step's timeout may pass first, the verdict waits."""
    dog = faults.Watchdog(dist.HashStore(), 0, 2, timeout_s=5.0, interval_s=1.0, secret=SECRET)
    ranks = _stalled_ranks((False, False), (False, False), step=7)
    ranks[0].step_since = 1e9  # rank 0 keeps training
    ranks[1].alive_since = 1e9 - 4.0  # rank 1's last heartbeat came just before its last step
    message, _ = dog._judge(ranks, now=1e9)
    assert message is None
    message, silent = dog._judge(ranks, now=1e9 + 1.5)
    assert "no heartbeat from rank 1 (last completed step 7," in message and silent == {1}
