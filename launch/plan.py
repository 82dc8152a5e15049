"""What an nvfp4-train job will do, decided from its flags and environment before any process does work.

make_plan checks every flag against the allowed values, against the other flags and against the machine
(devices, the output directory, the data file); a ValueError names the flag, its value and what is allowed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import tempfile
import warnings

BYTE_VOCAB = 256
BLOCK = 16  # NVFP4 block length (docs/numerics.md §1)
MAX_SEED = 2 ** 32
MAX_WATCHDOG_TIMEOUT_S = 86400.0
# Environment variables by which MPI launchers announce the world size.
MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
# ... and the number of processes on this machine (torchrun and nvfp4-train's own launcher first).
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
OUTPUT_FILES = ("train.log", "metrics.jsonl")
CHECKPOINT_DIRECTORY = "checkpoints"


class SettingError(ValueError):
    """A setting that does not fit what a worker finds (for example a checkpoint of another shape)."""


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
    recipe_map: object = None  # --recipe-config, checked against `recipe` (nvfp4_dist.RecipeMap)
    # the norms and the activation inside the linears after them (--fused-producers, on for --model megatron)
    fused_producers: bool = False
    dp: int = 1           # data-parallel replicas (world_size / tp)
    fsdp: bool = False    # parameters sharded over the replicas by FSDP2, NVFP4 weights gathered in NVFP4


def detect_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda: no CUDA device is visible (use --device cpu)")
    return requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def launched_world_size() -> int | None:
    """WORLD_SIZE from torchrun or nvfp4-train's own launcher, else from an MPI launcher's variables, else None."""
    for variable in ("WORLD_SIZE", *MPI_SIZE_VARIABLES):
        value = os.environ.get(variable)
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"the environment variable {variable}={value!r}: must be a positive integer")
            return int(value)
    return None


def check_at_least(flag: str, value, minimum) -> None:
    if not value >= minimum:  # also refuses NaN
        raise ValueError(f"{flag}={value}: must be >= {minimum}")


def check_finite(flag: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{flag}={value}: must be a finite number")


def check_numbers(args: argparse.Namespace) -> None:
    """Sizes, counts and rates: each within its allowed range (before any of them divides another)."""
    for flag, value in (("--nproc", args.nproc), ("--tp", args.tp), ("--dp", args.dp), ("--ffn", args.ffn)):
        if value is not None:
            check_at_least(flag, value, 1)
    for flag, value in (("--layers", args.layers), ("--hidden", args.hidden), ("--heads", args.heads),
                        ("--seq-length", args.seq_length), ("--micro-batch", args.micro_batch),
                        ("--steps", args.steps), ("--keep-checkpoints", args.keep_checkpoints),
                        ("--log-every", args.log_every)):
        check_at_least(flag, value, 1)
    for flag, value in (("--save-every", args.save_every), ("--warmup-steps", args.warmup_steps),
                        ("--bf16-first-layers", args.bf16_first_layers),
                        ("--bf16-last-layers", args.bf16_last_layers), ("--seed", args.seed)):
        check_at_least(flag, value, 0)
    if args.seed >= MAX_SEED:
        raise ValueError(f"--seed={args.seed}: must be < 2**32")
    for flag, value in (("--lr", args.lr), ("--min-lr", args.min_lr), ("--weight-decay", args.weight_decay),
                        ("--grad-clip", args.grad_clip), ("--watchdog-timeout", args.watchdog_timeout)):
        check_finite(flag, value)
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr}: must be > 0")
    if not 0 <= args.min_lr <= args.lr:
        raise ValueError(f"--min-lr={args.min_lr}: must be >= 0 and <= --lr={args.lr}")
    check_at_least("--weight-decay", args.weight_decay, 0)
    check_at_least("--grad-clip", args.grad_clip, 0)
    if not 0 < args.watchdog_timeout <= MAX_WATCHDOG_TIMEOUT_S:
        raise ValueError(f"--watchdog-timeout={args.watchdog_timeout}: must be > 0 and <= "
                         f"{MAX_WATCHDOG_TIMEOUT_S:g} seconds")


def check_writable_directory(flag: str, path: pathlib.Path) -> None:
    """`path` is a directory this process can create files in, or can be created as one (by its permissions: a
    clear message for the usual cases before anything is created)."""
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag}={path}: exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag}={path}: the directory is not writable")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}={path}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={path}: cannot be created, {parent} is not writable")


def probe_directory(flag: str, path: pathlib.Path) -> None:
    """Create `path` (with its parents) and a file in it, then remove the file: what permissions do not show
    (a file system such as /proc, a read-only mount, root's writes) fails here, before any process starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag}={path}: cannot be created ({error.strerror or error})") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".nvfp4-train-probe-"):
            pass
    except OSError as error:
        raise ValueError(f"{flag}={path}: cannot create a file in it ({error.strerror or error})") from None


def check_out_dir(out_dir: pathlib.Path) -> None:
    """The output directory, its log files and its checkpoint directory can be written: checked by permissions,
    then tried (the directory is created, a file written in it and in an existing checkpoint directory, and the
    existing log files opened for appending)."""
    check_writable_directory("--out-dir", out_dir)
    for name in OUTPUT_FILES:
        path = out_dir / name
        if path.exists() and (not path.is_file() or not os.access(path, os.W_OK)):
            raise ValueError(f"--out-dir={out_dir}: {path} is not a writable file")
    checkpoints = out_dir / CHECKPOINT_DIRECTORY
    if checkpoints.exists():
        try:
            check_writable_directory("--out-dir", checkpoints)
        except ValueError as error:
            raise ValueError(f"--out-dir={out_dir}: {checkpoints} is not a writable directory") from error
    probe_directory("--out-dir", out_dir)
    for path in (out_dir / name for name in OUTPUT_FILES):
        if path.exists():
            try:
                open(path, "a").close()  # appends nothing
            except OSError as error:
                raise ValueError(f"--out-dir={out_dir}: {path} is not a writable file ({error.strerror or error})"
                                 ) from None
    if checkpoints.exists():
        probe_directory("--out-dir", checkpoints)


def check_data(path: pathlib.Path, seq_length: int) -> None:
    if not path.is_file():
        raise ValueError(f"--data={path}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"--data={path}: the file is not readable")
    size = path.stat().st_size
    if size < seq_length + 2:
        raise ValueError(f"--data={path}: {size} bytes, fewer than --seq-length + 2 = {seq_length + 2}")


def check_shapes(args: argparse.Namespace, tp: int, ffn: int, model: str) -> None:
    """Sizes that must fit the NVFP4 blocks, the TP sharding and each other."""
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
    if model == "megatron" and BYTE_VOCAB % tp:
        raise ValueError(f"--tp={tp} must divide the vocabulary ({BYTE_VOCAB}) for Megatron's vocab-parallel layers")


def check_features(args: argparse.Namespace, tp: int, model: str, device: str) -> None:
    """Features that need others (or a GPU)."""
    if args.sp and tp == 1:
        raise ValueError("--sp needs --tp > 1 (sequence parallelism splits the sequence across the TP group)")
    if args.overlap and tp == 1:
        raise ValueError("--overlap needs --tp > 1 (there is no TP communication to overlap)")
    if args.overlap_transport is not None and not args.overlap:
        raise ValueError("--overlap-transport needs --overlap (it picks how overlap pipelines)")
    if args.gemm_backend in ("cublaslt", "emulated") and device != "cuda":
        raise ValueError(f"--gemm-backend={args.gemm_backend} needs CUDA (--device cuda)")
    if args.fused_producers and model != "megatron":
        raise ValueError("--fused-producers needs --model megatron (the small GPT's norms are modules of their own, "
                         "not inside its linears)")
    if model == "megatron" and args.dtype == "bf16" and device != "cuda":
        raise ValueError("--dtype bf16 with --model megatron needs CUDA (the backward of Megatron-Core's own output "
                         "layer does not follow CPU autocast); on CPU use --dtype fp32, or --model gpt")
    if model == "megatron" and args.sp and device != "cuda":
        raise ValueError("--sp with --model megatron needs CUDA (Megatron-Core's own output layer gathers the "
                         "sequence through a CUDA buffer); on CPU use --model gpt --sp")


def check_fsdp(args: argparse.Namespace, model: str, tp: int, dp: int, ffn: int) -> None:
    """--fsdp: the small GPT, at least two replicas, and NVFP4 weights whose rows (of each TP rank's shard) split
    into dp shards of whole 16x16 blocks (nvfp4_dist.sharded_weight.check_weight_sharding)."""
    if model != "gpt":
        raise ValueError(f"--fsdp needs --model gpt (--model {model}: Megatron-Core shards its parameters with its "
                         f"own distributed optimizer, not FSDP2)")
    if dp < 2:
        raise ValueError(f"--fsdp needs data parallelism: the processes / --tp={tp} give DP={dp}; use --dp 2 or more "
                         f"(or more processes with --nproc)")
    for rows, what in ((3 * args.hidden // tp, f"QKV weight (3 x --hidden={args.hidden} / --tp={tp})"),
                       (args.hidden, f"projection and fc2 weights (--hidden={args.hidden})"),
                       (ffn // tp, f"fc1 weight (--ffn={ffn} / --tp={tp})")):
        if rows % (BLOCK * dp):
            raise ValueError(f"--fsdp with DP={dp}: the {what} has {rows} rows per TP rank, which do not split into "
                             f"{dp} shards of whole {BLOCK}x{BLOCK} blocks; they must be a multiple of {BLOCK} x DP = "
                             f"{BLOCK * dp} (change --hidden/--ffn, --tp or --dp)")


def resolve_parallel_sizes(args: argparse.Namespace, device: str) -> tuple:
    """(world_size, tp, dp) from the launcher's world size (else --nproc, else --tp x --dp, else the GPU count or 2
    on CPU), --tp and --dp; ValueError when they do not fit together."""
    world_size = launched_world_size()
    if world_size is None:
        import torch

        gpus = torch.cuda.device_count() if device == "cuda" else 0
        if args.nproc is None and args.dp is not None:
            tp = args.tp if args.tp is not None else (max(1, gpus // args.dp) if device == "cuda" else 2)
            world_size = tp * args.dp
        else:
            world_size = args.nproc or (gpus if device == "cuda" else 2)
    if args.tp is not None:
        tp = args.tp
    elif args.dp is not None:
        if world_size % args.dp:
            raise ValueError(f"--dp={args.dp} does not divide the number of processes ({world_size})")
        tp = world_size // args.dp
    else:
        tp = world_size if device == "cuda" else min(2, world_size)
    if world_size % tp:
        raise ValueError(f"--tp={tp} does not divide the number of processes ({world_size}): choose a --tp that "
                         f"divides it (the rest is data parallelism)")
    if args.dp is not None and tp * args.dp != world_size:
        raise ValueError(f"--tp={tp} x --dp={args.dp} = {tp * args.dp} processes, but the job has {world_size}: "
                         f"make --tp x --dp equal the number of processes")
    return world_size, tp, world_size // tp


def check_gpu_per_process(device: str, world_size: int) -> None:
    """NCCL takes one GPU per process: refuse a CUDA job whose processes on this machine outnumber its GPUs
    (before NCCL refuses it with "Duplicate GPU detected"), unless a launcher joined them in a process group of its
    choice already (python -m nvfp4_dist.launch.mpi --backend gloo)."""
    import torch
    import torch.distributed as dist

    if device != "cuda" or dist.is_initialized():
        return
    if launched_world_size() is None:
        local = world_size  # nvfp4-train starts the processes itself, here
    else:
        values = (os.environ.get(variable, "") for variable in LOCAL_SIZE_VARIABLES)
        local = next((int(value) for value in values if value.isdigit()), None)
    gpus = torch.cuda.device_count()
    if local is not None and local > gpus:
        raise ValueError(f"{local} processes on this machine and {gpus} GPU(s): NCCL takes one GPU per process; "
                         f"start at most {gpus} per machine (--nproc, or --tp x --dp, or the launcher's processes "
                         f"per node), or let them share GPUs over gloo: mpirun -np N python -m "
                         f"nvfp4_dist.launch.mpi --backend gloo -m nvfp4_dist.launch.train ... (docs/launching.md)")


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate the flags against each other, the machine and the world; ValueError names the offending flag."""
    from nvfp4_dist.launch.faults import FaultInjection

    check_numbers(args)
    device = detect_device(args.device)
    model = args.model if args.model != "auto" else ("megatron" if device == "cuda" else "gpt")
    if model == "megatron":
        try:
            with warnings.catch_warnings():  # its notes on optional packages, not about this job
                warnings.simplefilter("ignore")
                import megatron.core  # noqa: F401
        except ImportError:
            raise ValueError("--model=megatron needs megatron-core: pip install nvfp4-dist[megatron] "
                             "(or use --model gpt)") from None
    world_size, tp, dp = resolve_parallel_sizes(args, device)
    check_gpu_per_process(device, world_size)
    ffn = args.ffn if args.ffn is not None else 4 * args.hidden
    check_shapes(args, tp, ffn, model)
    check_features(args, tp, model, device)
    if args.fsdp:
        check_fsdp(args, model, tp, dp, ffn)
    check_data(args.data, args.seq_length)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    fault = FaultInjection.parse(args.inject_fault) if args.inject_fault else None
    if fault is not None and fault.rank >= world_size:
        raise ValueError(f"--inject-fault={args.inject_fault}: rank {fault.rank} >= {world_size} processes")
    recipe = make_recipe(args)
    recipe_map = load_recipe_config(args.recipe_config, recipe) if args.recipe_config is not None else None
    fused_producers = args.fused_producers if args.fused_producers is not None else model == "megatron"
    check_out_dir(args.out_dir)  # last: it creates the directory, which a refused flag must not leave behind
    return Plan(args, world_size, device, model, tp, ffn, dtype, recipe, fault, recipe_map, fused_producers, dp,
                args.fsdp)


def check_four_over_six_flags(args: argparse.Namespace) -> None:
    """4over6 on the activations needs the RHT off and no row scaling (docs/numerics.md §12, §6b); said in flags,
    as nvfp4-train sets rht and row_scaled_activation from its flags alone."""
    if args.nvfp4_4over6 not in ("activations", "all"):
        return
    if not args.no_rht:
        raise ValueError(f"--nvfp4-4over6={args.nvfp4_4over6} needs --no-rht: 4over6 is not combined with the RHT "
                         "of the activations' columnwise copy (docs/numerics.md §12); add --no-rht, or use "
                         "--nvfp4-4over6=weights")
    if args.row_scaled_activation:
        raise ValueError(f"--nvfp4-4over6={args.nvfp4_4over6} cannot be combined with --row-scaled-activation: the "
                         "columnwise copy of a row-scaled activation takes no 4over6 (docs/numerics.md §6b); use "
                         "--nvfp4-4over6=weights")


def make_recipe(args: argparse.Namespace):
    """The job's NVFP4Recipe: the flags, and the environment for the fields whose flags are not given
    (cli.FIELDS_FROM_FLAG_OR_ENVIRONMENT); a combination the recipe refuses is its ValueError."""
    from nvfp4_dist.launch.cli import given_recipe_fields
    from nvfp4_dist.recipe import NVFP4Recipe

    check_four_over_six_flags(args)
    return NVFP4Recipe.from_env(rht=not args.no_rht, stochastic_rounding=not args.no_sr, weight_2d=not args.no_2d,
                                row_scaled_activation=args.row_scaled_activation,
                                bf16_first_layers=args.bf16_first_layers, bf16_last_layers=args.bf16_last_layers,
                                gemm_backend=args.gemm_backend, overlap=args.overlap, check_finite=True,
                                **({} if args.fused_producers is None else {"fused_producers": args.fused_producers}),
                                **given_recipe_fields(args))


def load_recipe_config(path: pathlib.Path, recipe):
    """--recipe-config's RecipeMap, its dict entries checked against the job's recipe; a ValueError names the flag,
    the file, the key and the problem."""
    from nvfp4_dist.recipe_map import RecipeMap

    try:
        recipe_map = RecipeMap.from_file(path)
        recipe_map.check(recipe)
    except ValueError as error:
        raise ValueError(f"--recipe-config: {error}") from None
    return recipe_map


def check_recipe_config_matches(plan, layer_names: list) -> None:
    """SettingError unless every glob of --recipe-config matches one of the model's NVFP4 linears (a misspelt
    module name would leave its layers on the job's recipe without a word)."""
    unmatched = plan.recipe_map.unmatched(layer_names)
    if unmatched:
        names = f" ({layer_names[0]}, ..., {layer_names[-1]})" if layer_names else ""
        raise SettingError(f"--recipe-config={plan.args.recipe_config}: {', '.join(map(repr, unmatched))} "
                           f"match{'es' if len(unmatched) == 1 else ''} none of the {plan.model} model's NVFP4 "
                           f"linears{names}")
