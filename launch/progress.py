"""What rank 0 of nvfp4-train reports: the console (a progress bar or periodic lines), train.log and metrics.jsonl."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import resource
import sys

BAR_WIDTH = 24


class Reporter:
    """Rank 0's output: a progress bar (terminal) or periodic lines, the log file and metrics.jsonl.

    On other ranks (enabled=False) every method does nothing.
    """

    def __init__(self, out_dir: pathlib.Path, *, total_steps: int, log_every: int, progress_bar: bool,
                 enabled: bool):
        self.enabled = enabled
        self.total = total_steps
        self.log_every = log_every
        self.bar = enabled and progress_bar and sys.stderr.isatty()
        self.log = self.metrics = None
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.log = open(out_dir / "train.log", "a", buffering=1)
            self.metrics = open(out_dir / "metrics.jsonl", "a", buffering=1)

    def _log(self, text: str) -> None:
        self.log.write(f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def line(self, text: str, *, echo: bool = True) -> None:
        """A message for the log file and (echo) the console."""
        if not self.enabled:
            return
        self._log(text)
        if echo:
            if self.bar:
                sys.stderr.write("\r\033[K")
            print(text, file=sys.stderr if self.bar else sys.stdout, flush=True)

    def step(self, record: dict) -> None:
        """One step's record: metrics.jsonl, the log file, and the bar or (every log_every steps) a line."""
        if not self.enabled:
            return
        self.metrics.write(json.dumps(record) + "\n")
        step = record["step"]
        status = "skipped (non-finite)" if record.get("skipped") else f"loss {record['loss']:.4f}"
        text = (f"step {step}/{self.total} | {status} | lr {record['lr']:.2e} | "
                f"{record['tokens_per_s']:,.0f} tok/s | mem {record['memory_mb']:,.0f} MB")
        if self.bar:
            filled = int(BAR_WIDTH * step / self.total)
            sys.stderr.write(f"\r\033[K[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}")
            sys.stderr.flush()
        self.line(text, echo=not self.bar and (step % self.log_every == 0 or step == self.total))

    def close(self) -> None:
        if self.enabled:
            if self.bar:
                sys.stderr.write("\n")
            self.log.close()
            self.metrics.close()


def memory_mb(device) -> float:
    """Peak memory of this process: CUDA allocations on a GPU, the resident set size on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def producers_note(plan) -> str:
    """Where the Megatron model's norms and activation are, and whether their casts are fused (or nothing)."""
    if not plan.fused_producers:
        return ""
    if plan.recipe.fused_producers:
        return ", norms and activation fused into the NVFP4 casts"
    return ", norms and activation inside the linears, unfused casts (NVFP4_DISABLE_FUSED_PRODUCERS=1)"


def recipe_summary(recipe) -> str:
    """The recipe as the fields that differ from its class's defaults (`field=value`); train.log has it whole."""
    changed = [f"{field.name}={getattr(recipe, field.name)!r}" for field in dataclasses.fields(recipe)
               if getattr(recipe, field.name) != field.default]
    name = type(recipe).__name__
    return f"{name} defaults" + (f" except {', '.join(changed)}" if changed else "")


def describe_job(plan, dp_size: int) -> str:
    """The one-line description of the job that starts rank 0's output."""
    args = plan.args
    nodes = plan.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
    return (f"{plan.model} model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}, ffn {plan.ffn}, "
            f"seq {args.seq_length}, micro-batch {args.micro_batch}; {plan.world_size} processes on {nodes} "
            f"node(s), {plan.device} (TP={plan.tp}, DP={dp_size}{' FSDP2' if plan.fsdp else ''}, "
            f"SP {'on' if args.sp else 'off'}, overlap "
            f"{'on' if args.overlap else 'off'}"
            + producers_note(plan)
            + f"); recipe: {recipe_summary(plan.recipe)}"
            + (f"; per-layer recipes from {args.recipe_config}" if args.recipe_config is not None else ""))


def summarize(reporter: Reporter, plan, *, losses: list, skipped: list, step_times: list, tokens_per_step: int,
              total_s: float, device, last_saved) -> None:
    """The summary that ends rank 0's output: steps, loss, throughput, memory and where the files are."""
    if not losses:
        reporter.line("summary: no step trained")
        return
    timed = step_times[1:] or step_times  # the first step includes one-time set-up
    throughput = tokens_per_step * len(timed) / sum(timed)
    (first_step, first_loss), (last_step, last_loss) = losses[0], losses[-1]
    lines = [
        "summary:",
        f"  steps {first_step}-{last_step} in {total_s:.1f} s"
        + (f", skipped (non-finite) {skipped}" if skipped else ""),
        f"  loss {first_loss:.4f} (step {first_step}) -> {last_loss:.4f} (step {last_step})",
        f"  throughput {throughput:,.0f} tokens/s ({tokens_per_step} tokens per step)",
        f"  peak memory {memory_mb(device):,.0f} MB per process (rank 0)",
        f"  checkpoint {last_saved if last_saved else 'none saved'}",
        f"  log {plan.args.out_dir / 'train.log'}, metrics {plan.args.out_dir / 'metrics.jsonl'}",
    ]
    for text in lines:
        reporter.line(text)
