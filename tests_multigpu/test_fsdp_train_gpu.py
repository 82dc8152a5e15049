"""nvfp4-train --fsdp on GPUs: the small GPT sharded over DP=2 by FSDP2, the NVFP4 linears' weights all-gathered
in NVFP4, against the same job's replicated data parallelism; a checkpoint of the shards resumes exactly.

    python3 -m pytest -q tests_multigpu/test_fsdp_train_gpu.py

With two GPUs or more the job starts its own two processes (NCCL, a GPU each). On one GPU both processes share
it: mpirun starts them through `python -m nvfp4_dist.launch.mpi --backend gloo`, which joins them in a gloo
group (NCCL takes one GPU per process); everything but the transport is the GPU's.

In FP32 the losses equal the replicated job's bit for bit (tests/test_fsdp_train.py says why); in BF16 the
gradient reduction rounds in another order (FSDP2 reduce-scatters shards, the replicated job all-reduces whole
tensors), so the losses agree to BF16 rounding.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.test_train_job import metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

JOB = ["--device", "cuda", "--model", "gpt", "--dp", "2", "--tp", "1", "--micro-batch", "4", "--warmup-steps", "2",
       "--lr", "3e-3", "--no-progress", "--log-every", "1", "--grad-clip", "0"]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def command(*flags) -> list:
    """nvfp4-train with JOB and flags, on two GPUs (its own launcher) or sharing one (mpirun, gloo)."""
    train = ["-m", "nvfp4_dist.launch.train", *JOB, *flags]
    if torch.cuda.device_count() >= 2:
        return [sys.executable, *train]
    if shutil.which("mpirun") is None:
        pytest.fail("one GPU: the two processes start under mpirun, which is not installed")
    return ["mpirun", "-np", "2", "--bind-to", "none", "--allow-run-as-root", "-x", "PYTHONPATH", "-x", "PATH",
            sys.executable, "-m", "nvfp4_dist.launch.mpi", "--backend", "gloo", *train]


def run(out_dir, *flags) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    result = subprocess.run(command("--out-dir", str(out_dir), *flags), capture_output=True, text=True,
                            timeout=400, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return result


def losses(out_dir) -> list:
    return [record["loss"] for record in metrics(out_dir)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fsdp_trains_as_replicated_data_parallelism(tmp_path, dtype):
    runs = {}
    for name, flags in (("replicated", ()), ("fsdp", ("--fsdp",))):
        run(tmp_path / name, "--dtype", dtype, "--steps", "8", "--save-every", "0", *flags)
        runs[name] = losses(tmp_path / name)
    assert "(TP=1, DP=2 FSDP2, " in (tmp_path / "fsdp" / "train.log").read_text()
    got, expected = runs["fsdp"], runs["replicated"]
    print(f"\n{dtype} losses, FSDP2 with NVFP4 gathers: {got}\n{dtype} losses, replicated: {expected}")
    assert all(map(torch.isfinite, torch.tensor(got))), got
    assert got[-1] < got[0] - 0.3, got
    if dtype == "fp32":
        assert got == expected
    else:
        assert got[0] == expected[0]  # no update yet
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got, expected)), (got, expected)


def test_fsdp_checkpoint_resumes_exactly(tmp_path):
    flags = ("--fsdp", "--dtype", "bf16")
    run(tmp_path / "whole", *flags, "--steps", "4", "--save-every", "0")
    run(tmp_path / "split", *flags, "--steps", "2", "--save-every", "2")
    resumed = run(tmp_path / "split", *flags, "--steps", "4", "--save-every", "2")
    assert "resumed from the step-2 checkpoint" in resumed.stdout, resumed.stdout[-2000:]
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
