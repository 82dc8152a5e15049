"""nvfp4-train end to end on CPU (2 gloo processes, TP=2): loss, logs, checkpoints, resume, flag validation."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from nvfp4_dist.launch import checkpoint, plan, progress, spawn, train, training_state, worker
from nvfp4_dist.launch.cli import build_parser
from nvfp4_dist.launch.optimizer import learning_rate

# A small, quick configuration (tokens per rank: 4 x 64 = 256).
QUICK = ["--micro-batch", "4", "--warmup-steps", "2", "--lr", "3e-3", "--no-progress", "--log-every", "1"]


def run_train(out_dir, *flags, timeout=240):
    command = [sys.executable, "-m", "nvfp4_dist.launch.train", *QUICK, "--out-dir", str(out_dir), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def metrics(out_dir):
    with open(out_dir / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


def test_short_run_trains_saves_and_resumes_exactly(tmp_path):
    full = run_train(tmp_path / "full", "--steps", "8", "--save-every", "4")
    assert full.returncode == 0, full.stderr[-3000:]
    records = metrics(tmp_path / "full")
    assert [r["step"] for r in records] == list(range(1, 9))
    losses = [r["loss"] for r in records]
    assert all(loss == loss and abs(loss) < 1e3 for loss in losses), losses
    assert losses[-1] < losses[0] - 0.3, losses  # byte-level start ~ln(256)=5.5 falls quickly
    assert "summary:" in full.stdout and "loss " in full.stdout
    assert full.stdout.splitlines()[0].endswith("; recipe: NVFP4Recipe defaults"), full.stdout
    log = (tmp_path / "full" / "train.log").read_text()
    assert "step 8/8" in log and "saved checkpoint" in log
    assert f"recipe {plan.make_recipe(build_parser().parse_args([]))!r}" in log  # the whole recipe
    assert checkpoint.latest_step(tmp_path / "full" / "checkpoints") == 8

    # The same job killed during step 5 and started again: steps 5..8 reproduce the losses exactly.
    killed = run_train(tmp_path / "split", "--steps", "8", "--save-every", "4", "--inject-fault", "kill:5:0",
                       "--watchdog-timeout", "10")
    assert killed.returncode != 0
    assert checkpoint.latest_step(tmp_path / "split" / "checkpoints") == 4
    resumed = run_train(tmp_path / "split", "--steps", "8", "--save-every", "4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the step-4 checkpoint" in resumed.stdout
    records = metrics(tmp_path / "split")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["loss"] for r in records] == losses


def test_resume_refuses_a_checkpoint_of_another_shape(tmp_path):
    first = run_train(tmp_path, "--steps", "1", "--save-every", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    other = run_train(tmp_path, "--steps", "2", "--hidden", "128", "--heads", "4")
    assert other.returncode != 0
    assert "--hidden: checkpoint 64, now 128" in other.stderr


@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "--tp=3 does not divide the number of processes (2)"),
    (["--nproc", "4", "--tp", "3"], "--tp=3 does not divide the number of processes (4)"),
    (["--hidden", "72", "--heads", "4"], "--hidden=72: must be a multiple of 16"),
    (["--hidden", "80", "--heads", "4"], "--hidden=80: each of the --tp=2 shards (40) must be a multiple of 16"),
    (["--ffn", "100"], "--ffn=100: must be a multiple of 16"),
    (["--seq-length", "60", "--micro-batch", "1"], "--seq-length=60 x --micro-batch=1"),
    (["--sp", "--seq-length", "48", "--micro-batch", "1"], "(--sp) = 24 tokens per rank"),
    (["--heads", "3", "--hidden", "96"], "--tp=2 must divide --heads=3"),
    (["--bf16-first-layers", "2", "--bf16-last-layers", "1"], "exceed --layers=2"),
    (["--gemm-backend", "cublaslt"], "--gemm-backend=cublaslt needs CUDA"),
    (["--tp", "1", "--sp"], "--sp needs --tp > 1"),
    (["--inject-fault", "explode:3"], "--inject-fault='explode:3'"),
    (["--steps", "0"], "--steps=0: must be >= 1"),
    (["--steps", "-5"], "--steps=-5: must be >= 1"),
    (["--seq-length", "0"], "--seq-length=0: must be >= 1"),
    (["--seq-length", "-64"], "--seq-length=-64: must be >= 1"),
    (["--hidden", "0"], "--hidden=0: must be >= 1"),
    (["--heads", "0"], "--heads=0: must be >= 1"),
    (["--ffn", "0"], "--ffn=0: must be >= 1"),
    (["--layers", "0"], "--layers=0: must be >= 1"),
    (["--micro-batch", "-1"], "--micro-batch=-1: must be >= 1"),
    (["--nproc", "0"], "--nproc=0: must be >= 1"),
    (["--tp", "0"], "--tp=0: must be >= 1"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints=0: must be >= 1"),
    (["--save-every", "-1"], "--save-every=-1: must be >= 0"),
    (["--warmup-steps", "-1"], "--warmup-steps=-1: must be >= 0"),
    (["--seed", "-1"], "--seed=-1: must be >= 0"),
    (["--lr", "0"], "--lr=0.0: must be > 0"),
    (["--lr", "-0.001"], "--lr=-0.001: must be > 0"),
    (["--lr", "nan"], "--lr=nan: must be a finite number"),
    (["--lr", "inf"], "--lr=inf: must be a finite number"),
    (["--min-lr", "0.1"], "--min-lr=0.1: must be >= 0 and <= --lr=0.003"),
    (["--grad-clip", "nan"], "--grad-clip=nan: must be a finite number"),
    (["--weight-decay", "-0.1"], "--weight-decay=-0.1: must be >= 0"),
    (["--watchdog-timeout", "0"], "--watchdog-timeout=0.0: must be > 0"),
    (["--watchdog-timeout", "inf"], "--watchdog-timeout=inf: must be a finite number"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--data", "/nonexistent/corpus.txt"], "--data=/nonexistent/corpus.txt: no such file"),
    (["--dp", "0"], "--dp=0: must be >= 1"),
    (["--nproc", "4", "--dp", "3"], "--dp=3 does not divide the number of processes (4)"),
    (["--nproc", "2", "--tp", "2", "--dp", "2"], "--tp=2 x --dp=2 = 4 processes, but the job has 2"),
    (["--fsdp"], "--fsdp needs data parallelism: the processes / --tp=2 give DP=1"),
    (["--fsdp", "--tp", "2", "--dp", "4"], "--fsdp with DP=4: the QKV weight (3 x --hidden=64 / --tp=2) has 96 rows"),
    (["--fsdp", "--tp", "1", "--dp", "2", "--ffn", "16"], "--fsdp with DP=2: the fc1 weight (--ffn=16 / --tp=1) has 16"),
])
def test_bad_flags_are_refused_before_any_process_starts(tmp_path, capsys, monkeypatch, flags, message):
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--device", "cpu", "--out-dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("nvfp4-train: error: "), err  # one line, no usage, no traceback
    assert not (tmp_path / "out").exists()


def test_the_first_line_shows_the_recipe_by_what_differs_from_its_defaults(tmp_path, monkeypatch):
    """A short line a reader takes in (train.log keeps the whole recipe): the recipe's defaults are not repeated."""
    for variable in [name for name in os.environ if name.startswith("NVFP4_")] + ["WORLD_SIZE"]:
        monkeypatch.delenv(variable, raising=False)
    for flags, recipe in (([], "NVFP4Recipe defaults"),
                          (["--no-rht", "--backward-mode", "dequantized", "--nvfp4-4over6", "weights"],
                           "NVFP4Recipe defaults except rht=False, nvfp4_4over6='weights', "
                           "backward_mode='dequantized'")):
        args = build_parser().parse_args(["--device", "cpu", "--out-dir", str(tmp_path), *flags])
        line = progress.describe_job(plan.make_plan(args), dp_size=1)
        assert line.startswith("gpt model: 2 layers, ") and line.endswith(f"); recipe: {recipe}"), line
        assert len(line) < 250, line


def test_a_corpus_shorter_than_a_sequence_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    corpus = tmp_path / "short.txt"
    corpus.write_bytes(b"x" * 40)
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", "--data", str(corpus), "--out-dir", str(tmp_path / "out")])
    assert f"--data={corpus}: 40 bytes, fewer than --seq-length + 2 = 66" in capsys.readouterr().err


@pytest.mark.parametrize("make_out_dir, message", [
    (lambda base: (base / "a_file").touch() or base / "a_file", "exists and is not a directory"),
    (lambda base: (base / "a_file").touch() or base / "a_file" / "out", "a_file is not a directory"),
    (lambda base: (base / "out" / "train.log").mkdir(parents=True) or base / "out", "train.log is not a writable file"),
    (lambda base: (base / "out").mkdir() or (base / "out" / "checkpoints").touch() or base / "out",
     "checkpoints is not a writable directory"),
])
def test_an_unusable_out_dir_is_refused(tmp_path, capsys, monkeypatch, make_out_dir, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    out_dir = make_out_dir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--device", "cpu", "--out-dir", str(out_dir)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--out-dir={out_dir}" in err and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("out_dir, message", [
    ("/proc/nvfp4-train-out", "--out-dir=/proc/nvfp4-train-out: cannot be created (No such file or directory)"),
    ("/proc", "--out-dir=/proc: cannot create a file in it"),
])
def test_an_out_dir_that_permissions_allow_but_writes_fail_is_refused_before_start(capsys, monkeypatch, out_dir,
                                                                                   message):
    """Root is allowed everything by os.access, yet /proc takes no new directory or file: the directory and a probe
    file are tried before any process starts, and the refusal is one line."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # what root is told, whoever runs the test
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--device", "cpu", "--out-dir", out_dir])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"nvfp4-train: error: {message}"), err
    assert err.count("\n") == 1, err


def access_by_mode_bits(path, mode, *args, **kwargs) -> bool:
    """os.access as the owner's mode bits decide it: what a user who is not root gets (root writes anywhere)."""
    wanted = (0o400 if mode & os.R_OK else 0) | (0o200 if mode & os.W_OK else 0) | (0o100 if mode & os.X_OK else 0)
    return os.stat(path).st_mode & wanted == wanted


@pytest.mark.parametrize("target", ["the_dir", "the_dir/new_out"])
def test_a_read_only_out_dir_is_refused(tmp_path, capsys, monkeypatch, target):
    """A directory its mode makes read-only: one line naming the flag, no process started."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    if os.geteuid() == 0:
        monkeypatch.setattr(os, "access", access_by_mode_bits)
    (tmp_path / "the_dir").mkdir()
    (tmp_path / "the_dir").chmod(0o555)  # read and enter, no writing
    try:
        with pytest.raises(SystemExit) as exit_info:
            train.main(["--device", "cpu", "--out-dir", str(tmp_path / target)])
    finally:
        (tmp_path / "the_dir").chmod(0o755)
    err = capsys.readouterr().err
    expected = ("the directory is not writable" if target == "the_dir"
                else f"cannot be created, {tmp_path / 'the_dir'} is not writable")
    assert exit_info.value.code == 2 and f"--out-dir={tmp_path / target}: {expected}" in err, err
    assert err.count("\n") == 1 and list((tmp_path / "the_dir").iterdir()) == []


def test_megatron_flags_are_checked(capsys, monkeypatch):
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    try:
        import megatron.core  # noqa: F401
        expected = "--sp with --model megatron needs CUDA"
    except ImportError:
        expected = "--model=megatron needs megatron-core: pip install nvfp4-dist[megatron]"
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", "--model", "megatron", "--sp"])
    assert expected in capsys.readouterr().err


def test_fsdp_needs_the_small_gpt(capsys, monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(spawn, "launch_local", lambda *a, **k: pytest.fail("processes started despite bad flags"))
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", "--model", "megatron", "--dtype", "fp32", "--tp", "1", "--dp", "2", "--fsdp"])
    assert "--fsdp needs --model gpt (--model megatron: " in capsys.readouterr().err


def test_dp_alone_starts_tp_times_dp_processes(monkeypatch, tmp_path):
    """--dp without --nproc: --tp x --dp processes (TP 2 on CPU by default); with --nproc, --tp follows."""
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)

    def sizes(*flags):
        job = plan.make_plan(build_parser().parse_args(["--device", "cpu", "--out-dir", str(tmp_path), *flags]))
        return job.world_size, job.tp, job.dp

    assert sizes("--dp", "2") == (4, 2, 2)
    assert sizes("--dp", "2", "--tp", "1") == (2, 1, 2)
    assert sizes("--nproc", "4", "--dp", "4") == (4, 1, 4)
    assert sizes("--nproc", "4") == (4, 2, 2)


def test_fused_producers_flag_needs_the_megatron_model(capsys, monkeypatch):
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(worker, "run_worker", lambda plan: pytest.fail("worker started despite bad flags"))
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", "--model", "gpt", "--fused-producers"])
    assert "--fused-producers needs --model megatron" in capsys.readouterr().err


def test_megatron_model_in_bf16_on_cpu_is_refused(capsys, monkeypatch):
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (pip install nvfp4-dist[megatron])")
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(worker, "run_worker", lambda plan: pytest.fail("worker started despite bad flags"))
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", "--model", "megatron", "--dtype", "bf16"])
    assert "--dtype bf16 with --model megatron needs CUDA" in capsys.readouterr().err


def test_world_size_from_a_launcher_is_checked(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setattr(worker, "run_worker", lambda plan: pytest.fail("worker started despite bad flags"))
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", "--tp", "4"])
    assert "--tp=4 does not divide the number of processes (6)" in capsys.readouterr().err


def test_a_malformed_world_size_from_a_launcher_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setattr(worker, "run_worker", lambda plan: pytest.fail("worker started despite bad flags"))
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu"])
    assert "WORLD_SIZE='two': must be a positive integer" in capsys.readouterr().err


def test_learning_rate_schedule_warms_up_then_decays_to_min_lr():
    schedule = dict(peak=1e-3, minimum=1e-4, warmup_steps=10, total_steps=100)
    assert learning_rate(5, **schedule) == pytest.approx(5e-4)
    assert learning_rate(10, **schedule) == pytest.approx(1e-3)
    assert learning_rate(100, **schedule) == pytest.approx(1e-4)
    assert 1e-4 < learning_rate(55, **schedule) < 1e-3


def test_megatron_model_path_trains_on_cpu(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
    result = run_train(tmp_path, "--model", "megatron", "--steps", "6", "--warmup-steps", "1", "--save-every", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "megatron model: 2 layers" in result.stdout
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert checkpoint.latest_step(tmp_path / "checkpoints") == 6


def test_megatron_model_trains_with_fused_producers_and_resumes_only_with_them(tmp_path):
    """--model megatron builds the spec with the norms and the activation inside the linears by default (their
    parameters there, the recipe's fused_producers on) and trains (on CPU in FP32, so each takes the unfused chain:
    the fused passes quantize BF16 outputs); its checkpoint does not resume a run with --no-fused-producers, whose
    parameters have other names, and the refusal names the flag that resumes it."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
    common = ("--model", "megatron", "--warmup-steps", "1", "--save-every", "2")
    result = run_train(tmp_path, *common, "--steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "norms and activation fused into the NVFP4 casts" in result.stdout
    assert "fused_producers=True" in (tmp_path / "train.log").read_text()
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    refused = run_train(tmp_path, *common, "--no-fused-producers", "--steps", "6")
    assert refused.returncode == 2
    assert ("--fused-producers: checkpoint True, now False (resume with --fused-producers)"
            in refused.stdout + refused.stderr)
    resumed = run_train(tmp_path, *common, "--fused-producers", "--steps", "6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the step-4 checkpoint" in resumed.stdout


def test_the_job_line_says_where_the_norms_are_and_whether_their_casts_are_fused(monkeypatch):
    """--model megatron puts the norms and the activation inside the linears unless --no-fused-producers;
    NVFP4_DISABLE_FUSED_PRODUCERS=1 keeps them there with the unfused casts; --model gpt has neither."""
    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    def job(*flags):
        return plan.make_plan(build_parser().parse_args(["--device", "cpu", *flags]))

    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install nvfp4-dist[megatron])")
    assert progress.producers_note(job("--model", "megatron")) == ", norms and activation fused into the NVFP4 casts"
    assert progress.producers_note(job("--model", "megatron", "--no-fused-producers")) == ""
    assert progress.producers_note(job("--model", "gpt")) == ""
    monkeypatch.setenv("NVFP4_DISABLE_FUSED_PRODUCERS", "1")
    unfused = job("--model", "megatron")
    assert unfused.fused_producers and not unfused.recipe.fused_producers
    assert "inside the linears, unfused casts" in progress.producers_note(unfused)
    assert job("--model", "megatron", "--fused-producers").recipe.fused_producers  # the flag wins


def test_checkpoint_from_before_fused_producers_were_default_names_the_flag_that_resumes_it():
    """A checkpoint that does not record --fused-producers had it off: resuming it takes --no-fused-producers."""
    assert training_state.UNRECORDED_FLAG_VALUES["fused_producers"] is False
    assert (training_state.mismatch_detail("fused_producers", False, True)
            == "--fused-producers: checkpoint False, now True (resume with --no-fused-producers)")
    assert training_state.mismatch_detail("tp", 2, 4) == "--tp: checkpoint 2, now 4"


def test_sequence_parallel_matches_tensor_parallel_and_tp1(tmp_path):
    """The model's TP/SP plumbing: SP matches plain TP (amaxes reduced across ranks, norm gradients summed):
    the first forward bit for bit, later steps up to the order of the norm-gradient sums (per-shard sums
    added across ranks vs one sum over all tokens; the optimizer mostly absorbs it, a 1e-5 trace remains
    for some SR streams); and TP=2 stays within NVFP4 noise of TP=1 (weights use per-shard amaxes)."""
    common = ("--steps", "3", "--warmup-steps", "0", "--lr", "1e-2", "--save-every", "0")
    runs = {}
    for name, flags in (("tp1", ("--nproc", "1", "--tp", "1")), ("tp2", ("--tp", "2")),
                        ("tp2_sp", ("--tp", "2", "--sp"))):
        result = run_train(tmp_path / name, *common, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [r["loss"] for r in metrics(tmp_path / name)]
    assert runs["tp2_sp"][0] == runs["tp2"][0]
    assert runs["tp2_sp"] == pytest.approx(runs["tp2"], rel=0, abs=1e-4)
    assert runs["tp2"] == pytest.approx(runs["tp1"], abs=0.03)
    assert runs["tp2"][-1] < runs["tp2"][0] - 0.3


def test_more_processes_than_gpus_on_a_machine_are_refused_before_nccl(monkeypatch):
    """NCCL takes one GPU per process: a CUDA job with more processes on this machine than GPUs is refused
    with the way out, whether nvfp4-train starts them (--nproc, --tp x --dp) or a launcher did (torchrun's
    LOCAL_WORLD_SIZE, Open MPI's local size); as many processes as GPUs pass."""
    import torch

    for variable in ("WORLD_SIZE", *plan.MPI_SIZE_VARIABLES, *plan.LOCAL_SIZE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def job(*flags):
        return plan.make_plan(build_parser().parse_args(["--device", "cuda", "--model", "gpt", *flags]))

    refusal = r"4 processes on this machine and 2 GPU\(s\): NCCL takes one GPU per process; .*--backend gloo"
    with pytest.raises(ValueError, match=refusal):
        job("--nproc", "4")
    with pytest.raises(ValueError, match=refusal):
        job("--tp", "2", "--dp", "2")
    assert job("--nproc", "2").world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "8")      # torchrun: 4 processes per node on two nodes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=refusal):
        job("--tp", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert job("--tp", "2").world_size == 8
    for variable in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")  # mpirun -np 4 nvfp4-train
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    with pytest.raises(ValueError, match=refusal):
        job("--tp", "2")
