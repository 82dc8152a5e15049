"""nvfp4-train's own launcher: start the worker processes on this machine when no launcher did.

Every worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) with the rendezvous on loopback, so the job opens no port beyond this machine. When one
worker fails the others get `grace_s` to report, then they are killed.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from nvfp4_dist.launch.faults import INTERRUPTED_EXIT_CODE, REPORTED_EXIT_CODES, describe_exit

LOOPBACK = "127.0.0.1"
POLL_S = 0.1
# Quiet C++ logging in the workers: torch's c10d warnings carry C++ stack traces (a rank that died
# shows up as tens of lines from each survivor); errors stay visible. Set them to override.
QUIET_CPP = {"TORCH_CPP_LOG_LEVEL": "ERROR", "TORCH_SHOW_CPP_STACKTRACES": "0"}


def free_port() -> int:
    """A TCP port free on loopback now (the worker of rank 0 binds it for the job's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def worker_environment(rank: int, nproc: int, port: int) -> dict:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    for variable, value in QUIET_CPP.items():
        env.setdefault(variable, value)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # A fixed thread count (MKL may otherwise use fewer threads on a loaded machine, changing how its
    # CPU reductions are split): a resumed run reproduces the same losses.
    env.setdefault("MKL_DYNAMIC", "FALSE")
    env.setdefault("OMP_DYNAMIC", "FALSE")
    return env


def stop_all(workers: list) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
    for worker in workers:
        worker.wait()


def launch_local(argv: list, nproc: int, grace_s: float) -> int:
    """Start `nproc` workers of `nvfp4-train argv` on this machine; returns the job's exit code.

    When a worker fails, the others get grace_s seconds to finish their reports, then are killed. A failure
    the workers reported themselves (a refused setting, the watchdog's verdict, a NaN/Inf stop) passes its
    exit code on silently; any other (a signal, a crash) is named here in one line.
    """
    port = free_port()
    workers = [subprocess.Popen([sys.executable, "-m", "nvfp4_dist.launch.train", *argv],
                                env=worker_environment(rank, nproc, port)) for rank in range(nproc)]
    failed = None
    try:
        while None in [worker.poll() for worker in workers]:  # poll every worker (no short cut)
            if failed is None:
                failed = next(((rank, w.returncode) for rank, w in enumerate(workers)
                               if w.returncode not in (None, 0)), None)
                if failed is not None:
                    deadline = time.monotonic() + grace_s
            if failed is not None and time.monotonic() > deadline:
                stop_all(workers)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        stop_all(workers)
        print("nvfp4-train: interrupted; the job is stopped", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    if failed is None:
        failed = next(((rank, w.returncode) for rank, w in enumerate(workers) if w.returncode != 0), None)
    if failed is None:
        return 0
    rank, code = failed
    if code not in REPORTED_EXIT_CODES:
        print(f"nvfp4-train: rank {rank} exited first ({describe_exit(code)}); the job is stopped",
              file=sys.stderr, flush=True)
    return code if code > 0 else 1
