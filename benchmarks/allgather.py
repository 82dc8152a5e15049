"""NVFP4 all-gather (amax all-reduce + data and scales) vs BF16 all-gather of the same logical tensor.

The logical tensor is [M, hidden] in BF16 of 16, 64, 256 and 512 MB, sharded along M over the group.
NVFP4 moves one copy (rowwise data + E4M3 scales: 0.5625 bytes per element); its time includes the
amax MAX all-reduce that must precede the cast (docs/numerics.md §9). Quantization itself is not timed here.
Reported per size: median GPU time per call over back-to-back calls (max over ranks; see median_ms), bus bandwidth
((W-1)/W * gathered bytes / time), the amax all-reduce alone, BF16 time / NVFP4 time, and the host time to enqueue
one call. Targets on 4 H200s: >= 3.0x at 256 MB and above,
>= 2.4x at 64 MB, >= 1.5x at 16 MB.
NVFP4 runs both transports: the default (NVLink peer memory, parallel/symmetric.py, where enabled) and NCCL. The
baseline is NCCL's BF16 all-gather; for a like-for-like view the BF16 tensor is also gathered through the same
peer-memory kernel ("ratio vs peer BF16"). --links picks the link class (benchmarks/torchrun_setup.py).

    torchrun --nproc-per-node 4 benchmarks/allgather.py [--links nvlink|slow|two-node] [--sizes-mb 16 64 256 512]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist.parallel import all_gather_bf16, all_gather_nvfp4, all_reduce_amax, symmetric
from provenance import command_line, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)
from torchrun_setup import add_links_argument, gpu_label, init_nccl, links_record, result_path  # noqa: E402

TARGETS = {16: 1.5, 64: 2.4, 256: 3.0, 512: 3.0}
_SLEEP_CYCLES = 20_000_000  # about 10 ms at H100/H200 clocks: room to enqueue 10 calls


def median_ms(fn, warmup: int = 5, repeats: int = 15, calls: int = 10) -> tuple:
    """(GPU ms per call, host ms per call): medians over repeats of `calls` back-to-back calls, the slowest rank's.

    GPU time: each repeat first parks the GPU in a sleep kernel long enough for the host to enqueue every
    call, then lines the ranks up with a one-element all-reduce, then times the calls with CUDA events; so
    neither the ranks' arrival skew nor host launch overhead is in it (as in training, where the GEMMs keep
    the host ahead of the GPU). Host time: what enqueueing one call costs this process (perf_counter), shown
    separately: when it exceeds the GPU time, a loop of such calls alone is host-bound.
    """
    for _ in range(warmup):
        fn()
    align = torch.zeros(1, device="cuda")
    gpu, host = [], []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_CYCLES)
        dist.all_reduce(align)
        start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - began) * 1e3 / calls)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / calls)
    medians = torch.tensor([statistics.median(gpu), statistics.median(host)], device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians[0].item(), medians[1].item()


def bench_size(size_mb: int, hidden: int, world_size: int, rank: int) -> dict:
    rows = size_mb * 2 ** 20 // 2 // hidden
    if rows % (16 * world_size):
        raise ValueError(f"size {size_mb} MB with hidden={hidden}: {rows} rows do not split into multiples of 16")
    local = torch.randn(rows // world_size, hidden, device="cuda", dtype=torch.bfloat16) * (rank + 1)
    recipe = nv.NVFP4Recipe()
    amax = nv.compute_amaxes(local, "activation", columnwise=False, recipe=recipe)[0]
    all_reduce_amax([amax])
    q = nv.quantize(local, "activation", columnwise=False, recipe=recipe, amax_rowwise=amax)
    nvfp4_bytes = world_size * (q.rowwise_data.numel() + q.rowwise_scale.numel())
    bf16_bytes = world_size * local.numel() * 2
    amax_scratch = amax.clone()

    peer = symmetric.enabled()
    bf16_ms, bf16_host_ms = median_ms(lambda: all_gather_bf16(local))
    bf16_peer_ms = median_ms(lambda: symmetric.all_gather({"x": local}, set()))[0] if peer else None
    amax_nccl_ms = median_ms(lambda: all_reduce_amax([amax_scratch], peer_memory=False))[0]
    gather_nccl_ms = median_ms(lambda: all_gather_nvfp4(q, peer_memory=False))[0]
    nvfp4_nccl_ms = median_ms(lambda: (all_reduce_amax([amax_scratch], peer_memory=False),
                                       all_gather_nvfp4(q, peer_memory=False)))[0]
    amax_ms = median_ms(lambda: all_reduce_amax([amax_scratch]))[0]
    gather_ms = median_ms(lambda: all_gather_nvfp4(q))[0]
    nvfp4_ms, nvfp4_host_ms = median_ms(lambda: (all_reduce_amax([amax_scratch]), all_gather_nvfp4(q)))

    def bus_gbps(nbytes, ms):
        return (world_size - 1) / world_size * nbytes / (ms * 1e-3) / 1e9

    return dict(size_mb=size_mb, rows=rows, hidden=hidden, transport="peer_memory" if peer else "nccl",
                bf16_ms=bf16_ms, bf16_host_ms=bf16_host_ms, bf16_bus_gbps=bus_gbps(bf16_bytes, bf16_ms),
                bf16_peer_ms=bf16_peer_ms, nvfp4_host_ms=nvfp4_host_ms,
                amax_allreduce_ms=amax_ms, amax_allreduce_nccl_ms=amax_nccl_ms,
                nvfp4_gather_only_ms=gather_ms, nvfp4_gather_only_nccl_ms=gather_nccl_ms,
                nvfp4_ms=nvfp4_ms, nvfp4_nccl_ms=nvfp4_nccl_ms, nvfp4_bus_gbps=bus_gbps(nvfp4_bytes, nvfp4_ms),
                nvfp4_bytes=nvfp4_bytes, bf16_bytes=bf16_bytes, ratio=bf16_ms / nvfp4_ms,
                ratio_nccl=bf16_ms / nvfp4_nccl_ms, ratio_vs_peer_bf16=bf16_peer_ms / nvfp4_ms if peer else None,
                target=TARGETS.get(size_mb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256, 512])
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--out", default=None, help="default benchmarks/results/allgather_<gpu>_x<W>_<links>.json")
    add_links_argument(parser)
    args = parser.parse_args()
    rank, world_size = init_nccl(args.links)
    rows = [bench_size(size, args.hidden, world_size, rank) for size in args.sizes_mb]
    if rank == 0:
        header = (f"{'MB':>4} | {'BF16 ms':>8} {'peer':>7} | {'amax':>6} {'nccl':>6} | {'gather':>6} {'nccl':>6} | "
                  f"{'NVFP4 ms':>8} {'nccl':>6} {'bus GB/s':>8} | {'ratio':>6} {'nccl':>6} {'vs peer':>7} {'target':>6} | "
                  f"{'host ms':>7} {'BF16':>6}")
        print(f"all-gather over {world_size} x {torch.cuda.get_device_name()}, links {args.links} (NVFP4 default "
              f"transport: {rows[0]['transport']})")
        print(header)
        print("-" * len(header))
        for r in rows:
            target = f"{r['target']:.1f}x" if r["target"] else "-"
            peer_bf16 = f"{r['bf16_peer_ms']:>7.3f}" if r["bf16_peer_ms"] else f"{'-':>7}"
            vs_peer = f"{r['ratio_vs_peer_bf16']:>6.2f}x" if r["ratio_vs_peer_bf16"] else f"{'-':>7}"
            print(f"{r['size_mb']:>4} | {r['bf16_ms']:>8.3f} {peer_bf16} | {r['amax_allreduce_ms']:>6.3f} "
                  f"{r['amax_allreduce_nccl_ms']:>6.3f} | {r['nvfp4_gather_only_ms']:>6.3f} {r['nvfp4_gather_only_nccl_ms']:>6.3f} | "
                  f"{r['nvfp4_ms']:>8.3f} {r['nvfp4_nccl_ms']:>6.3f} {r['nvfp4_bus_gbps']:>8.1f} | {r['ratio']:>5.2f}x "
                  f"{r['ratio_nccl']:>5.2f}x {vs_peer} {target:>6} | {r['nvfp4_host_ms']:>7.3f} {r['bf16_host_ms']:>6.3f}")
        out = pathlib.Path(args.out or result_path(f"allgather_{gpu_label()}_x{world_size}", args.links))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(benchmark="allgather", world_size=world_size, gpu=torch.cuda.get_device_name(),
                                       **links_record(args.links),
                                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                       commit=git_commit(), command=command_line(), torch=torch.__version__,
                                       results=rows), indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
