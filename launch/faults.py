"""Fault handling for the training job: a watchdog that stops the whole job when a rank dies or
hangs, naming the rank; tracing of the layer that met a non-finite value; injected faults for tests.

Watchdog protocol (over the job's key-value store, beside the process group's own keys): each rank
publishes its last completed step whenever it completes one, and every `interval_s` a liveness counter
and what its threads are doing (waiting inside a collective or not); its watchdog thread reads
everyone else's.
- A rank whose liveness counter stops changing for `timeout_s` has died (or is frozen). A rank that dies
  just after completing a step stalls its step and its counter together: while a stalled rank's counter
  has been quiet for more than SILENT_INTERVALS intervals, no hang is declared (its death soon will be).
- When a rank's step stops changing for `timeout_s` the job is stalled; the ranks then not waiting
  inside a collective are the hung ones, while others wait in one for them. A rank is starting up, not
  hung, until it reports its first step (the step it resumes from, once its model and checkpoint are
  loaded) and while it is inside `load_extension` (building the CUDA kernels on first use); ranks that are
  all busy outside collectives before the first step of training are starting up too. A rank that hangs
  while starting up meets the process group's timeout instead.
- The store's host closing its connections (repeated failures of store calls) means it is gone.
On a verdict the lowest live rank prints it in one line and publishes it in the store, signed with the
job's secret (random bytes of rank 0, broadcast over the process group, never put in the store); every
live rank exits with WATCHDOG_EXIT_CODE, which makes torchrun, mpirun, srun or nvfp4-train's own launcher
stop the job. The first process of each node that follows a verdict says whose it was; a verdict without the
job's signature (written to the store by anything else that reaches its port) is ignored and said so. Store
values are plain text of a fixed format: nothing a peer sends is unpickled.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed

from nvfp4_dist import NonFiniteAmaxError
from nvfp4_dist._extension import load_extension
from nvfp4_dist.parallel import collectives, overlap, symmetric

CRASH_EXIT_CODE = 1  # an unexpected error (its traceback says where)
SETTING_EXIT_CODE = 2  # a flag or checkpoint that does not fit (as argparse's usage errors)
WATCHDOG_EXIT_CODE = 3
NONFINITE_EXIT_CODE = 4
COMMUNICATION_EXIT_CODE = 5
INTERRUPTED_EXIT_CODE = 130  # Ctrl-C (128 + SIGINT, as shells report it)
# Exits whose reason the workers printed themselves.
REPORTED_EXIT_CODES = (SETTING_EXIT_CODE, WATCHDOG_EXIT_CODE, NONFINITE_EXIT_CODE, COMMUNICATION_EXIT_CODE)
FINISHED = "finished"
VERDICT_KEY = "verdict"
STORE_FAILURES_TO_GIVE_UP = 3  # consecutive failed store calls: the host closed its sockets
SILENT_INTERVALS = 3  # a rank whose liveness counter missed this many intervals is dying, not hung
FAULT_KINDS = ("kill", "hang", "nan", "crash-in-save")
# A thread with a frame of these modules (or their submodules) waits for its peers.
COLLECTIVE_MODULES = (torch.distributed, collectives, overlap, symmetric)
# A thread inside these functions is starting up (it may take minutes), not hung.
START_UP_FUNCTIONS = (load_extension,)
_COLLECTIVE_MODULE_NAMES = tuple(module.__name__ for module in COLLECTIVE_MODULES)
_START_UP_CODES = frozenset(function.__code__ for function in START_UP_FUNCTIONS)


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or amax, with the step and the layer where it was met."""

    def __init__(self, step: int, where: str, detail: str):
        super().__init__(f"non-finite value at step {step} in {where}: {detail}")
        self.step, self.where, self.detail = step, where, detail


def is_nonfinite_amax_error(error: BaseException) -> bool:
    """True for the error that nvfp4_dist raises for a NaN/Inf amax (recipe.check_finite)."""
    return isinstance(error, NonFiniteAmaxError)


def is_communication_error(error: BaseException) -> bool:
    """True for errors of torch.distributed or its backends (a peer that died, a timed-out collective)."""
    if isinstance(error, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(error)
    return any(marker in text for marker in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out"))


def first_line(error: BaseException) -> str:
    """`Type: the first line of the message`, for one-line reports of errors that carry C++ detail."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


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

    def poison(self, model, step: int, is_traced):
        """For the 'nan' fault at `step` (every rank): a forward pre-hook filling the first traced layer's input
        with NaN; returns its handle (remove it after the step), or None."""
        if self.kind != "nan" or self.step != step:
            return None
        first = next(module for name, module in model.named_modules() if name and is_traced(module))

        def hook(module, inputs):
            return (torch.full_like(inputs[0], float("nan")), *inputs[1:])
        return first.register_forward_pre_hook(hook)

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


def sign_verdict(secret: bytes, rank: int, verdict: str) -> str:
    """The store value of `rank`'s verdict: `rank|signature|verdict`, the signature an HMAC-SHA256 of the rest."""
    signature = hmac.new(secret, f"{rank}|{verdict}".encode(), hashlib.sha256).hexdigest()
    return f"{rank}|{signature}|{verdict}"


def open_verdict(secret: bytes, published: str) -> tuple | None:
    """(rank, verdict) of a value that sign_verdict made with `secret`, else None."""
    rank, _, rest = published.partition("|")
    signature, _, verdict = rest.partition("|")
    if not rank.isdigit():
        return None
    expected = hmac.new(secret, f"{rank}|{verdict}".encode(), hashlib.sha256).hexdigest()
    return (int(rank), verdict) if hmac.compare_digest(signature, expected) else None


def _in_collective_module(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return any(name == watched or name.startswith(watched + ".") for watched in _COLLECTIVE_MODULE_NAMES)


@dataclasses.dataclass(frozen=True)
class Activity:
    """What a rank's threads are doing: waiting in a collective, starting up, and where the main thread is."""

    in_collective: bool
    starting_up: bool
    where: str

    def encode(self) -> str:
        return f"{int(self.in_collective)}|{int(self.starting_up)}|{self.where}"

    @classmethod
    def decode(cls, text: str) -> "Activity":
        in_collective, starting_up, where = text.split("|", 2)
        return cls(in_collective == "1", starting_up == "1", where)


def thread_activity(exclude_ident: int) -> Activity:
    """This process's activity, from the Python stacks of its threads other than `exclude_ident`."""
    frames = sys._current_frames()
    in_collective = starting_up = False
    for ident, frame in frames.items():
        if ident == exclude_ident:
            continue
        while frame is not None:
            in_collective = in_collective or _in_collective_module(frame)
            starting_up = starting_up or frame.f_code in _START_UP_CODES
            frame = frame.f_back
    main = frames.get(threading.main_thread().ident)
    where = (f"{os.path.basename(main.f_code.co_filename)}:{main.f_lineno} in {main.f_code.co_name}"
             if main is not None else "unknown")
    return Activity(in_collective, starting_up, where)


@dataclasses.dataclass
class RankState:
    """What the watchdog last heard from one rank, and when (local monotonic time) it changed."""

    alive: str = ""
    alive_since: float = 0.0
    step: int = 0
    step_since: float = 0.0
    activity: Activity = Activity(False, False, "")


class Watchdog:
    """Heartbeats over `store`; stops the job with a message naming the rank that died or hung.

    store: a torch.distributed Store every rank reaches (its own keys: alive/R, step/R, activity/R, verdict).
    store_host_rank: the rank whose process hosts the store (its loss makes the store unreachable), or
    None when a launcher hosts it.
    secret: the job's shared secret (process_group.shared_secret), which signs and checks verdicts.
    announce: whether this rank prints the verdicts it follows and the forged ones it ignores (the first
    process of each node, so that every node's output says why it stopped).
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, interval_s: float = 1.0,
                 exit_fn=os._exit, store_host_rank: int | None = 0, *, secret: bytes, announce: bool = False):
        if timeout_s <= 0 or interval_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}, interval_s={interval_s}: both must be > 0")
        if not secret:
            raise ValueError("secret: empty; the watchdog signs its verdicts with the job's shared secret")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.secret, self.announce = secret, announce
        self.ignored_verdict = None  # the last unsigned verdict found in the store (said once)
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.exit_fn = exit_fn
        self.store_host_rank = store_host_rank
        self.step = 0
        self.ready = False  # set up (model built, checkpoint loaded): from its first beat on
        self.verdict = None
        self._stopping = threading.Event()
        self._verdict_ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvfp4-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._publish_step()
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Record that this rank completed `step`, or is set up to train after it (called by the training loop;
        published at once)."""
        self.step = step
        self.ready = True
        self._publish_step()

    def stop(self) -> None:
        """Stop beating and tell the other ranks that this one finished (so its silence is not a death)."""
        self._stopping.set()
        if self._thread.is_alive():
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

    def _publish_step(self) -> None:
        try:
            self.store.set(f"step/{self.rank}", str(self.step))
        except Exception:  # the watchdog thread finds out about the store and reports it
            pass

    def _run(self) -> None:
        ranks = {rank: RankState() for rank in range(self.world_size)}
        counter = 0
        failures = 0
        while not self._stopping.wait(self.interval_s):
            counter += 1
            now = time.monotonic()
            try:
                self._publish(counter)
                if self.store.check([VERDICT_KEY]) and self._follow(self.store.get(VERDICT_KEY).decode()):
                    return
                self._read(ranks, now)
                failures = 0
                verdict, silent = self._judge(ranks, now)
            except Exception as error:  # the store's host closed its connections: it is gone
                failures += 1
                if failures < STORE_FAILURES_TO_GIVE_UP:
                    continue
                host = (f"rank {self.store_host_rank}" if self.store_host_rank is not None
                        else "the launcher")
                verdict = (f"the job's store is unreachable ({first_line(error)}): its host, {host}, died or its "
                           f"node is down")
                silent = {self.store_host_rank} if self.store_host_rank is not None else set()
            if verdict is not None:
                self._stop_job(verdict, silent)
                return

    def _publish(self, counter: int) -> None:
        self.store.set(f"alive/{self.rank}", str(counter))
        activity = thread_activity(threading.get_ident())
        if not self.ready:
            activity = dataclasses.replace(activity, starting_up=True)
        self.store.set(f"activity/{self.rank}", activity.encode())

    def _read(self, ranks: dict, now: float) -> None:
        keys = [f"{kind}/{r}" for kind in ("alive", "step", "activity") for r in ranks]
        present = [key for key in keys if self.store.check([key])]
        values = {key: value.decode() for key, value in zip(present, self.store.multi_get(present))} if present else {}
        for rank, state in ranks.items():
            alive = values.get(f"alive/{rank}", "")
            if alive != state.alive or state.alive_since == 0.0:
                state.alive, state.alive_since = alive, now
            step = int(values.get(f"step/{rank}", "0"))
            if step != state.step or state.step_since == 0.0:
                state.step, state.step_since = step, now
            if f"activity/{rank}" in values:
                state.activity = Activity.decode(values[f"activity/{rank}"])

    def _judge(self, ranks: dict, now: float) -> tuple:
        """(message, ranks that cannot report) once a rank died or hung, else (None, set())."""
        finished = {r for r, s in ranks.items() if s.alive == FINISHED}
        ranks = {r: s for r, s in ranks.items() if r not in finished}
        dead = {r for r, s in ranks.items() if r != self.rank and now - s.alive_since > self.timeout_s}
        if dead:
            details = "; ".join(f"rank {r} (last completed step {ranks[r].step}, silent for "
                                f"{now - ranks[r].alive_since:.0f} s)" for r in sorted(dead))
            return f"no heartbeat from {details}: the process died or is frozen", dead | finished
        stalled = {r for r, s in ranks.items() if now - s.step_since > self.timeout_s}
        if not stalled:
            return None, set()
        quiet_s = SILENT_INTERVALS * self.interval_s
        if any(r != self.rank and now - ranks[r].alive_since > quiet_s for r in stalled):
            return None, set()  # a stalled rank stopped beating too: the heartbeat timeout names it
        waiting = sorted(r for r, s in ranks.items() if s.activity.in_collective)
        busy = sorted(r for r, s in ranks.items() if not s.activity.in_collective)
        hung = [r for r in busy if not ranks[r].activity.starting_up]
        started = any(s.step >= 1 for s in ranks.values())
        if hung and (waiting or started):
            details = "; ".join(f"rank {r} at step {ranks[r].step + 1} (not in a collective; at "
                                f"{ranks[r].activity.where})" for r in hung)
            waiters = f"; waiting for it in a collective: rank(s) {', '.join(map(str, waiting))}" if waiting else ""
            return f"no progress for more than {self.timeout_s:g} s: hung {details}{waiters}", finished
        if busy or any(s.activity.starting_up for s in ranks.values()):  # not every rank is set up to train yet
            return None, set()
        details = ", ".join(f"rank {r} after step {s.step}" for r, s in sorted(ranks.items()))
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
                self.store.set(VERDICT_KEY, sign_verdict(self.secret, self.rank, verdict))
            except Exception:  # the store is gone with its host: the others find out by themselves
                pass
            time.sleep(2 * self.interval_s)  # the other ranks read the verdict and stop first
        else:
            time.sleep(3 * self.interval_s)  # the reporting rank prints first
        self.exit_fn(WATCHDOG_EXIT_CODE)

    def _follow(self, published: str) -> bool:
        """Exit too when another rank's watchdog signed the verdict in the store (and say whose it was, when
        announcing); else ignore it, said once. Returns whether it followed."""
        opened = open_verdict(self.secret, published)
        if opened is None:
            if self.announce and published != self.ignored_verdict:
                print(f"nvfp4-train watchdog (rank {self.rank}): ignoring a verdict in the job's store that no rank "
                      f"of this job signed: {published[:200]!r}", file=sys.stderr, flush=True)
            self.ignored_verdict = published
            return False
        origin, verdict = opened
        self.verdict = verdict
        self._verdict_ready.set()
        if self.announce:
            print(f"nvfp4-train watchdog (rank {self.rank}): stopping: rank {origin}'s watchdog stopped the job: "
                  f"{verdict}", file=sys.stderr, flush=True)
        self.exit_fn(WATCHDOG_EXIT_CODE)
        return True
