"""Fault handling for the training job: a watchdog that stops the whole job when a rank dies or
hangs, naming the rank; tracing of the layer that met a non-finite value; injected faults for tests.

Watchdog protocol (a TCPStore side channel hosted by rank 0, separate from the process group):
every `interval_s` each rank's watchdog thread publishes a liveness counter, its last completed
step and what its threads are doing (inside a collective or not), and reads everyone else's.
- A rank whose liveness counter stops changing for `timeout_s` has died (or is frozen).
- When a rank's step stops changing for `timeout_s` the job is stalled; the ranks then not
  waiting inside a collective are the hung ones (the others wait for them). Stall detection
  starts once a rank completed its first step, so start-up work (kernel builds) is exempt.
- Rank 0 closing its store connections (repeated failures of store calls) means it is gone.
On a verdict the lowest live rank prints it and publishes it in the store; every live rank
exits with WATCHDOG_EXIT_CODE, which makes torchrun, mpirun, srun or nvfp4-train's own
launcher stop the job.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

WATCHDOG_EXIT_CODE = 3
FINISHED = "finished"
VERDICT_KEY = "verdict"
STORE_FAILURES_TO_GIVE_UP = 3  # consecutive failed store calls: the host closed its sockets
FAULT_KINDS = ("kill", "hang", "nan", "crash-in-save")
# Frames from these paths mean a thread waits in communication.
_COLLECTIVE_PATHS = (os.sep + os.path.join("torch", "distributed") + os.sep,
                     os.path.join("parallel", "collectives.py"), os.path.join("parallel", "overlap.py"))


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or amax, with the step and the layer where it was met."""

    def __init__(self, step: int, where: str, detail: str):
        super().__init__(f"non-finite value at step {step} in {where}: {detail}")
        self.step, self.where, self.detail = step, where, detail


def is_nonfinite_amax_error(error: BaseException) -> bool:
    """True for the error that nvfp4_dist.ops raises for a NaN/Inf amax (recipe.check_finite)."""
    from ..ops import NonFiniteAmaxError

    return isinstance(error, NonFiniteAmaxError)


def is_communication_error(error: BaseException) -> bool:
    """True for errors of torch.distributed or its backends (a peer that died, a timed-out collective)."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return any(marker in text for marker in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out"))


class LayerTracer:
    """Remembers which NVFP4 layer ran last, forward or backward, to name it in error reports."""

    def __init__(self, model, is_traced=None):
        self.current = "outside the NVFP4 layers"
        is_traced = is_traced or (lambda module: type(module).__module__.startswith("nvfp4_dist"))
        self.handles = []
        for name, module in model.named_modules():
            if name and is_traced(module):
                self.handles.append(module.register_forward_pre_hook(self._enter_forward(name)))
                self.handles.append(module.register_forward_hook(self._leave_forward(name)))

    def _enter_forward(self, name):
        def hook(module, inputs):
            self.current = f"layer {name} (forward)"
        return hook

    def _leave_forward(self, name):
        def mark_backward(grad):
            self.current = f"layer {name} (backward)"
            return grad

        def hook(module, inputs, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for tensor in outputs:
                if getattr(tensor, "requires_grad", False):
                    tensor.register_hook(mark_backward)
        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


@dataclasses.dataclass(frozen=True)
class FaultInjection:
    """A fault to inject for testing: `kind` at `step` on `rank` (flag form KIND:STEP[:RANK])."""

    kind: str
    step: int
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> "FaultInjection":
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in FAULT_KINDS or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"--inject-fault={text!r}: expected KIND:STEP[:RANK] with KIND one of {FAULT_KINDS}")
        return cls(parts[0], *map(int, parts[1:]))

    def applies(self, kind: str, step: int, rank: int) -> bool:
        return self.kind == kind and self.step == step and self.rank == rank

    def at_step_start(self, step: int, rank: int) -> None:
        """Die or hang here when asked to (the 'nan' and 'crash-in-save' kinds act elsewhere)."""
        if self.applies("kill", step, rank):
            print(f"[rank {rank}] injected fault: killing this process at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.applies("hang", step, rank):
            print(f"[rank {rank}] injected fault: hanging at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def crash_before_rename(self, step: int, rank: int):
        """A checkpoint hook that truncates the temporary file and exits, as a crash mid-save would."""
        if not self.applies("crash-in-save", step, rank):
            return None

        def crash(temporary_path):
            with open(temporary_path, "r+b") as handle:
                handle.truncate(max(1, os.path.getsize(temporary_path) // 2))
            print(f"[rank {rank}] injected fault: crashing while saving the step-{step} checkpoint",
                  file=sys.stderr, flush=True)
            os._exit(1)
        return crash


def describe_exit(code: int) -> str:
    """'exit code 1', 'killed by SIGKILL' or the watchdog's exit, for a child's return code."""
    if code == WATCHDOG_EXIT_CODE:
        return f"exit code {code}: its watchdog stopped it, see the report above"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def thread_activity(exclude_ident: int) -> tuple:
    """(in_collective, where): whether any thread waits in communication, and the main thread's frame."""
    frames = sys._current_frames()
    in_collective = False
    for ident, frame in frames.items():
        if ident == exclude_ident:
            continue
        while frame is not None and not in_collective:
            in_collective = any(path in frame.f_code.co_filename for path in _COLLECTIVE_PATHS)
            frame = frame.f_back
    main = frames.get(threading.main_thread().ident)
    where = (f"{os.path.basename(main.f_code.co_filename)}:{main.f_lineno} in {main.f_code.co_name}"
             if main is not None else "unknown")
    return in_collective, where


@dataclasses.dataclass
class RankState:
    """What the watchdog last heard from one rank, and when (local monotonic time) it changed."""

    alive: str = ""
    alive_since: float = 0.0
    step: int = -1
    step_since: float = 0.0
    in_collective: bool = False
    where: str = ""


class Watchdog:
    """Heartbeats over `store`; stops the job with a message naming the rank that died or hung."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, interval_s: float = 1.0,
                 exit_fn=os._exit):
        if timeout_s <= 0 or interval_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}, interval_s={interval_s}: both must be > 0")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.exit_fn = exit_fn
        self.step = 0
        self.verdict = None
        self._stopping = threading.Event()
        self._verdict_ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvfp4-watchdog", daemon=True)
        self._store_failing_since = None

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Record that this rank completed `step` (called by the training loop)."""
        self.step = step

    def stop(self) -> None:
        """Stop beating and tell the other ranks that this one finished (so its silence is not a death)."""
        self._stopping.set()
        self._thread.join()
        try:
            self.store.set(f"alive/{self.rank}", FINISHED)
        except Exception:  # the store's host finished first: nobody is left to tell
            pass

    def hold(self, wait_s: float) -> None:
        """After an error in the main thread: give the watchdog `wait_s` to name a failed rank (it then exits)."""
        self._verdict_ready.wait(wait_s)
        if self.verdict is not None:
            time.sleep(wait_s)  # the watchdog thread reports and exits the process

    def _run(self) -> None:
        ranks = {rank: RankState() for rank in range(self.world_size)}
        counter = 0
        failures = 0
        while not self._stopping.wait(self.interval_s):
            counter += 1
            now = time.monotonic()
            try:
                self._publish(counter)
                if self.store.check([VERDICT_KEY]):
                    self._follow(self.store.get(VERDICT_KEY).decode())
                    return
                self._read(ranks, now)
                failures = 0
                verdict, silent = self._judge(ranks, now)
            except Exception as error:  # the store's host (rank 0) closed its connections: it is gone
                failures += 1
                if failures < STORE_FAILURES_TO_GIVE_UP:
                    continue
                verdict, silent = (f"rank 0 is unreachable (it hosts the watchdog store; it died or its node "
                                   f"is down): {type(error).__name__}: {str(error).splitlines()[0]}"), {0}
            if verdict is not None:
                self._stop_job(verdict, silent)
                return

    def _publish(self, counter: int) -> None:
        in_collective, where = thread_activity(threading.get_ident())
        self.store.set(f"alive/{self.rank}", str(counter))
        self.store.set(f"state/{self.rank}", f"{self.step}|{int(in_collective)}|{where}")

    def _read(self, ranks: dict, now: float) -> None:
        keys = [f"alive/{r}" for r in ranks] + [f"state/{r}" for r in ranks]
        present = [key for key in keys if self.store.check([key])]
        values = dict(zip(present, self.store.multi_get(present))) if present else {}
        for rank, state in ranks.items():
            alive = values.get(f"alive/{rank}", b"").decode()
            if alive != state.alive or state.alive_since == 0.0:
                state.alive, state.alive_since = alive, now
            if f"state/{rank}" in values:
                step, in_collective, where = values[f"state/{rank}"].decode().split("|", 2)
                if int(step) != state.step:
                    state.step, state.step_since = int(step), now
                state.in_collective, state.where = in_collective == "1", where

    def _judge(self, ranks: dict, now: float) -> tuple:
        """(message, ranks that cannot report) once a rank died or hung, else (None, set())."""
        finished = {r for r, s in ranks.items() if s.alive == FINISHED}
        ranks = {r: s for r, s in ranks.items() if r not in finished}
        dead = {r for r, s in ranks.items() if r != self.rank and now - s.alive_since > self.timeout_s}
        if dead:
            details = "; ".join(f"rank {r} (last completed step {ranks[r].step}, silent for "
                                f"{now - ranks[r].alive_since:.0f} s)" for r in sorted(dead))
            return f"no heartbeat from {details}: the process died or is frozen", dead | finished
        stalled = {r for r, s in ranks.items() if s.step >= 1 and now - s.step_since > self.timeout_s}
        if not stalled:
            return None, set()
        # Ranks wait in collectives for the ones that are not in one: those hang.
        hung = sorted(r for r, s in ranks.items() if not s.in_collective)
        if hung:
            details = "; ".join(f"rank {r} at step {ranks[r].step + 1} (not in a collective; at {ranks[r].where})"
                                for r in hung)
            return f"no progress for more than {self.timeout_s:g} s: hung {details}", finished
        details = ", ".join(f"rank {r} after step {ranks[r].step}" for r in sorted(stalled))
        return (f"no progress for more than {self.timeout_s:g} s while every rank waits in a collective "
                f"({details}): mismatched collectives or a network hang"), finished

    def _stop_job(self, verdict: str, silent: set) -> None:
        """Report (lowest rank still able to), tell the others through the store, exit."""
        self.verdict = verdict
        self._verdict_ready.set()
        reporter = min(set(range(self.world_size)) - silent)
        if self.rank == reporter:
            print(f"nvfp4-train watchdog (rank {self.rank}): stopping the job: {verdict}", file=sys.stderr, flush=True)
            try:
                self.store.set(VERDICT_KEY, f"{self.rank}|{verdict}")
            except Exception:  # the store is gone with rank 0: the others find out by themselves
                pass
            time.sleep(2 * self.interval_s)  # the other ranks read the verdict and stop first
        else:
            time.sleep(3 * self.interval_s)  # the reporting rank prints first
        self.exit_fn(WATCHDOG_EXIT_CODE)

    def _follow(self, published: str) -> None:
        """Another rank's watchdog stopped the job: exit too."""
        reporter, verdict = published.split("|", 1)
        self.verdict = verdict
        self._verdict_ready.set()
        print(f"nvfp4-train watchdog (rank {self.rank}): stopping, as rank {reporter} reported", file=sys.stderr,
              flush=True)
        self.exit_fn(WATCHDOG_EXIT_CODE)


def start_watchdog(timeout_s: float, interval_s: float = 1.0, group=None) -> Watchdog:
    """Create the side-channel TCPStore (rank 0 hosts it) and start this rank's watchdog (collective)."""
    import datetime

    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = None
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    endpoint = [store.port if store is not None else None]
    dist.broadcast_object_list(endpoint, src=0, group=group)
    if rank != 0:
        store = dist.TCPStore(host, endpoint[0], world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    return Watchdog(store, rank, world_size, timeout_s, interval_s).start()
