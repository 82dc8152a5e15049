"""One-GPU convergence check: a GPT (6 layers, hidden 512, 8 heads) trained 300 steps on a fixed token
stream with NVFP4 linears must end within 2% of the same model in BF16. Prints both; exits 1 otherwise.

    python -m tests_multigpu.gpt_convergence [--steps 300] [--out benchmarks/results/gpt_convergence.json]
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
from tests.helpers.gpt_model import GPTConfig, final_loss, train  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bound", type=float, default=0.02)
    parser.add_argument("--out", default="benchmarks/results/gpt_convergence.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpt_convergence needs a GPU", file=sys.stderr)
        return 2
    config = GPTConfig()
    results = {}
    for name, bf16 in (("bf16", True), ("nvfp4", False)):
        start = time.time()
        losses = train(config, bf16=bf16, steps=args.steps, batch_size=args.batch_size, lr=args.lr, device="cuda",
                       log_every=50)
        results[name] = dict(final_loss=final_loss(losses), first_loss=losses[0], seconds=time.time() - start,
                             losses=losses)
    gap = abs(results["nvfp4"]["final_loss"] - results["bf16"]["final_loss"]) / results["bf16"]["final_loss"]
    print(f"final loss (mean of last 10 steps): BF16 {results['bf16']['final_loss']:.4f}  "
          f"NVFP4 {results['nvfp4']['final_loss']:.4f}  gap {gap:.2%} (bound {args.bound:.0%})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(config=dataclasses.asdict(config),
                                   gpu=torch.cuda.get_device_name(), steps=args.steps, batch_size=args.batch_size,
                                   lr=args.lr, gap=gap, bound=args.bound, **results), indent=1))
    return 0 if gap <= args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
