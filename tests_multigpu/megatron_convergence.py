"""Megatron convergence table: tests_multigpu/megatron_train.py (GPTModel, 8 layers, hidden 1024, SwiGLU, order-3
Markov text) once per recipe variant of tests_multigpu/convergence_variants.py (Megatron's local BF16 spec, the NVFP4
spec with the default recipe, RHT off, 4over6 on weights / activations / all, row-scaled activations with their NVFP4
or BF16 backward), same seed and data. Collects each run's JSON into one: final loss (mean of the last 10 steps), its
gaps to BF16 and to its baseline, the run's seconds (process start to exit) and training seconds.

    python -m tests_multigpu.megatron_convergence [--nproc 1] [--variants nvfp4 4over6_all]
                                                  [--out benchmarks/results/megatron_convergence_<gpu>.json]

The defaults (200 steps of 4 x 1024 tokens on one GPU, TP=1) are chosen for the eight runs to take about 5 minutes
on one H100; each run prints its seconds.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

if not __package__:
    raise SystemExit("run from the repository root as a module: python -m tests_multigpu.megatron_convergence ...")
from tests_multigpu.convergence_variants import (NAMES, add_gaps, entry, gpu_suffix, provenance,  # noqa: E402
                                                 select, summary_lines, train_flags)

SCRIPT = pathlib.Path(__file__).with_name("megatron_train.py")
# The environment of the GPU runs of megatron_train.py (tests_multigpu/test_megatron_gpt.py's).
RUN_ENVIRONMENT = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
OUTPUT_TAIL = 6000  # characters of a failed run's output shown


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (processes) per run")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: --nproc)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--variants", nargs="+", choices=NAMES, default=list(NAMES),
                        help="the variants to train (their baselines and BF16 are added)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", default=None, help="default benchmarks/results/megatron_convergence_<gpu>.json "
                                                    "(<gpu>x<N> on N GPUs)")
    args = parser.parse_args(argv)
    args.tp = args.nproc if args.tp is None else args.tp
    for flag, value in (("--nproc", args.nproc), ("--tp", args.tp), ("--steps", args.steps), ("--seq", args.seq),
                        ("--micro-batch", args.micro_batch)):
        if value < 1:
            parser.error(f"{flag}={value}: must be >= 1")
    if args.nproc % args.tp:
        parser.error(f"--tp={args.tp} must divide --nproc={args.nproc}")
    return args


def run_command(variant, args, out: pathlib.Path) -> list[str]:
    """torchrun of megatron_train.py for one variant, writing its JSON to `out`."""
    spec = ["--spec", "local"] if variant.fields is None else ["--spec", "nvfp4", *train_flags(variant)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            str(SCRIPT), "--tp", str(args.tp), "--steps", str(args.steps), "--seq", str(args.seq), "--micro-batch",
            str(args.micro_batch), "--seed", str(args.seed), *spec, "--out", str(out)]


def run_subprocess(command: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, output) of one run."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                env=dict(os.environ, **RUN_ENVIRONMENT))
    except subprocess.TimeoutExpired as error:
        return 124, f"timed out after {timeout:g} s\n{error.stdout or ''}{error.stderr or ''}"
    return result.returncode, result.stdout + result.stderr


def collect(variants, args, directory: pathlib.Path, runner=None) -> tuple[dict, dict, list[str]]:
    """Run every variant with runner(command, timeout) -> (exit status, output), by default run_subprocess:
    ({name: entry}, the last run's JSON, [failure reports]); a failed run has no entry."""
    runner = runner or run_subprocess
    results, failures, last = {}, [], None
    for variant in variants:
        out = directory / f"{variant.name}.json"
        command = run_command(variant, args, out)
        start = time.perf_counter()
        status, output = runner(command, args.timeout)
        seconds = time.perf_counter() - start
        if status != 0 or not out.is_file():
            failures.append(f"{variant.name}: exit status {status}: {' '.join(command)}\n{output[-OUTPUT_TAIL:]}")
            print(f"{variant.name}: FAILED (exit status {status}) after {seconds:.1f} s", flush=True)
            continue
        last = json.loads(out.read_text())
        tokens = args.micro_batch * args.seq * (args.nproc // args.tp) * args.steps
        results[variant.name] = entry(variant, last["losses"], seconds, train_seconds=tokens / last["tokens_per_s"],
                                      eval_loss=last["eval_loss"], peak_memory_gib=last["peak_memory_gib"])
        print(f"{variant.name}: final loss {results[variant.name]['final_loss']:.4f} in {seconds:.1f} s "
              f"({results[variant.name]['train_seconds']:.1f} s training)", flush=True)
    return add_gaps(results), last, failures


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = select(["bf16", *args.variants])
    with tempfile.TemporaryDirectory(prefix="megatron_convergence_") as directory:
        results, last, failures = collect(variants, args, pathlib.Path(directory))
    if failures:
        print("\n\n".join(failures), file=sys.stderr)
        print(f"{len(failures)} of {len(variants)} runs failed; no JSON written", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(results)))
    train_args = last["args"]
    out = pathlib.Path(args.out or f"benchmarks/results/megatron_convergence_"
                                   f"{gpu_suffix(last['device'], args.nproc)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        benchmark="megatron_convergence", gpu=last["device"], gpus=args.nproc, tp=args.tp, steps=args.steps,
        seq=args.seq, micro_batch=args.micro_batch, seed=args.seed, layers=train_args["layers"],
        hidden=train_args["hidden"], heads=train_args["heads"], ffn=train_args["ffn"], vocab=train_args["vocab"],
        data=last["data"], data_entropy_rate=last["data_entropy_rate"], megatron_core=last["megatron_core"],
        seconds=sum(record["seconds"] for record in results.values()), variants=results, **provenance()),
        indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
