"""nvfp4-train's command line: the flags, their defaults and help, and one-line errors."""
from __future__ import annotations

import argparse
import pathlib

DEFAULT_CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "fables.txt"
# nvfp4_dist.environment's BACKWARD_MODES, FOUR_OVER_SIX_SCOPES, FOUR_OVER_SIX_ERR_MODES and OVERLAP_TRANSPORTS,
# written out so that --help imports no torch (a test keeps them equal).
BACKWARD_MODES = ("default", "high_precision", "dequantized")
OVERLAP_TRANSPORTS = ("auto", "ring", "collectives")
FOUR_OVER_SIX_SCOPES = ("none", "weights", "activations", "all")
FOUR_OVER_SIX_ERR_MODES = ("MAE", "MSE")
# Recipe fields whose flag (--<field with dashes>) leaves the field to its environment variable when not given.
FIELDS_FROM_FLAG_OR_ENVIRONMENT = ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256", "nvfp4_4over6_err_mode",
                                   "nvfp4_4over6_err_use_fast_math", "backward_mode", "overlap_transport")
DESCRIPTION = "Train a GPT whose linear layers run in NVFP4 under tensor (and sequence) parallelism."
EPILOG = ("Without a launcher it starts its own processes on this machine; under torchrun, mpirun "
          "(python -m nvfp4_dist.launch.mpi) or srun each process is one rank. See docs/launching.md.")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the unset (None) and off (False) ones."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_four_over_six_flags(group) -> None:
    """The 4over6 flags (docs/numerics.md §12) of the recipe fields of the same names; unset: the NVFP4_4OVER6*
    environment variables, else the recipe's defaults."""
    group.add_argument("--nvfp4-4over6", choices=FOUR_OVER_SIX_SCOPES, default=None,
                       help="4over6 adaptive block scaling for none, the weights, the activations (forward inputs) or "
                            "all; activations and all need the RHT off (unset: NVFP4_4OVER6, else none)")
    group.add_argument("--nvfp4-4over6-e4m3-use-256", choices=FOUR_OVER_SIX_SCOPES, default=None,
                       help="the 4over6 tensors whose global scale takes the bound 256 instead of 448 "
                            "(unset: NVFP4_4OVER6_E4M3_USE_256, else all)")
    group.add_argument("--nvfp4-4over6-err-mode", choices=FOUR_OVER_SIX_ERR_MODES, default=None,
                       help="the error that picks each block's 4over6 candidate (unset: NVFP4_4OVER6_ERR_MODE, "
                            "else MAE)")
    group.add_argument("--nvfp4-4over6-err-use-fast-math", action="store_true",
                       help="measure that error in the scaled domain (docs/numerics.md §12; unset: "
                            "NVFP4_4OVER6_ERR_USE_FAST_MATH)")


def given_recipe_fields(args: argparse.Namespace) -> dict:
    """The recipe fields of FIELDS_FROM_FLAG_OR_ENVIRONMENT that the command line gives, by field name (for
    NVFP4Recipe.from_env: the others keep their environment variable or default)."""
    return {field: getattr(args, field) for field in FIELDS_FROM_FLAG_OR_ENVIRONMENT
            if getattr(args, field, None) not in (None, False)}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="nvfp4-train", description=DESCRIPTION, epilog=EPILOG,
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
    where.add_argument("--dp", type=int, default=None,
                       help="data-parallel replicas: the processes are --tp x --dp (default: the processes / --tp; "
                            "without a launcher and --nproc, --dp starts --tp x --dp processes)")
    where.add_argument("--fsdp", action="store_true",
                       help="shard parameters, gradients and optimizer state over the data-parallel replicas with "
                            "FSDP2 (fully_shard), the NVFP4 linears' weights all-gathered in NVFP4 "
                            "(docs/data_parallel.md); --model gpt, DP >= 2")
    where.add_argument("--sp", action="store_true", help="sequence parallelism")
    where.add_argument("--overlap", action="store_true",
                       help="overlap TP communication with the GEMMs, in layers whose ring steps have at least "
                            "NVFP4_OVERLAP_MIN_CHUNK_GFLOPS GFLOP (default 256; smaller ones stay plain) and whose "
                            "rings beat the plain path on the measured links (NVFP4_OVERLAP_IGNORE_LINKS=1: size "
                            "alone; docs/slow_links.md)")
    where.add_argument("--overlap-transport", choices=OVERLAP_TRANSPORTS, default=None,
                       help="with --overlap, the pipelined path: the ring, split collectives (faster than the ring "
                            "where NCCL's point-to-point transfers are slow: PCIe, across nodes), or auto (the "
                            "measured links pick); unset: NVFP4_OVERLAP_TRANSPORT, else auto (docs/slow_links.md)")
    where.add_argument("--layers", type=int, default=2, help="transformer layers")
    where.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 16 x --tp)")
    where.add_argument("--heads", type=int, default=4, help="attention heads (a multiple of --tp)")
    where.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 x --hidden)")
    where.add_argument("--seq-length", type=int, default=64, help="tokens (bytes) per sequence")
    where.add_argument("--micro-batch", type=int, default=8, help="sequences per data-parallel rank and step")
    where.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                       help="activation dtype outside the NVFP4 GEMMs (auto: bf16 on GPU, fp32 on CPU; bf16 with "
                            "--model megatron needs CUDA)")
    recipe = parser.add_argument_group("NVFP4 recipe (docs/numerics.md §10)")
    recipe.add_argument("--no-rht", action="store_true", help="no random Hadamard transform on wgrad operands")
    recipe.add_argument("--no-sr", action="store_true", help="no stochastic rounding of gradients")
    recipe.add_argument("--no-2d", action="store_true", help="1x16 instead of 16x16 weight blocks")
    recipe.add_argument("--row-scaled-activation", action="store_true",
                        help="one amax per activation row (and per column of the wgrad copy), docs/numerics.md "
                             "§6 and §6b")
    recipe.add_argument("--bf16-first-layers", type=int, default=0, help="first transformer layers kept in BF16")
    recipe.add_argument("--bf16-last-layers", type=int, default=0, help="last transformer layers kept in BF16")
    recipe.add_argument("--gemm-backend", choices=("auto", "cublaslt", "emulated", "reference"), default="auto",
                        help="auto: cublaslt on sm_100+, emulated on sm_90, reference on CPU")
    recipe.add_argument("--backward-mode", choices=BACKWARD_MODES, default=None,
                        help="dgrad and wgrad in NVFP4 (default), on the unquantized input and weight "
                             "(high_precision) or on the forward's NVFP4 copies dequantized (dequantized), "
                             "docs/numerics.md §10 (unset: NVFP4_BACKWARD_MODE, else default); with "
                             "--row-scaled-activation, dequantized runs its backward in BF16 instead of on the "
                             "per-column scaled wgrad copy")
    add_four_over_six_flags(recipe)
    recipe.add_argument("--fused-producers", action=argparse.BooleanOptionalAction, default=None,
                        help="--model megatron (on there unless --no-fused-producers): the norms and the activation "
                             "inside the linears after them and fused into the NVFP4 cast of their input, their "
                             "BF16 output never written (the same bytes: docs/fused_producers.md); "
                             "NVFP4_DISABLE_FUSED_PRODUCERS=1 keeps that structure but runs the unfused casts")
    recipe.add_argument("--recipe-config", type=pathlib.Path, default=None, metavar="FILE",
                        help="per-layer recipes, YAML or JSON: module-name globs to \"bf16\" or to recipe fields "
                             "that change this recipe, first match wins (docs/numerics.md §10). Module names: "
                             "layers.<n>.qkv|projection|fc1|fc2 (--model gpt), decoder.layers.<n>.self_attention."
                             "linear_qkv|linear_proj and decoder.layers.<n>.mlp.linear_fc1|linear_fc2 (megatron)")
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
    output.add_argument("--keep-checkpoints", type=int, default=2,
                        help="complete checkpoints kept (the older ones are what a damaged newest one falls back to)")
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

