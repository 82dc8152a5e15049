"""Mixture of experts in NVFP4: the bytes an expert-parallel dispatch moves (NVFP4 vs BF16), and on a GPU the time of
the experts' forward + backward (NVFP4 grouped vs the per-expert NVFP4 and the BF16 experts).

Bytes (any device, --ep ranks: gloo processes on the CPU, NCCL ranks under torchrun on GPUs): every rank routes
--tokens tokens of --hidden elements to --topk of --experts experts (a random router, the same on every run), orders
them by destination rank as Megatron's alltoall dispatcher does, and dispatches them twice through
nvfp4_dist.parallel.moe_dispatch: in BF16 (the tokens' rows) and in NVFP4 (recipe moe_dispatch="nvfp4": codes,
scales and one amax per token, docs/numerics.md §13). Counted: the bytes handed to the all-to-all per rank (at
EP=1 the rows the dispatch step produces, which a larger EP would send). A byte count does not depend on the device
or the links. Target: NVFP4 <= 0.30x BF16. The routing probabilities (FP32, the same in both modes) and the combine
(BF16 in both) are reported beside it.

Time (one GPU, EP=1): Megatron experts modules, forward + backward on routed tokens (the router, permutation and
combine are the same in every variant and left out), --experts experts, top --topk, --hidden, --ffn with SwiGLU:
  nvfp4_grouped     NVFP4GroupedMLP (nv.GroupedLinear, one grouped GEMM per stage on Hopper)
  nvfp4_loop        NVFP4GroupedMLP with one GEMM per expert (grouped_gemm=False)
  nvfp4_sequential  Megatron's SequentialMLP with the NVFP4 linears, one layer per expert
  bf16_sequential   Megatron's SequentialMLP with its own BF16 linears
  bf16_grouped_mm   a BF16 grouped MLP on torch._grouped_mm
and nvfp4_grouped at 8x as many experts (same tokens). The host time of one nvfp4_grouped call at --experts and at
8x as many is measured on a small model (HOST_PROBE), whose kernels keep up with the host (at --hidden, many experts
put the GPU so far behind that the host waits for room in the launch queue). Targets: NVFP4 grouped >= 0.9x the
fastest BF16 variant, >= 3x nvfp4_sequential; host time at 8x the experts within 1.3x.

    python benchmarks/moe.py [--ep 2] [--hidden 4096] [--tokens 256]                       (CPU: bytes)
    torchrun --nproc-per-node 1 benchmarks/moe.py [--links nvlink|slow|two-node] [--tokens 16384]   (GPU)
Writes benchmarks/results/moe_<device>.json (moe_cpu.json on the CPU).
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
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist.parallel import moe_dispatch
from gloo_ranks import run_on_gloo_ranks  # noqa: E402 (benchmarks/ is on sys.path when run)
from provenance import REPOSITORY_ROOT, command_line, git_commit  # noqa: E402
from torchrun_setup import add_links_argument, gpu_label, init_nccl, links_record  # noqa: E402

TARGET_BYTE_RATIO = 0.30
TARGET_VS_BF16 = 0.9
TARGET_VS_SEQUENTIAL = 3.0
TARGET_HOST_RATIO = 1.3
ROUNDS = 5
HOST_PROBE = {"hidden": 256, "ffn": 256, "tokens": 4096}  # host_probe's model


def routed_tokens(args, rank: int, device) -> tuple[torch.Tensor, list[int]]:
    """This rank's tokens routed top-k, ordered by destination rank; (rows [T*topk, H], rows per destination)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16)
    logits = torch.randn(args.tokens, args.experts, generator=generator)
    experts = logits.topk(args.topk, dim=1).indices.reshape(-1)
    order = torch.argsort(experts, stable=True)  # by expert, hence by destination rank
    rows = tokens.repeat_interleave(args.topk, dim=0)[order]
    per_rank = args.experts // args.ep
    counts = torch.bincount(experts // per_rank, minlength=args.ep).tolist()
    return rows.to(device), counts


class CountedAllToAll:
    """Bytes handed to moe_dispatch.all_to_all_rows while active."""

    def __enter__(self):
        self.bytes, self.original = 0, moe_dispatch.all_to_all_rows

        def counted(rows, *args, **kwargs):
            self.bytes += rows.numel() * rows.element_size()
            return self.original(rows, *args, **kwargs)
        moe_dispatch.all_to_all_rows = counted
        return self

    def __exit__(self, *exc):
        moe_dispatch.all_to_all_rows = self.original


def count_bytes(args, rank: int, device) -> dict:
    """Dispatch bytes of this rank, BF16 and NVFP4, for the same routed tokens."""
    rows, sent = routed_tokens(args, rank, device)
    group = dist.group.WORLD
    sent_t = torch.tensor(sent, dtype=torch.int64, device=device)
    received_t = torch.empty_like(sent_t)
    dist.all_to_all_single(received_t, sent_t, group=group)
    received = received_t.tolist()
    with CountedAllToAll() as bf16:
        moe_dispatch.all_to_all_rows(rows, received, sent, group)
    with CountedAllToAll() as nvfp4:
        values, _ = moe_dispatch.dispatch_nvfp4(rows, nv.NVFP4Recipe(moe_dispatch="nvfp4"), group, received, sent)
    if values.shape[0] != sum(received):
        raise RuntimeError(f"dispatched {values.shape[0]} rows, expected {sum(received)}")
    routed = rows.shape[0]
    return {"routed_rows": routed, "bf16_bytes": bf16.bytes, "nvfp4_bytes": nvfp4.bytes,
            "probs_bytes": routed * 4, "combine_bf16_bytes": routed * args.hidden * 2,
            "rows_leaving_rank": routed - sent[rank]}


# ---------------------------------------------------------------------------------------------------------------
# GPU timing of the experts modules.

class BF16GroupedMLP(torch.nn.Module):
    """SwiGLU experts in BF16 on torch._grouped_mm: the fastest BF16 grouped MLP torch offers without extensions."""

    def __init__(self, experts: int, hidden: int, ffn: int, device):
        super().__init__()
        self.fc1 = torch.nn.Parameter(torch.randn(experts, hidden, 2 * ffn, device=device, dtype=torch.bfloat16) * 0.02)
        self.fc2 = torch.nn.Parameter(torch.randn(experts, ffn, hidden, device=device, dtype=torch.bfloat16) * 0.02)

    def forward(self, tokens, tokens_per_expert, probs):
        offs = torch.cumsum(tokens_per_expert.to(tokens.device), 0).to(torch.int32)
        gate, up = torch._grouped_mm(tokens, self.fc1, offs=offs).chunk(2, dim=-1)
        activated = (torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)).to(tokens.dtype)
        return torch._grouped_mm(activated, self.fc2, offs=offs), None


def experts_modules(args, experts: int) -> dict:
    """name -> a function building that experts variant for `experts` experts (Megatron's process groups set)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from nvfp4_dist.parallel.megatron import (NVFP4ColumnParallelLinear, NVFP4GroupedMLP, NVFP4RowParallelLinear)
    config = moe_config(args, experts)
    groups = get_default_pg_collection()
    device = torch.device("cuda", torch.cuda.current_device())

    def sequential(column, row):
        return SequentialMLP(experts, config, MLPSubmodules(linear_fc1=column, linear_fc2=row), groups).to(device)
    return {
        "nvfp4_grouped": lambda: NVFP4GroupedMLP(experts, config, pg_collection=groups).to(device),
        "nvfp4_loop": lambda: NVFP4GroupedMLP(experts, config, pg_collection=groups, grouped_gemm=False).to(device),
        "nvfp4_sequential": lambda: sequential(NVFP4ColumnParallelLinear, NVFP4RowParallelLinear),
        "bf16_sequential": lambda: sequential(ColumnParallelLinear, RowParallelLinear),
        "bf16_grouped_mm": lambda: BF16GroupedMLP(experts, args.hidden, args.ffn, device),
    }


def moe_config(args, experts: int):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=8,
                             num_moe_experts=experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
                             gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                             add_bias_linear=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
                             params_dtype=torch.bfloat16, bf16=True)


def expert_inputs(args, experts: int, device):
    """Routed tokens [tokens*topk, hidden] grouped by expert, tokens_per_expert, probs and an output gradient.
    Each expert's count is a multiple of 16: the per-expert NVFP4 linears of nvfp4_sequential train only on such
    counts (Megatron's SequentialMLP pads only for Transformer Engine's FP8/FP4)."""
    generator = torch.Generator(device=device).manual_seed(5)
    routed = args.tokens * args.topk
    chunks = torch.randint(0, experts, (routed // 16,), generator=generator, device=device)
    tokens_per_expert = torch.bincount(chunks, minlength=experts).cpu() * 16
    routed = int(tokens_per_expert.sum())
    tokens = torch.randn(routed, args.hidden, generator=generator, device=device).to(torch.bfloat16)
    probs = torch.rand(routed, generator=generator, device=device)
    grad = torch.randn(routed, args.hidden, generator=generator, device=device).to(torch.bfloat16)
    return tokens, tokens_per_expert, probs, grad


def forward_backward(module, inputs):
    tokens, tokens_per_expert, probs, grad = inputs
    tokens = tokens.detach().requires_grad_()
    output, _ = module(tokens, tokens_per_expert, probs)
    output.backward(grad)


def time_variant(module, inputs) -> dict:
    """Median GPU-synchronised ms and host ms (until the call returns) of one forward + backward."""
    for _ in range(3):
        forward_backward(module, inputs)
    total, host = [], []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        began = time.perf_counter()
        forward_backward(module, inputs)
        host.append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
        total.append((time.perf_counter() - began) * 1e3)
    return {"ms": statistics.median(total), "host_ms": statistics.median(host)}


def host_probe(args, many: int, device) -> dict:
    """Host ms of one nvfp4_grouped call (started on an idle GPU) at --experts and at `many` experts, on a model
    small enough (HOST_PROBE) that its kernels keep up with the host: at --hidden the GPU falls behind at many
    experts, the launch queue fills and the host time measures the GPU instead."""
    probe = argparse.Namespace(**{**vars(args), **HOST_PROBE})
    rows = {}
    for experts in (args.experts, many):
        with nv.autocast(nv.NVFP4Recipe()):
            timing = time_variant(experts_modules(probe, experts)["nvfp4_grouped"](),
                                  expert_inputs(probe, experts, device))
        rows[str(experts)] = dict(timing, experts=experts)
        print(f"host probe, {experts} experts (hidden {probe.hidden}, ffn {probe.ffn}, {probe.tokens} tokens): host "
              f"{timing['host_ms']:.2f} ms, forward+backward {timing['ms']:.2f} ms", flush=True)
    return {**HOST_PROBE, "experts": rows,
            "host_ratio": rows[str(many)]["host_ms"] / rows[str(args.experts)]["host_ms"]}


def time_experts(args) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = expert_inputs(args, args.experts, device)
    timings = {}
    for name, build in experts_modules(args, args.experts).items():
        torch.manual_seed(0)
        with nv.autocast(nv.NVFP4Recipe()):
            timings[name] = time_variant(build(), inputs)
        print(f"{name:>17}: {timings[name]['ms']:8.2f} ms forward+backward, host {timings[name]['host_ms']:.2f} ms",
              flush=True)
    many = args.experts * 8
    with nv.autocast(nv.NVFP4Recipe()):
        wide = time_variant(experts_modules(args, many)["nvfp4_grouped"](), expert_inputs(args, many, device))
    probe = host_probe(args, many, device)
    fastest_bf16 = min(timings["bf16_sequential"]["ms"], timings["bf16_grouped_mm"]["ms"])
    grouped = timings["nvfp4_grouped"]
    return {"variants": timings, f"nvfp4_grouped_{many}_experts": wide, "host_probe": probe,
            "speed_vs_fastest_bf16": fastest_bf16 / grouped["ms"],
            "speed_vs_nvfp4_sequential": timings["nvfp4_sequential"]["ms"] / grouped["ms"],
            "host_ratio_8x_experts": probe["host_ratio"],
            "targets": {"speed_vs_fastest_bf16": TARGET_VS_BF16, "speed_vs_nvfp4_sequential": TARGET_VS_SEQUENTIAL,
                        "host_ratio_8x_experts": TARGET_HOST_RATIO}}


# ---------------------------------------------------------------------------------------------------------------

def summarise(per_rank: list[dict], args) -> dict:
    bf16 = sum(row["bf16_bytes"] for row in per_rank)
    nvfp4 = sum(row["nvfp4_bytes"] for row in per_rank)
    probs = sum(row["probs_bytes"] for row in per_rank)
    return {"per_rank": per_rank, "bf16_bytes": bf16, "nvfp4_bytes": nvfp4, "ratio": nvfp4 / bf16,
            "ratio_with_probs": (nvfp4 + probs) / (bf16 + probs), "target": TARGET_BYTE_RATIO,
            "expected_ratio": moe_dispatch.row_bytes(args.hidden) / (2 * args.hidden)}


def cpu_rows(rank: int, world_size: int, args) -> list:
    """Every rank's byte counts (on a gloo rank of gloo_ranks.run_on_gloo_ranks)."""
    rows = [None] * world_size
    dist.all_gather_object(rows, count_bytes(args, rank, torch.device("cpu")))
    return rows


def record(args, device: str, dispatch: dict, timing: dict | None) -> dict:
    return {"benchmark": "moe", "device": device, "world_size": args.ep, "ep": args.ep, "hidden": args.hidden, "ffn": args.ffn,
            "experts": args.experts, "topk": args.topk, "tokens_per_rank": args.tokens,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": git_commit()[:7],
            "torch": torch.__version__, "command": command_line(), "dispatch_bytes": dispatch,
            "experts_timing": timing}


def print_bytes(dispatch: dict) -> None:
    mib = 2 ** 20
    print(f"dispatch: BF16 {dispatch['bf16_bytes'] / mib:.3f} MiB, NVFP4 {dispatch['nvfp4_bytes'] / mib:.3f} MiB: "
          f"{dispatch['ratio']:.4f}x (with the FP32 probabilities {dispatch['ratio_with_probs']:.4f}x), "
          f"target <= {TARGET_BYTE_RATIO}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (CPU: gloo processes; GPU: the "
                        "torchrun world)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=4096, help="expert ffn size (SwiGLU: fc1 has twice as many rows)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 16384 on GPUs, 256 on "
                        "the CPU)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    add_links_argument(parser)
    args = parser.parse_args()
    for name in ("ep", "experts", "topk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.experts % args.ep or args.topk > args.experts:
        parser.error(f"--experts {args.experts} must be a multiple of --ep {args.ep} and >= --topk {args.topk}")
    if args.hidden % 16 or args.ffn % 16:
        parser.error(f"--hidden {args.hidden} and --ffn {args.ffn}: multiples of 16")
    on_gpu = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    args.tokens = args.tokens or (16384 if on_gpu else 256)
    if on_gpu:
        rank, world = init_nccl(args.links)
        if world != args.ep:
            parser.error(f"--ep {args.ep}: torchrun started {world} ranks")
        device = torch.device("cuda", torch.cuda.current_device())
        rows = [None] * world
        dist.all_gather_object(rows, count_bytes(args, rank, device))
        dispatch = summarise(rows, args)
        timing = time_experts(args) if args.ep == 1 else None
        if rank == 0:
            print_bytes(dispatch)
            result = dict(record(args, torch.cuda.get_device_name(), dispatch, timing), **links_record(args.links))
            out = args.out or REPOSITORY_ROOT / "benchmarks" / "results" / f"moe_{gpu_label()}.json"
            out.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {out}")
        dist.destroy_process_group()
        return
    rows = run_on_gloo_ranks(cpu_rows, args.ep, args)
    dispatch = summarise(rows, args)
    print_bytes(dispatch)
    out = args.out or REPOSITORY_ROOT / "benchmarks" / "results" / "moe_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record(args, "cpu (gloo)", dispatch, None), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
