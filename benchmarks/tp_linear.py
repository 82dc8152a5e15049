"""An MLP block (ColumnParallelLinear -> GELU -> RowParallelLinear) with sequence parallelism, fwd+bwd.

Compares, on the same group and shapes: the NVFP4 layers, the same layers in their BF16 fallback, and
Megatron-Core's own BF16 ColumnParallelLinear/RowParallelLinear when megatron-core is importable.
Median time over ranks (max), speedups against both BF16 baselines. --links picks the link class
(benchmarks/torchrun_setup.py).

    torchrun --nproc-per-node 4 benchmarks/tp_linear.py [--links nvlink|slow|two-node] [--seq 4096 --batch 2
        --hidden 8192 --ffn 28672] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
from provenance import command_line, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)
from torchrun_setup import add_links_argument, gpu_label, init_nccl, links_record, result_path  # noqa: E402


def median_ms(fn, warmup: int = 3, iterations: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor([sorted(times)[len(times) // 2]], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def nvfp4_dist_block(hidden: int, ffn: int, bf16: bool):
    common = dict(sequence_parallel=True, bias=False, params_dtype=torch.bfloat16, device="cuda", bf16_fallback=bf16,
                  init_method=lambda w: torch.nn.init.normal_(w, std=0.02))
    return ColumnParallelLinear(hidden, ffn, **common), RowParallelLinear(ffn, hidden, **common)


def megatron_block(hidden: int, ffn: int, world_size: int):
    """Megatron-Core's BF16 layers, or None when megatron-core is not installed."""
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig
    except ImportError:
        return None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = ModelParallelConfig(tensor_model_parallel_size=world_size, sequence_parallel=True,
                                 params_dtype=torch.bfloat16)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    column = tensor_parallel.ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=False,
                                                  gather_output=False)
    row = tensor_parallel.RowParallelLinear(ffn, hidden, config=config, init_method=init, bias=False,
                                            input_is_parallel=True, skip_bias_add=False)
    return column.cuda(), row.cuda()


def block_step(column, row, x, dy):
    def step():
        h, _ = column(x)
        y, _ = row(F.gelu(h))
        y.backward(dy)
        x.grad = None
        for p in (*column.parameters(), *row.parameters()):
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
    return step



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--out", default=None, help="default benchmarks/results/tp_linear_<gpu>_tp<W>_<links>.json")
    add_links_argument(parser)
    args = parser.parse_args()
    rank, world_size = init_nccl(args.links)
    torch.manual_seed(0)
    x = torch.randn(args.seq // world_size, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn_like(x)

    results = dict(nvfp4_ms=median_ms(block_step(*nvfp4_dist_block(args.hidden, args.ffn, False), x, dy)),
                   bf16_fallback_ms=median_ms(block_step(*nvfp4_dist_block(args.hidden, args.ffn, True), x, dy)))
    megatron = megatron_block(args.hidden, args.ffn, world_size)
    results["megatron_bf16_ms"] = median_ms(block_step(*megatron, x, dy)) if megatron else None
    results["speedup_vs_bf16_fallback"] = results["bf16_fallback_ms"] / results["nvfp4_ms"]
    if megatron:
        results["speedup_vs_megatron_bf16"] = results["megatron_bf16_ms"] / results["nvfp4_ms"]
    if rank == 0:
        print(f"MLP block fwd+bwd, TP={world_size} with SP, x [{args.seq}/{world_size}, {args.batch}, {args.hidden}], "
              f"ffn {args.ffn}, {torch.cuda.get_device_name()}, links {args.links}")
        print(f"  NVFP4 layers           {results['nvfp4_ms']:8.2f} ms")
        print(f"  same layers, BF16      {results['bf16_fallback_ms']:8.2f} ms   speedup "
              f"{results['speedup_vs_bf16_fallback']:.2f}x")
        if megatron:
            print(f"  Megatron-Core BF16     {results['megatron_bf16_ms']:8.2f} ms   speedup "
                  f"{results['speedup_vs_megatron_bf16']:.2f}x")
        else:
            print("  Megatron-Core BF16     (megatron-core not importable)")
        out = pathlib.Path(args.out or result_path(f"tp_linear_{gpu_label()}_tp{world_size}", args.links))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(benchmark="tp_linear", world_size=world_size, gpu=torch.cuda.get_device_name(),
                                       **links_record(args.links),
                                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                       commit=git_commit(), command=command_line(), torch=torch.__version__,
                                       seq=args.seq, batch=args.batch,
                                       hidden=args.hidden, ffn=args.ffn, **results), indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
