"""Where a benchmark ran from: the commit and the command line to record in its JSON, and where it writes it."""
import os
import pathlib
import shlex
import subprocess
import sys

REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Environment variables that change what a benchmark measures (transports, GEMM path, NCCL, stream queues):
# recorded in front of its command line. NVFP4_COMMIT only names the commit, NVFP4_BUILD_DIR where the extension builds.
SETTING_PREFIXES = ("NVFP4_", "NCCL_", "TORCH_SYMM_MEM_", "CUDA_DEVICE_MAX_CONNECTIONS")
NOT_SETTINGS = ("NVFP4_COMMIT", "NVFP4_BUILD_DIR")


def git_commit() -> str:
    """NVFP4_COMMIT if set (the lent GPU machines get a copy without .git), else git HEAD, else "unknown"."""
    if os.environ.get("NVFP4_COMMIT"):
        return os.environ["NVFP4_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    """The command that started this process, as typed from the repository root: the settings among the
    environment variables, then `torchrun --nproc-per-node N` when torchrun started it (else `python`), then the
    script (relative to the repository) and its arguments."""
    settings = [f"{name}={value}" for name, value in sorted(os.environ.items())
                if name.startswith(SETTING_PREFIXES) and name not in NOT_SETTINGS]
    script = pathlib.Path(sys.argv[0]).resolve()
    if script.is_relative_to(REPOSITORY_ROOT):
        script = script.relative_to(REPOSITORY_ROOT)
    launcher = ["python"]
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_WORLD_SIZE"):
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ.get("WORLD_SIZE", per_node)) // per_node
        launcher = ["torchrun", *(["--nnodes", str(nodes)] if nodes > 1 else []), "--nproc-per-node", str(per_node)]
    return shlex.join([*settings, *launcher, str(script), *sys.argv[1:]])


def default_results_path(benchmark: str) -> pathlib.Path:
    """benchmarks/results/<benchmark>_<gpu>.json for the current CUDA device (torchrun_setup.gpu_label: h100, h200):
    the latest result per GPU kind replaces the previous one."""
    from torchrun_setup import gpu_label  # a sibling: benchmarks/ is on sys.path when a benchmark runs
    return REPOSITORY_ROOT / "benchmarks" / "results" / f"{benchmark}_{gpu_label()}.json"
