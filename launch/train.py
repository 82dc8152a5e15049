"""nvfp4-train: train a GPT whose linear layers run in NVFP4 under tensor (and sequence) parallelism.

    nvfp4-train                                   # no GPU: a small GPT, 2 CPU processes (gloo, TP=2)
    torchrun --nproc-per-node 2 -m nvfp4_dist.launch.train --tp 2 --sp
    mpirun -np 2 nvfp4-train --tp 2 --sp          # or: python -m nvfp4_dist.launch.mpi -m nvfp4_dist.launch.train
With GPUs the model is Megatron-Core's GPTModel with the NVFP4 layer spec (--model megatron, the
default there); without them the small GPT of nvfp4_dist.launch.model (--model gpt). Started
without a launcher, it starts its own processes (--nproc: the GPU count, or 2 on CPU) and stops
them all when one fails. Data: a byte-level tokenization of a text file (a small corpus ships with
the package). Writes <out-dir>/train.log, <out-dir>/metrics.jsonl and checkpoints under
<out-dir>/checkpoints, and resumes from the latest one when started again with the same --out-dir.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import time

DEFAULT_CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "fables.txt"
BYTE_VOCAB = 256
BLOCK = 16
NONFINITE_EXIT_CODE = 4
BAR_WIDTH = 24
# Flags a resumed run must share with its checkpoint (the state's shapes and sharding depend on them).
CHECKPOINT_FLAGS = ("model", "layers", "hidden", "heads", "ffn", "seq_length", "tp", "sp", "world_size")
MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the unset (None) and off (False) ones."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvfp4-train", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    where = parser.add_argument_group("processes and model")
    where.add_argument("--model", choices=("auto", "gpt", "megatron"), default="auto",
                       help="gpt: the small GPT of nvfp4_dist.launch.model; megatron: Megatron-Core GPTModel with "
                            "the NVFP4 spec; auto: megatron on GPUs, gpt on CPU")
    where.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto: cuda when a GPU is visible")
    where.add_argument("--nproc", type=int, default=None,
                       help="processes to start when run without a launcher (default: the GPU count, or 2 on CPU)")
    where.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: 2 on CPU, all GPUs)")
    where.add_argument("--sp", action="store_true", help="sequence parallelism")
    where.add_argument("--overlap", action="store_true",
                       help="overlap TP communication with the GEMMs, in layers whose ring steps have at least "
                            "NVFP4_OVERLAP_MIN_CHUNK_GFLOPS GFLOP (default 256; smaller ones stay plain) and whose "
                            "rings beat the plain path on the measured links (NVFP4_OVERLAP_IGNORE_LINKS=1: size "
                            "alone; docs/slow_links.md)")
    where.add_argument("--layers", type=int, default=2, help="transformer layers")
    where.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 16 x --tp)")
    where.add_argument("--heads", type=int, default=4, help="attention heads (a multiple of --tp)")
    where.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 x --hidden)")
    where.add_argument("--seq-length", type=int, default=64, help="tokens (bytes) per sequence")
    where.add_argument("--micro-batch", type=int, default=8, help="sequences per data-parallel rank and step")
    where.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                       help="activation dtype outside the NVFP4 GEMMs (auto: bf16 on GPU, fp32 on CPU)")
    recipe = parser.add_argument_group("NVFP4 recipe (docs/numerics.md section 10)")
    recipe.add_argument("--no-rht", action="store_true", help="no random Hadamard transform on wgrad operands")
    recipe.add_argument("--no-sr", action="store_true", help="no stochastic rounding of gradients")
    recipe.add_argument("--no-2d", action="store_true", help="1x16 instead of 16x16 weight blocks")
    recipe.add_argument("--row-scaled-activation", action="store_true",
                        help="per-row activation amax (needs --no-rht --no-sr)")
    recipe.add_argument("--bf16-first-layers", type=int, default=0, help="first transformer layers kept in BF16")
    recipe.add_argument("--bf16-last-layers", type=int, default=0, help="last transformer layers kept in BF16")
    recipe.add_argument("--gemm-backend", choices=("auto", "cublaslt", "emulated", "reference"), default="auto",
                        help="auto: cublaslt on sm_100+, emulated on sm_90, reference on CPU")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps in all (a resumed run continues)")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    train.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at --steps (cosine decay)")
    train.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of matrices")
    train.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    train.add_argument("--seed", type=int, default=1234, help="weights, data order and stochastic rounding")
    train.add_argument("--data", type=pathlib.Path, default=DEFAULT_CORPUS, help="text file (byte-level tokens)")
    output = parser.add_argument_group("output, checkpoints and faults")
    output.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("nvfp4-train-out"),
                        help="train.log, metrics.jsonl and checkpoints/ (shared by all nodes)")
    output.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps and at the end (0: never)")
    output.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept")
    output.add_argument("--no-resume", action="store_true",
                        help="start over even if --out-dir holds a checkpoint (deletes its checkpoints)")
    output.add_argument("--log-every", type=int, default=10, help="log line every N steps")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    output.add_argument("--watchdog-timeout", type=float, default=300.0,
                        help="seconds without heartbeat/progress from a rank before the job stops")
    output.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                        help="on a NaN/Inf loss or amax: stop the job, or skip the step's update")
    output.add_argument("--inject-fault", default=None, metavar="KIND:STEP[:RANK]",
                        help="for testing fault handling: kill, hang, nan (all ranks) or crash-in-save")
    return parser


@dataclasses.dataclass
class Plan:
    """Everything decided from the flags and the environment before any process does work."""

    args: argparse.Namespace
    world_size: int
    device: str
    model: str
    tp: int
    ffn: int
    dtype: str
    recipe: object
    fault: object


def detect_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda: no CUDA device is visible (use --device cpu)")
    return requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def launched_world_size() -> int | None:
    """WORLD_SIZE from torchrun/our launcher, else from an MPI launcher's variables, else None."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    for variable in MPI_SIZE_VARIABLES:
        if os.environ.get(variable):
            return int(os.environ[variable])
    return None


def check_positive(name: str, value, minimum=1) -> None:
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate the flags against each other and the world; ValueError names the offending flag."""
    from nvfp4_dist.launch.faults import FaultInjection
    from nvfp4_dist.recipe import NVFP4Recipe

    device = detect_device(args.device)
    model = args.model if args.model != "auto" else ("megatron" if device == "cuda" else "gpt")
    if model == "megatron":
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            raise ValueError("--model=megatron needs megatron-core: pip install nvfp4-dist[megatron] "
                             "(or use --model gpt)") from None
    world_size = launched_world_size()
    if world_size is None:
        import torch

        world_size = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
        check_positive("--nproc", world_size)
    tp = args.tp if args.tp is not None else (world_size if device == "cuda" else min(2, world_size))
    check_positive("--tp", tp)
    if world_size % tp:
        raise ValueError(f"--tp={tp} does not divide the number of processes ({world_size}): choose a --tp that "
                         f"divides it (the rest is data parallelism)")
    ffn = args.ffn if args.ffn is not None else 4 * args.hidden
    for flag, value in (("--layers", args.layers), ("--heads", args.heads), ("--micro-batch", args.micro_batch),
                        ("--steps", args.steps), ("--keep-checkpoints", args.keep_checkpoints),
                        ("--log-every", args.log_every)):
        check_positive(flag, value)
    for flag, value in (("--save-every", args.save_every), ("--warmup-steps", args.warmup_steps),
                        ("--grad-clip", args.grad_clip), ("--weight-decay", args.weight_decay),
                        ("--bf16-first-layers", args.bf16_first_layers),
                        ("--bf16-last-layers", args.bf16_last_layers)):
        check_positive(flag, value, minimum=0)
    if not args.lr > 0 or not 0 <= args.min_lr <= args.lr:
        raise ValueError(f"--lr={args.lr} --min-lr={args.min_lr}: need 0 < --lr and 0 <= --min-lr <= --lr")
    if not args.watchdog_timeout > 0:
        raise ValueError(f"--watchdog-timeout={args.watchdog_timeout}: must be > 0 seconds")
    for flag, value in (("--hidden", args.hidden), ("--ffn", ffn)):
        if value % BLOCK:
            raise ValueError(f"{flag}={value}: must be a multiple of {BLOCK} (NVFP4 blocks)")
    if args.hidden % args.heads:
        raise ValueError(f"--heads={args.heads} must divide --hidden={args.hidden}")
    if args.heads % tp:
        raise ValueError(f"--tp={tp} must divide --heads={args.heads} (each rank holds whole heads)")
    for flag, value in (("--hidden", args.hidden), ("--ffn", ffn)):
        if value % (BLOCK * tp):
            raise ValueError(f"{flag}={value}: each of the --tp={tp} shards ({value / tp:g}) must be a multiple "
                             f"of {BLOCK}; use a multiple of {BLOCK * tp}")
    if args.sp and tp > 1 and args.seq_length % tp:
        raise ValueError(f"--seq-length={args.seq_length}: with --sp it must be divisible by --tp={tp}")
    local_tokens = (args.seq_length // tp if args.sp else args.seq_length) * args.micro_batch
    if local_tokens % BLOCK:
        raise ValueError(f"--seq-length={args.seq_length} x --micro-batch={args.micro_batch}"
                         f"{f' / --tp={tp} (--sp)' if args.sp else ''} = {local_tokens} tokens per rank: must be a "
                         f"multiple of {BLOCK} (NVFP4 columnwise blocks)")
    if args.bf16_first_layers + args.bf16_last_layers > args.layers:
        raise ValueError(f"--bf16-first-layers={args.bf16_first_layers} + --bf16-last-layers="
                         f"{args.bf16_last_layers} exceed --layers={args.layers}")
    if args.row_scaled_activation and not (args.no_rht and args.no_sr):
        raise ValueError("--row-scaled-activation conflicts with RHT and stochastic rounding (on by default): "
                         "add --no-rht --no-sr (row-scaled layers run backward in BF16, docs/numerics.md §6)")
    if args.sp and tp == 1:
        raise ValueError("--sp needs --tp > 1 (sequence parallelism splits the sequence across the TP group)")
    if args.overlap and tp == 1:
        raise ValueError("--overlap needs --tp > 1 (there is no TP communication to overlap)")
    if args.gemm_backend in ("cublaslt", "emulated") and device != "cuda":
        raise ValueError(f"--gemm-backend={args.gemm_backend} needs CUDA (--device cuda)")
    if model == "megatron" and args.sp and device != "cuda":
        raise ValueError("--sp with --model megatron needs CUDA (Megatron-Core's own output layer gathers the "
                         "sequence through a CUDA buffer); on CPU use --model gpt --sp")
    if model == "megatron" and BYTE_VOCAB % tp:
        raise ValueError(f"--tp={tp} must divide the vocabulary ({BYTE_VOCAB}) for Megatron's vocab-parallel layers")
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    if not args.data.is_file():
        raise ValueError(f"--data={args.data}: no such file")
    fault = FaultInjection.parse(args.inject_fault) if args.inject_fault else None
    if fault is not None and fault.rank >= world_size:
        raise ValueError(f"--inject-fault={args.inject_fault}: rank {fault.rank} >= {world_size} processes")
    recipe = NVFP4Recipe.from_env(rht=not args.no_rht, stochastic_rounding=not args.no_sr, weight_2d=not args.no_2d,
                                  row_scaled_activation=args.row_scaled_activation,
                                  bf16_first_layers=args.bf16_first_layers, bf16_last_layers=args.bf16_last_layers,
                                  gemm_backend=args.gemm_backend, overlap=args.overlap,
                                  check_finite=True)
    return Plan(args, world_size, device, model, tp, ffn, dtype, recipe, fault)


# ----------------------------------------------------------------------------------------------
# Launching processes when no launcher did.

def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_local(argv: list, nproc: int, grace_s: float) -> int:
    """Start `nproc` worker processes on this machine; stop them all when one fails. Returns the exit code."""
    from nvfp4_dist.launch.faults import describe_exit

    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    workers = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        # a fixed thread count (MKL may otherwise use fewer threads on a loaded machine, changing how its
        # CPU reductions are split): a resumed run reproduces the same losses
        env.setdefault("MKL_DYNAMIC", "FALSE")
        env.setdefault("OMP_DYNAMIC", "FALSE")
        workers.append(subprocess.Popen([sys.executable, "-m", "nvfp4_dist.launch.train", *argv], env=env))
    failed = None
    try:
        while [worker.poll() for worker in workers].count(None):  # poll every worker, in rank order
            if failed is None:
                failed = next(((rank, w.returncode) for rank, w in enumerate(workers)
                               if w.returncode not in (None, 0)), None)
                if failed is not None:
                    deadline = time.monotonic() + grace_s
            if failed is not None and time.monotonic() > deadline:
                for worker in workers:
                    if worker.poll() is None:
                        worker.kill()
            time.sleep(0.1)
    except KeyboardInterrupt:
        for worker in workers:
            worker.kill()
        raise
    if failed is None:
        failed = next(((rank, w.returncode) for rank, w in enumerate(workers) if w.returncode != 0), None)
    if failed is None:
        return 0
    rank, code = failed
    print(f"nvfp4-train: rank {rank} exited first ({describe_exit(code)}); the job is stopped",
          file=sys.stderr, flush=True)
    return code if code > 0 else 1


# ----------------------------------------------------------------------------------------------
# One worker process.

class Reporter:
    """Rank 0's output: a progress bar (terminal) or periodic lines, the log file and metrics.jsonl."""

    def __init__(self, plan: Plan, enabled: bool):
        self.enabled = enabled
        self.total = plan.args.steps
        self.log_every = plan.args.log_every
        self.bar = enabled and not plan.args.no_progress and sys.stderr.isatty()
        self.log = self.metrics = None
        if enabled:
            plan.args.out_dir.mkdir(parents=True, exist_ok=True)
            self.log = open(plan.args.out_dir / "train.log", "a", buffering=1)
            self.metrics = open(plan.args.out_dir / "metrics.jsonl", "a", buffering=1)

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
        """One step's record: metrics.jsonl, the log file, and the bar or (every --log-every steps) a line."""
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
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def learning_rate(plan: Plan, step: int) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr at --steps."""
    args = plan.args
    if step <= args.warmup_steps:
        return args.lr * step / max(1, args.warmup_steps)
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def load_corpus(path: pathlib.Path, seq_length: int):
    import torch

    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    if data.numel() < seq_length + 2:
        raise ValueError(f"--data={path}: {data.numel()} bytes, fewer than --seq-length + 2")
    return data


def batch_for_step(data, plan: Plan, step: int, dp_rank: int, device):
    """(tokens, labels) [micro_batch, seq]: a pure function of (seed, step, data-parallel rank)."""
    import torch

    args = plan.args
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 4_099 + dp_rank)
    starts = torch.randint(0, data.numel() - args.seq_length - 1, (args.micro_batch,), generator=generator)
    windows = torch.stack([data[s:s + args.seq_length + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def build_tiny_gpt(plan: Plan, device, tp_group):
    import torch

    from nvfp4_dist.launch.model import GPTConfig, TinyGPT

    args = plan.args
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                       ffn_hidden_size=plan.ffn, seq_length=args.seq_length, vocab_size=BYTE_VOCAB)
    dtype = torch.bfloat16 if plan.dtype == "bf16" else torch.float32
    return TinyGPT(config, tp_group=tp_group, sequence_parallel=args.sp, recipe=plan.recipe,
                   compute_dtype=dtype, device=device)


def parallel_groups(world_size: int, tp: int):
    """(tp_group, dp_group) of this rank: TP groups of consecutive ranks, DP groups strided by tp."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tp_group = dp_group = None
    for start in range(0, world_size, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            tp_group = group
    for offset in range(tp):
        group = dist.new_group(list(range(offset, world_size, tp)))
        if rank % tp == offset:
            dp_group = group
    return tp_group, dp_group


def make_optimizer(model, plan: Plan):
    import torch

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": plan.args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=plan.args.lr, betas=(0.9, 0.95))


def clip_gradients(model, max_norm: float, tp_group) -> float:
    """Clip by the global norm; TP-sharded parameters' squares are summed across the TP group."""
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p.grad.float().pow(2).sum() for p in params if getattr(p, "tensor_model_parallel", False)]
    replicated = [p.grad.float().pow(2).sum() for p in params if not getattr(p, "tensor_model_parallel", False)]
    sharded_sq = torch.stack(sharded).sum() if sharded else torch.zeros((), device=params[0].grad.device)
    dist.all_reduce(sharded_sq, group=tp_group)
    total = (sharded_sq + (torch.stack(replicated).sum() if replicated else 0.0)).sqrt()
    if max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(scale.to(p.grad.dtype))
    return float(total)


def average_data_parallel_grads(model, dp_group, dp_size: int) -> None:
    import torch
    import torch.distributed as dist

    if dp_size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(dp_size)
    dist.all_reduce(flat, group=dp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def checkpoint_config(plan: Plan) -> dict:
    args = plan.args
    return {"model": plan.model, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "ffn": plan.ffn, "seq_length": args.seq_length, "tp": plan.tp, "sp": args.sp,
            "world_size": plan.world_size}


def rng_state(device) -> dict:
    import torch

    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def poison_first_layer(model, tracer_filter) -> object:
    """A forward pre-hook that fills the first NVFP4 layer's input with NaN (the 'nan' fault); returns the handle."""
    import torch

    first = next(module for name, module in model.named_modules() if name and tracer_filter(module))

    def hook(module, inputs):
        return (torch.full_like(inputs[0], float("nan")), *inputs[1:])
    return first.register_forward_pre_hook(hook)


def init_process_group(plan: Plan):
    import torch
    import torch.distributed as dist

    from nvfp4_dist.launch import mpi

    timeout_s = 2 * plan.args.watchdog_timeout + 60  # the watchdog names a failed rank before this fires
    if not dist.is_initialized():
        if os.environ.get("RANK") is None:  # under mpirun/srun without torchrun
            mpi.init_distributed(timeout_s=timeout_s, init_process_group=False)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if plan.device == "cuda":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if plan.device == "cuda" else "gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != plan.world_size:
        raise RuntimeError(f"torch.distributed has {dist.get_world_size()} ranks; the launcher announced "
                           f"{plan.world_size}")
    if plan.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_worker(plan: Plan) -> int:
    """Train on this rank; returns the process exit code."""
    import torch.distributed as dist

    from nvfp4_dist.launch import faults

    args = plan.args
    device = init_process_group(plan)
    rank = dist.get_rank()
    watchdog = faults.start_watchdog(args.watchdog_timeout, interval_s=min(1.0, args.watchdog_timeout / 5))
    try:
        return train(plan, device, rank, watchdog)
    except faults.NonFiniteError as error:
        if rank == 0:
            print(f"nvfp4-train: stopping: {error} (--on-nonfinite skip would skip such steps)",
                  file=sys.stderr, flush=True)
        code = NONFINITE_EXIT_CODE
    except SettingError as error:
        sys.stderr.write(f"nvfp4-train (rank {rank}): error: {error}\n")
        sys.stderr.flush()
        code = 2
    except Exception as error:
        if faults.is_communication_error(error):  # a peer died or hung: let the watchdog name it first
            watchdog.hold(args.watchdog_timeout + 5)
        raise
    # A stop this rank chose (every rank stops at the same NaN/Inf step): leaving the process group before the
    # interpreter exits keeps gloo's worker threads from aborting the process (SIGABRT) while it tears down.
    watchdog.stop()
    dist.destroy_process_group()
    return code


class SettingError(ValueError):
    """A setting that does not fit what a worker finds (for example a checkpoint of another shape)."""


def resume(plan: Plan, model, optimizer, checkpoints: pathlib.Path, rank: int, device) -> int:
    """Load the latest complete checkpoint into model and optimizer (and the RNG); returns its step (0: none)."""
    import torch.distributed as dist

    from nvfp4_dist.launch import checkpoint

    if plan.args.no_resume and rank == 0 and checkpoints.exists():
        shutil.rmtree(checkpoints)
    dist.barrier()
    if plan.args.no_resume or checkpoint.latest_step(checkpoints) is None:
        return 0
    try:
        state = checkpoint.load_checkpoint(checkpoints, rank=rank, world_size=plan.world_size)
    except ValueError as error:
        raise SettingError(str(error)) from None
    mismatched = {key: (state["config"].get(key), value) for key, value in checkpoint_config(plan).items()
                  if state["config"].get(key) != value}
    if mismatched:
        details = ", ".join(f"--{key.replace('_', '-')}: checkpoint {old}, now {new}"
                            for key, (old, new) in mismatched.items())
        raise SettingError(f"the checkpoint in {checkpoints} does not fit this run ({details}); use the same "
                           f"flags, another --out-dir, or --no-resume")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    restore_rng(state["rng"], device)
    return state["step"]


def forward_backward(model, tokens, labels, tracer):
    """(loss, problem): the local loss after backward, or problem = (where, what) for a NaN/Inf loss or amax."""
    import torch

    from nvfp4_dist import raise_pending_nonfinite
    from nvfp4_dist.launch import faults

    try:
        loss = model(tokens, labels)
    except ValueError as error:
        if not faults.is_nonfinite_amax_error(error):
            raise
        return None, (tracer.current, str(error))
    if not torch.isfinite(loss):
        return None, ("the loss", f"the loss is {loss.item()}")
    try:
        loss.backward()
        raise_pending_nonfinite()  # the GPU's asynchronous amax checks of this step
    except ValueError as error:
        if not faults.is_nonfinite_amax_error(error):
            raise
        return None, (tracer.current, str(error))
    return float(loss.detach()), None


def describe_job(plan: Plan, dp_size: int) -> str:
    args = plan.args
    nodes = plan.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
    return (f"{plan.model} model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}, ffn {plan.ffn}, "
            f"seq {args.seq_length}, micro-batch {args.micro_batch}; {plan.world_size} processes on {nodes} "
            f"node(s), {plan.device} (TP={plan.tp}, DP={dp_size}, SP {'on' if args.sp else 'off'}, overlap "
            f"{'on' if args.overlap else 'off'}); recipe {plan.recipe}")


def train(plan: Plan, device, rank: int, watchdog) -> int:
    import torch
    import torch.distributed as dist

    from nvfp4_dist.launch import checkpoint, faults
    from nvfp4_dist.launch.model import reduce_sequence_parallel_grads

    args = plan.args
    torch.manual_seed(args.seed)
    if plan.model == "megatron":
        from nvfp4_dist.launch.megatron_model import build_megatron_gpt

        model, tp_group, dp_group = build_megatron_gpt(plan, device)
    else:
        tp_group, dp_group = parallel_groups(plan.world_size, plan.tp)
        model = build_tiny_gpt(plan, device, tp_group)
    dp_size, dp_rank = plan.world_size // plan.tp, rank // plan.tp
    optimizer = make_optimizer(model, plan)
    traced = lambda module: type(module).__module__.startswith("nvfp4_dist.parallel")  # noqa: E731
    tracer = faults.LayerTracer(model, traced)
    checkpoints = args.out_dir / "checkpoints"
    start_step = resume(plan, model, optimizer, checkpoints, rank, device)
    reporter = Reporter(plan, enabled=rank == 0)
    reporter.line(describe_job(plan, dp_size))
    if start_step:
        reporter.line(f"resumed from the step-{start_step} checkpoint in {checkpoints}")
    if start_step >= args.steps:
        reporter.line(f"the checkpoint is at step {start_step} >= --steps={args.steps}: nothing to train "
                      f"(raise --steps, or --no-resume to start over)")
    data = load_corpus(args.data, args.seq_length)
    tokens_per_step = args.micro_batch * args.seq_length * dp_size
    losses, skipped, step_times = [], [], []
    started = time.monotonic()
    last_saved = None
    for step in range(start_step + 1, args.steps + 1):
        step_start = time.monotonic()
        poison = None
        if plan.fault is not None:
            plan.fault.at_step_start(step, rank)
            if plan.fault.kind == "nan" and plan.fault.step == step:
                poison = poison_first_layer(model, traced)
        lr = learning_rate(plan, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens, labels = batch_for_step(data, plan, step, dp_rank, device)
        loss, problem = forward_backward(model, tokens, labels, tracer)
        if poison is not None:
            poison.remove()
        # Every rank learns whether any rank met a NaN/Inf, so all of them skip (or stop) together.
        flags = torch.tensor([float(problem is not None), loss or 0.0], device=device)
        dist.all_reduce(flags[:1], op=dist.ReduceOp.MAX)
        if flags[0].item() > 0:
            where, what = problem or ("another rank", "another rank met a NaN/Inf value")
            if args.on_nonfinite == "stop":
                raise faults.NonFiniteError(step, where, what)
            optimizer.zero_grad(set_to_none=True)
            skipped.append(step)
            reporter.line(f"step {step}: skipped the update: non-finite value in {where}: {what}")
            record = {"step": step, "loss": None, "skipped": f"{where}: {what}", "lr": lr, "tokens_per_s": 0.0,
                      "memory_mb": memory_mb(device)}
        else:
            dist.all_reduce(flags[1:], group=dp_group)
            reduce_sequence_parallel_grads(model, tp_group)
            average_data_parallel_grads(model, dp_group, dp_size)
            grad_norm = clip_gradients(model, args.grad_clip, tp_group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_loss = flags[1].item() / dp_size
            losses.append((step, step_loss))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.monotonic() - step_start
            step_times.append(elapsed)
            record = {"step": step, "loss": step_loss, "grad_norm": grad_norm, "lr": lr,
                      "tokens_per_s": tokens_per_step / elapsed, "memory_mb": memory_mb(device)}
        watchdog.beat(step)
        reporter.step(record)
        if args.save_every and (step % args.save_every == 0 or step == args.steps):
            state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "rng": rng_state(device), "config": checkpoint_config(plan)}
            hook = plan.fault.crash_before_rename(step, rank) if plan.fault is not None else None
            last_saved = checkpoint.save_checkpoint(checkpoints, step, state, rank=rank,
                                                    world_size=plan.world_size, keep=args.keep_checkpoints,
                                                    before_rename=hook)
            reporter.line(f"step {step}: saved checkpoint {last_saved}", echo=False)
    watchdog.stop()
    dist.barrier()
    if rank == 0:
        summarize(reporter, plan, losses, skipped, step_times, tokens_per_step, time.monotonic() - started, device,
                  last_saved)
    reporter.close()
    tracer.remove()
    dist.destroy_process_group()
    return 0


def summarize(reporter, plan, losses, skipped, step_times, tokens_per_step, total, device, last_saved):
    if not losses:
        reporter.line("summary: no step trained")
        return
    timed = step_times[1:] or step_times  # the first step includes one-time set-up
    throughput = tokens_per_step * len(timed) / sum(timed)
    (first_step, first_loss), (last_step, last_loss) = losses[0], losses[-1]
    lines = [
        "summary:",
        f"  steps {first_step}-{last_step} in {total:.1f} s"
        + (f", skipped (non-finite) {skipped}" if skipped else ""),
        f"  loss {first_loss:.4f} (step {first_step}) -> {last_loss:.4f} (step {last_step})",
        f"  throughput {throughput:,.0f} tokens/s ({tokens_per_step} tokens per step)",
        f"  peak memory {memory_mb(device):,.0f} MB per process (rank 0)",
        f"  checkpoint {last_saved if last_saved else 'none saved'}",
        f"  log {plan.args.out_dir / 'train.log'}, metrics {plan.args.out_dir / 'metrics.jsonl'}",
    ]
    for text in lines:
        reporter.line(text)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as error:
        parser.error(str(error))
    if launched_world_size() is None:
        sys.exit(launch_local(argv, plan.world_size, grace_s=min(10.0, args.watchdog_timeout)))
    sys.exit(run_worker(plan))


if __name__ == "__main__":
    main()
