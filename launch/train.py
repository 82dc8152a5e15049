"""nvfp4-train: train a GPT whose linear layers run in NVFP4 under tensor (and sequence) parallelism.

    nvfp4-train                                   # no GPU: a small GPT, 2 CPU processes (gloo, TP=2)
    torchrun --nproc-per-node 2 -m nvfp4_dist.launch.train --tp 2 --sp
    mpirun -np 2 python -m nvfp4_dist.launch.mpi -m nvfp4_dist.launch.train --tp 2 --sp

With GPUs the model is Megatron-Core's GPTModel with the NVFP4 layer spec (--model megatron, the
default there); without them the small GPT of nvfp4_dist.launch.model (--model gpt). Started
without a launcher, it starts its own processes (--nproc: the GPU count, or 2 on CPU) and stops
them all when one fails. Data: a byte-level tokenization of a text file (a small corpus ships with
the package). Writes <out-dir>/train.log, <out-dir>/metrics.jsonl and checkpoints under
<out-dir>/checkpoints, and resumes from the newest verified one when started again with the same
--out-dir. docs/launching.md describes the flags, the outputs and the fault handling.

The parts: cli (flags), plan (checking them), spawn (the local launcher), worker (one process),
trainer (the loop), training_state and checkpoint (saving and resuming), faults (watchdog, injected
faults), process_group (rendezvous), data, optimizer, gradients, progress (reports).
"""
from __future__ import annotations

import sys

from nvfp4_dist.launch import spawn, worker
from nvfp4_dist.launch.cli import build_parser
from nvfp4_dist.launch.plan import launched_world_size, make_plan


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args)
        launched = launched_world_size() is not None
    except ValueError as error:
        parser.error(str(error))
    if not launched:
        sys.exit(spawn.launch_local(argv, plan.world_size, grace_s=min(10.0, args.watchdog_timeout)))
    sys.exit(worker.run_worker(plan))


if __name__ == "__main__":
    main()
