"""One-GPU convergence table: a GPT (6 layers, hidden 512, 8 heads) trained on a fixed token stream in BF16 and with
NVFP4 linears under each recipe variant of tests_multigpu/convergence_variants.py (the default recipe, RHT off, 4over6
on weights / activations / all, row-scaled activations with their NVFP4 or BF16 backward), same seed and data.
Prints each variant's final loss (mean of the last 10 steps) and its gaps to BF16 and to its baseline; writes them
as JSON; exits 1 when the default recipe ends more than --bound from BF16.

    python -m tests_multigpu.gpt_convergence [--steps 250] [--variants nvfp4 4over6_weights]
                                             [--out benchmarks/results/gpt_convergence_<gpu>.json]
"""
import argparse
import dataclasses
import json
import pathlib
import sys
import time

import torch

if not __package__:
    raise SystemExit("run from the repository root as a module: python -m tests_multigpu.gpt_convergence ...")
from nvfp4_dist.recipe import NVFP4Recipe  # noqa: E402
from tests.helpers.gpt_model import GPTConfig, train  # noqa: E402
from tests_multigpu.convergence_variants import (NAMES, add_gaps, entry, gpu_suffix, provenance,  # noqa: E402
                                                 select, summary_lines)

DEFAULT_STEPS = 250  # chosen for every variant within about 3 minutes on one H100


def run_variants(variants, config: GPTConfig, *, steps: int, batch_size: int, lr: float, device: str,
                 log_every: int = 0) -> dict:
    """{variant name: its entry}, each trained from the same initial weights on the same stream, gaps added."""
    results = {}
    for variant in variants:
        bf16 = variant.fields is None
        start = time.perf_counter()
        losses = train(config, bf16=bf16, recipe=None if bf16 else NVFP4Recipe(**variant.fields), steps=steps,
                       batch_size=batch_size, lr=lr, device=device, log_every=log_every, label=variant.name)
        results[variant.name] = entry(variant, losses, time.perf_counter() - start)
        print(f"{variant.name}: final loss {results[variant.name]['final_loss']:.4f} in "
              f"{results[variant.name]['seconds']:.1f} s", flush=True)
    return add_gaps(results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bound", type=float, default=0.02, help="largest |gap| of the default recipe to BF16")
    parser.add_argument("--variants", nargs="+", choices=NAMES, default=list(NAMES),
                        help="the variants to train (their baselines and BF16 are added)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/gpt_convergence_<gpu>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpt_convergence needs a GPU", file=sys.stderr)
        return 2
    config = GPTConfig()
    variants = select(["bf16", *args.variants])
    results = run_variants(variants, config, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                           device="cuda", log_every=50)
    print("\n".join(summary_lines(results)))
    gpu = torch.cuda.get_device_name()
    gap = abs(results["nvfp4"]["gap_vs_bf16"]) if "nvfp4" in results else None
    if gap is not None:
        print(f"default recipe vs BF16: gap {gap:.2%} (bound {args.bound:.0%})")
    out = pathlib.Path(args.out or f"benchmarks/results/gpt_convergence_{gpu_suffix(gpu)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(benchmark="gpt_convergence", config=dataclasses.asdict(config), gpu=gpu,
                                   steps=args.steps, batch_size=args.batch_size, lr=args.lr, bound=args.bound,
                                   gap=gap, variants=results, **provenance()), indent=1))
    print(f"wrote {out}")
    return 0 if gap is None or gap <= args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
