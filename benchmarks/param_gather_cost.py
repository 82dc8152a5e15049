"""What gathering the weights in NVFP4 costs a Megatron GPT training step on GPUs (docs/data_parallel.md).

Megatron-Core's GPTModel with the NVFP4 spec (hidden 4096, SwiGLU ffn 14336, 4 layers, seq 4096 x 2: the hidden-4096
row of megatron_gpt.py --host-table) inside Megatron's DistributedDataParallel with the distributed optimizer
(use_distributed_optimizer=True, no overlap) and Megatron's Adam, one step = zero the grad buffers, forward +
backward, optimizer step (which gathers the parameters). Measured, same run, each the median of --iters:
  step_ms_bf16_gather    the step with Megatron's own BF16 parameter gather (the layers quantize their weights);
  step_ms_nvfp4_gather   the step after enable_nvfp4_param_gather: the sharded quantization (amaxes, the all-reduce
                         of maxima, the cast of this rank's bands), the NVFP4 all-gather and the assembly of the
                         gathered weights, which the layers then take instead of quantizing their own;
  gather_ms              the NVFP4 gather alone (every bucket group's start_param_sync + finish_param_sync between
                         two synchronisations: its GPU time and the host time it does not hide).
step_cost = step_ms_nvfp4_gather / step_ms_bf16_gather - 1, what turning the NVFP4 gather on costs a step; target
<= 3%. On W data-parallel ranks each rank casts 1/W of the bands; on one GPU (W = 1) it casts them all, the most
the sharded quantization can cost, and the all-gather is a local copy (timing it over several GPUs belongs to a
multi-GPU run).

    torchrun --nproc-per-node 1 benchmarks/param_gather_cost.py [--iters 10] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import time

import torch

import nvfp4_dist as nv
from nvfp4_dist import NVFP4Recipe
from nvfp4_dist.parallel.megatron import MEGATRON_CORE_VERSION, enable_nvfp4_param_gather
from megatron_gpt import HOST_TABLE, build  # noqa: E402 (benchmarks/ is on sys.path when run)
from provenance import command_line, default_results_path, git_commit  # noqa: E402
from torchrun_setup import init_nccl  # noqa: E402

TARGET_STEP_COST = 0.03
MODEL = HOST_TABLE[2]  # (hidden, ffn, layers, seq, micro-batch)


def synchronised_ms(run) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def gathered_copies_are_full_quantizations(handle) -> bool:
    """Whether every gathered NVFP4 weight equals quantizing the whole weight with its layer's recipe, byte for
    byte (sharded_weight's contract; the parameters are whole after Megatron's own gather)."""
    handle.sync_bf16_weights()  # whole BF16 parameters again (the layers' copies are dropped)
    for group in handle.groups:
        group.start_param_sync()  # the NVFP4 gather of those whole parameters
        group.finish_param_sync()
    for group in handle.groups:
        for weight in group.weights:
            gathered = weight.module.weight_cache.gathered
            expected = nv.quantize(weight.param.detach(), "weight", recipe=weight.module.last_recipe)
            if gathered is None or any(not torch.equal(getattr(gathered, name), getattr(expected, name))
                                       for name in ("rowwise_data", "rowwise_scale", "amax_rowwise")):
                return False
    return True


def measure(args) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    hidden, ffn, layers, seq, micro_batch = MODEL
    model_args = argparse.Namespace(layers=layers, hidden=hidden, ffn=ffn, heads=hidden // 128, seq=seq,
                                    vocab=32000, overlap=False, cuda_graphs=False)
    torch.manual_seed(0)
    module = build("nvfp4", model_args, tp=1, fused_producers=True, transport=NVFP4Recipe.from_env().overlap_transport)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=False,
                                               overlap_grad_reduce=False)
    model = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, clip_grad=0.0,
                                                       use_distributed_optimizer=True), [model])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_args.vocab, (micro_batch, seq + 1), generator=generator).cuda()
    positions = torch.arange(seq, device="cuda").unsqueeze(0).expand(micro_batch, -1)

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
        model.finish_grad_sync()
        optimizer.step()

    def steps() -> float:
        for _ in range(args.warmup):
            step()
        return statistics.median(synchronised_ms(step) for _ in range(args.iters))

    bf16_step = steps()
    handle = enable_nvfp4_param_gather([model])
    nvfp4_step = steps()

    def gather():
        for group in handle.groups:
            group.start_param_sync()
            group.finish_param_sync()
    gather_ms = statistics.median(synchronised_ms(gather) for _ in range(args.iters))
    identical = gathered_copies_are_full_quantizations(handle)
    return {"hidden": hidden, "ffn": ffn, "layers": layers, "seq": seq, "micro_batch": micro_batch,
            "nvfp4_weights": len(handle.layers), "step_ms_bf16_gather": bf16_step, "step_ms_nvfp4_gather": nvfp4_step,
            "gather_ms": gather_ms, "gather_fraction_of_step": gather_ms / bf16_step,
            "step_cost": nvfp4_step / bf16_step - 1, "target_step_cost": TARGET_STEP_COST,
            "gathered_equal_full_quantization": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None, help="default benchmarks/results/param_gather_cost_<gpu>.json")
    args = parser.parse_args()
    if args.warmup < 1 or args.iters < 1:
        parser.error("--warmup and --iters: at least 1")
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        raise SystemExit("runs on GPUs under torchrun: torchrun --nproc-per-node 1 benchmarks/param_gather_cost.py")
    rank, world = init_nccl("nvlink")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    result = measure(args)
    if rank == 0:
        print(f"step {result['step_ms_bf16_gather']:.1f} ms (BF16 gather), {result['step_ms_nvfp4_gather']:.1f} ms "
              f"(NVFP4 gather): step cost {100 * result['step_cost']:+.2f}% (target <= "
              f"{100 * TARGET_STEP_COST:.0f}%); the NVFP4 gather alone {result['gather_ms']:.2f} ms "
              f"({100 * result['gather_fraction_of_step']:.2f}% of the step); gathered weights equal quantizing the "
              f"whole weights: {result['gathered_equal_full_quantization']}", flush=True)
        record = {"benchmark": "param_gather_cost", "device": torch.cuda.get_device_name(), "dp": world,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": git_commit(),
                  "command": command_line(), "megatron_core": MEGATRON_CORE_VERSION, "iters": args.iters,
                  "warmup": args.warmup, **result}
        out = pathlib.Path(args.out) if args.out else default_results_path("param_gather_cost")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
