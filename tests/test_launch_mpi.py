"""nvfp4_dist.launch.mpi: the torchrun environment derived from MPI, under a real mpirun.

Needs mpi4py and an MPI runtime (CI: apt-get install libopenmpi-dev openmpi-bin; pip install mpi4py);
without them the MPI tests skip and say why (pytest -rs prints the reason)."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from nvfp4_dist.launch import mpi


def mpi4py_missing_reason():
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"mpi4py with an MPI runtime is not installed ({probe.stderr.strip().splitlines()[-1]})"
    return None


def mpirun_command(ranks):
    """mpirun -np N with the options Open MPI needs here (root in CI, 2 cores); skips without mpirun."""
    reason = mpi4py_missing_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not on PATH (apt-get install openmpi-bin)")
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    extra = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    return ["mpirun", "-np", str(ranks), *extra]


def mpi_env(probe_dir=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    if probe_dir is not None:
        probe_dir.mkdir()
        env["PROBE_DIR"] = str(probe_dir)
    return env


PROBE = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    if not dist.is_initialized():  # --no-init: the target initialises itself from the exported variables
        dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    record = {**{k: os.environ[k] for k in keys}, "argv": sys.argv[1:], "backend": dist.get_backend(),
              "sum": total.item()}
    with open(os.path.join(os.environ["PROBE_DIR"], os.environ["RANK"] + ".json"), "w") as handle:
        json.dump(record, handle)
    dist.destroy_process_group()
""")


def probes(directory):
    """Each rank's record (written to PROBE_DIR/<rank>.json), in rank order."""
    return sorted((json.loads(path.read_text()) for path in directory.glob("*.json")),
                  key=lambda record: int(record["RANK"]))


def test_node_assignment_from_node_leaders():
    assert mpi.assign_nodes([0, 0, 2, 2, 4]) == ([0, 0, 1, 1, 2], 3)
    assert mpi.assign_nodes([0]) == ([0], 1)


def test_missing_mpi4py_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `from mpi4py import MPI` fail
    with pytest.raises(RuntimeError, match=r"apt-get install libopenmpi-dev openmpi-bin && pip install mpi4py"):
        mpi.init_distributed()


def test_cli_splits_launcher_options_from_the_target():
    args = mpi.parse_args(["--timeout", "30", "-m", "nvfp4_dist.launch.train", "--tp", "2"])
    assert (args.timeout, args.module, args.target) == (30.0, "nvfp4_dist.launch.train", ["--tp", "2"])
    args = mpi.parse_args(["--no-init", "train.py", "--timeout", "5", "-m", "x"])
    assert (args.no_init, args.module, args.target) == (True, None, ["train.py", "--timeout", "5", "-m", "x"])
    for bad in ([], ["--backend", "gloo"], ["-m"]):
        with pytest.raises(SystemExit):
            mpi.parse_args(bad)


def test_single_process_without_mpirun():
    reason = mpi4py_missing_reason()
    if reason:
        pytest.skip(reason)
    code = "from nvfp4_dist.launch.mpi import derive_environment; print(derive_environment().as_env())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=mpi_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    env = eval(result.stdout.strip().splitlines()[-1])
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["NODE_RANK"]) == ("0", "1", "0", "0")
    assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536


def test_mpirun_three_ranks_script(tmp_path):
    command = mpirun_command(3)
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = subprocess.run([*command, sys.executable, "-m", "nvfp4_dist.launch.mpi", str(script), "--flag", "x"],
                            capture_output=True, text=True, env=mpi_env(tmp_path / "records"), timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    records = probes(tmp_path / "records")
    assert [r["RANK"] for r in records] == ["0", "1", "2"]
    assert {r["WORLD_SIZE"] for r in records} == {"3"}
    assert sorted(r["LOCAL_RANK"] for r in records) == ["0", "1", "2"]
    assert {(r["LOCAL_WORLD_SIZE"], r["NODE_RANK"]) for r in records} == {("3", "0")}
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}) == 1  # rank 0's choice, broadcast
    assert {r["backend"] for r in records} == {"gloo"}
    assert {r["sum"] for r in records} == {3.0}
    assert all(r["argv"] == ["--flag", "x"] for r in records)


def test_mpirun_two_ranks_module_without_init(tmp_path):
    command = mpirun_command(2)
    (tmp_path / "mpi_probe_module.py").write_text(PROBE)
    env = mpi_env(tmp_path / "records")
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    result = subprocess.run([*command, sys.executable, "-m", "nvfp4_dist.launch.mpi", "--no-init",
                             "-m", "mpi_probe_module", "--arg", "1"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    records = probes(tmp_path / "records")
    assert [r["RANK"] for r in records] == ["0", "1"] and {r["sum"] for r in records} == {1.0}
    assert all(r["argv"] == ["--arg", "1"] for r in records)


def test_mpirun_runs_nvfp4_train(tmp_path):
    command = mpirun_command(2)
    result = subprocess.run([*command, sys.executable, "-m", "nvfp4_dist.launch.train", "--device", "cpu",
                             "--steps", "3", "--micro-batch", "4", "--no-progress", "--out-dir", str(tmp_path)],
                            capture_output=True, text=True, env=mpi_env(), timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 processes on 1 node(s), cpu (TP=2, DP=1" in result.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_slurm_mpi_recipe_with_stand_in_srun(tmp_path):
    command = mpirun_command(2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    # Stand-in for `srun --mpi=pmix ...`: start the command as SLURM_NTASKS MPI ranks on this machine.
    srun.write_text("#!/usr/bin/env bash\nwhile [[ \"$1\" == --* ]]; do shift; done\n"
                    f"exec {' '.join(command[:1])} -np \"$SLURM_NTASKS\" {' '.join(command[3:])} \"$@\"\n")
    srun.chmod(0o755)
    env = mpi_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
               SLURM_JOB_ID="7", PYTHON=sys.executable, OUT_DIR=str(tmp_path / "out"))
    sbatch = pathlib.Path(mpi.__file__).parent / "slurm_mpi.sbatch"
    result = subprocess.run(["bash", str(sbatch), "--device", "cpu", "--steps", "2", "--micro-batch", "4",
                             "--no-progress"], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 processes on 1 node(s), cpu (TP=2" in result.stdout
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "2"
