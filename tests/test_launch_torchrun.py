"""The multi-node torchrun recipe for real: two node agents on this machine meet over loopback
(c10d rendezvous) and run nvfp4-train as a 2-node job (one CPU process per node, gloo, TP=2)."""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "launch" / "torchrun_multinode.sh"


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow(reason="starts two torchrun agents, each with its workers, and trains through them")
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_two_node_agents_over_loopback_train_together(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(NNODES="2", NPROC_PER_NODE="1", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID="loopback-test",
               RDZV_TIMEOUT="120", PYTHON=sys.executable)
    flags = ["--device", "cpu", "--steps", "3", "--micro-batch", "4", "--save-every", "3", "--no-progress",
             "--out-dir", str(tmp_path)]
    agents = [subprocess.Popen(["bash", str(SCRIPT), *flags], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-3000:]
    combined = "\n".join(outputs)
    assert "2 processes on 2 node(s), cpu (TP=2, DP=1" in combined
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["loss"] == s["loss"] for s in steps)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000003").iterdir()) == [
        "manifest.json", "rank_00000.pt", "rank_00001.pt"]


STUB_SRUN = """#!/usr/bin/env bash
# Stand-in for srun: one copy of the command per node of the allocation, all on this machine.
while [[ "$1" == --* ]]; do shift; done
pids=()
for _ in $(seq "$SLURM_JOB_NUM_NODES"); do "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
STUB_SCONTROL = """#!/usr/bin/env bash
# Stand-in for `scontrol show hostnames`: every node of this fake allocation is this machine.
echo 127.0.0.1
"""


@pytest.mark.slow(reason="starts torchrun through the SLURM recipe and trains through it")
def test_slurm_torchrun_recipe_with_stand_in_srun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_NUM_NODES="2",
               SLURM_GPUS_ON_NODE="1", SLURM_JOB_ID="42", RDZV_PORT=str(free_port()), PYTHON=sys.executable,
               OUT_DIR=str(tmp_path / "out"))
    sbatch = SCRIPT.parent / "slurm_torchrun.sbatch"
    result = subprocess.run(["bash", str(sbatch), "--device", "cpu", "--steps", "2", "--micro-batch", "4",
                             "--no-progress"], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 processes on 2 node(s)" in result.stdout
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "2"
