"""One worker process of nvfp4-train: join the job, start the watchdog, train, and leave by one of a few exits.

Each exit says why (in one line, or with a traceback for an unexpected error) and has its own status
(faults.*_EXIT_CODE). A worker leaves its process group before it returns: a process that exits with a
live gloo group can die of SIGABRT while the interpreter tears down. Where the peers may be gone (a failed
collective, a crash, Ctrl-C) it tears nothing down and ends at once with os._exit.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

from nvfp4_dist.launch import faults, process_group, trainer
from nvfp4_dist.launch.plan import SettingError


def say(text: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def end_now(code: int) -> None:
    """Exit at once, skipping the interpreter's teardown (and with it the process group's)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(plan) -> int:
    """Train on this rank; returns the process exit code (or ends the process where the peers are gone)."""
    args = plan.args
    # The process group's timeout is longer than the watchdog's, so the watchdog names a failed rank first.
    timeout_s = 2 * args.watchdog_timeout + 60
    try:
        connection = process_group.init_process_group(device_kind=plan.device, world_size=plan.world_size,
                                                      timeout_s=timeout_s, watchdog_timeout_s=args.watchdog_timeout)
    except (RuntimeError, ValueError) as error:  # the rendezvous failed: no other rank could be reached
        say(f"nvfp4-train: error: could not join the job at MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')}: {faults.first_line(error)}")
        end_now(faults.COMMUNICATION_EXIT_CODE)
    rank = connection.rank
    watchdog = faults.Watchdog(connection.watchdog_store, rank, plan.world_size, args.watchdog_timeout,
                               interval_s=min(1.0, args.watchdog_timeout / 5),
                               store_host_rank=connection.store_host_rank,
                               secret=connection.secret,
                               announce=os.environ.get("LOCAL_RANK", str(rank)) == "0").start()
    try:
        trainer.train(plan, connection.device, rank, watchdog)
        code = 0
    except faults.NonFiniteError as error:
        if rank == 0:
            say(f"nvfp4-train: stopping: {error} (--on-nonfinite skip would skip such steps)")
        code = faults.NONFINITE_EXIT_CODE
    except SettingError as error:  # found the same on every rank
        if rank == 0:
            say(f"nvfp4-train: error: {error}")
        code = faults.SETTING_EXIT_CODE
    except KeyboardInterrupt:
        end_now(faults.INTERRUPTED_EXIT_CODE)
    except Exception as error:
        if faults.is_communication_error(error):  # a peer died or hung: let the watchdog name it first
            watchdog.hold(args.watchdog_timeout + 5)
            say(f"nvfp4-train (rank {rank}): stopping: a collective failed ({faults.first_line(error)})")
            end_now(faults.COMMUNICATION_EXIT_CODE)
        traceback.print_exc()
        end_now(faults.CRASH_EXIT_CODE)
    watchdog.stop()
    dist.destroy_process_group()
    return code
