"""Megatron-Core GPTModel: NVFP4 spec vs Megatron's local BF16 spec, TP=4 with sequence parallelism, same batch.

Measures training forward+backward (no optimizer step: the FP32 optimizer state is the same for both and
would only dilute the memory ratio) of a model whose linears dominate: hidden 8192, SwiGLU ffn 28672,
64 heads, seq 4096. Both models use torch SDPA attention (Megatron's local DotProductAttention would
materialise [b, heads, s, s] scores) and the SP-capable NVFP4Norm (Megatron's local norm refuses SP);
the baseline's linears are Megatron's own ColumnParallelLinear / RowParallelLinear in BF16.
Reports tokens/s, peak memory (and memory held at the end of forward: parameters, gradients and what
autograd saved) and the NVFP4/BF16 ratios (targets: tokens/s >= 1.10x over NVLink, >= 1.8x over slow links;
memory <= 0.8x). --links picks the link class (benchmarks/torchrun_setup.py); both specs run over the same links.
--fused-producers picks the NVFP4 model's norms and SwiGLU (the spec's and the recipe's fused_producers): inside
the linears after them and fused into their casts (on, the default of both), Megatron's local structure with the
outputs written in BF16 and then cast (off), or both models in turn (both: "nvfp4" fused, "nvfp4_unfused").
--overlap-transports adds NVFP4 models whose overlapped layers move their bytes another way
(recipe.overlap_transport: ring, collectives or auto; docs/slow_links.md), each as "nvfp4_<transport>"; "nvfp4"
itself keeps the recipe's transport (NVFP4_OVERLAP_TRANSPORT, default auto).

--host-table runs, on one GPU, four models from hidden 1024 to 8192 (HOST_TABLE) with both specs and records each
step's host time beside its step time: where they are equal, the GPU waits for Python. The host time is the median,
over --iters steps each started on an idle GPU, of the time the step's Python takes to return (the kernels queued,
not run): back-to-back steps would measure the GPU instead, once its backlog fills the launch queue (about a
thousand kernels) and the host waits for room; one step started idle waits only if the GPU falls that far behind.

    torchrun --nproc-per-node 1 benchmarks/megatron_gpt.py --host-table [--cuda-graphs]
    torchrun --nproc-per-node 4 benchmarks/megatron_gpt.py [--links nvlink|slow|two-node] [--no-overlap]
                                                           [--fused-producers on|off|both] [--out PATH]
                                                           [--overlap-transports collectives,auto]
"""
import argparse
import datetime
import gc
import gzip
import json
import os
import time

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.cuda_graphs import create_cudagraphs, delete_cuda_graphs
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from nvfp4_dist import NVFP4Recipe
from nvfp4_dist.environment import OVERLAP_TRANSPORTS
from nvfp4_dist.parallel.megatron import (MEGATRON_CORE_VERSION, NVFP4Norm, get_gpt_decoder_block_nvfp4_spec,
                                          with_sdpa_attention, with_sequence_parallel_norm)
from provenance import command_line, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)
from torchrun_setup import add_links_argument, gpu_label, init_nccl, links_record, result_path  # noqa: E402

TOKENS_PER_S_TARGETS = {"nvlink": 1.10, "slow": 1.8}  # NVFP4 / BF16, by link class
MEMORY_TARGET = 0.80
# --fused-producers: the NVFP4 models measured, (result name, the spec's and the recipe's fused_producers)
FUSED_PRODUCER_CHOICES = {"on": (("nvfp4", True),), "off": (("nvfp4", False),),
                          "both": (("nvfp4", True), ("nvfp4_unfused", False))}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="NVFP4 recipe.overlap: ring-pipelined TP communication (default on)")
    parser.add_argument("--fused-producers", choices=FUSED_PRODUCER_CHOICES, default="both",
                        help="the NVFP4 model with the norm/activation casts fused into their producers, without, "
                             "or both in turn (default)")
    parser.add_argument("--overlap-transports", type=transport_list, default=(),
                        help="comma-separated overlap transports (ring, collectives, auto) measured as extra NVFP4 "
                             "models (fused producers on), after the recipe's own")
    parser.add_argument("--host-table", action="store_true",
                        help="instead: one GPU (torchrun --nproc-per-node 1), the models of HOST_TABLE (small to "
                             "large), each spec's step and host ms, fused producers on, into "
                             "megatron_gpt_host_<gpu>.json")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="with --host-table: both specs under Megatron's own per-layer CUDA graphs "
                             "(cuda_graph_impl='local'), captured after its warm-up steps as its schedules do; the "
                             "model wrapped in Megatron's DistributedDataParallel, whose main_grad buffers the "
                             "graphed backward accumulates into")
    parser.add_argument("--out", default=None, help="default benchmarks/results/megatron_gpt_<gpu>x<N>_<links>.json")
    add_links_argument(parser)
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile one step per spec: GPU time by kernel kind, the top kernels, the compute "
                             "stream's gaps and the communication lane's idle stretches, into DIR")
    return parser.parse_args()


def graph_runners(model) -> list:
    return [runner for module in model.modules() for runner in
            getattr(getattr(module, "cudagraph_manager", None), "cudagraph_runners", [])]


def captured_graphs(model) -> int:
    """Forward and backward CUDA graphs Megatron captured for the model's layers."""
    return sum((runner.fwd_graph is not None) + (runner.bwd_graph is not None) for runner in graph_runners(model))


def replayed_graphs(model) -> bool:
    """Whether the timed steps ran the layers through their graphs (Megatron's global switch, set once captured)."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord
    return bool(_CudagraphGlobalRecord.cudagraph_created) and bool(graph_runners(model))


# --host-table: (hidden, ffn, layers, seq, micro-batch) from small models, whose step the host can bound, to large
HOST_TABLE = ((1024, 4096, 8, 2048, 8), (2048, 8192, 8, 2048, 4), (4096, 14336, 4, 4096, 2), (8192, 28672, 2, 4096, 2))


def transport_list(text: str) -> tuple:
    transports = tuple(t for t in text.split(",") if t)
    unknown = [t for t in transports if t not in OVERLAP_TRANSPORTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown overlap transport(s) {unknown}; choose from {OVERLAP_TRANSPORTS}")
    return transports


def build(spec_name: str, args, tp: int, fused_producers: bool = False, transport: str | None = None) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, **({"cuda_graph_impl": "local"} if args.cuda_graphs else {}))
    if spec_name.startswith("nvfp4"):
        recipe = NVFP4Recipe.from_env(**({"overlap": True} if args.overlap else {}), fused_producers=fused_producers,
                                      overlap_transport=transport)
        spec = get_gpt_decoder_block_nvfp4_spec(config, recipe=recipe, bf16_first_layers=0, bf16_last_layers=0,
                                                sdpa_attention=True, fused_producers=fused_producers)
    else:
        layer = with_sequence_parallel_norm(with_sdpa_attention(get_gpt_layer_local_spec(normalization="RMSNorm")))
        spec = TransformerBlockSubmodules(layer_specs=[layer] * args.layers, layer_norm=NVFP4Norm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                    max_sequence_length=args.seq, position_embedding_type="rope").cuda()


def measure(spec_name: str, args, tp: int, fused_producers: bool = False, transport: str | None = None) -> dict:
    """Tokens/s and peak memory of forward+backward on one fixed batch (an NVFP4 model's overlap transport: the
    recipe's unless given)."""
    if spec_name.startswith("nvfp4"):
        transport = transport or NVFP4Recipe.from_env().overlap_transport
    gc.collect()  # the previous spec's model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(spec_name, args, tp, fused_producers, transport)
    if args.cuda_graphs:  # Megatron's graphed backward adds each weight gradient into main_grad, which its DDP owns
        model = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=generator).cuda()
    positions = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.micro_batch, -1)

    after_forward = []

    def step():
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        after_forward.append(torch.cuda.memory_allocated())  # params, grads and everything saved for backward
        loss.backward()
        return loss

    for _ in range(args.warmup):
        step()
    graphs = 0
    if args.cuda_graphs:  # Megatron's schedules call create_cudagraphs() after every step; so does this
        for _ in range(model.config.cuda_graph_warmup_steps + 1):
            step()
            create_cudagraphs()
        graphs = captured_graphs(model)
        if not graphs:
            raise RuntimeError(f"{spec_name}: no CUDA graph was captured")
    torch.cuda.synchronize()
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        loss = step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    host = []  # each step started on an idle GPU: the time its Python takes to queue it (module docstring)
    for _ in range(args.iters):
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        host.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    if args.profile:
        profile_step(step, spec_name, args.profile)
    result = {"tokens_per_s": args.micro_batch * args.seq * args.iters / elapsed,
              "step_ms": 1000 * elapsed / args.iters,
              "host_ms": 1000 * sorted(host)[len(host) // 2],
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
              "memory_after_forward_gib": max(after_forward) / 2**30,
              "loss": float(loss)}
    if args.cuda_graphs:
        result["cuda_graphs"] = graphs
        result["replayed"] = replayed_graphs(model)
        delete_cuda_graphs()
    if spec_name.startswith("nvfp4"):
        result["fused_producers"] = fused_producers
        result["overlap_transport"] = transport
    return result  # the model is freed on return, before the next spec is built


KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("NCCL", ("nccl",)),
    ("NVFP4 dequantize", ("dequantize",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")),
    ("NVFP4 cast/amax/other", ("nvfp4",)),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in lowered for key in keys)), "other")


def profile_step(step, spec_name: str, out_dir: str) -> None:
    """One profiled step (rank 0 writes): GPU time by kernel kind, the 25 longest kernels, the idle gaps of the
    busiest stream with the kernels around them, and the communication lane's busy time and idle stretches, as
    text; plus the chrome trace (gzip) in out_dir."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if torch.distributed.get_rank() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    trace_path = os.path.join(out_dir, f"megatron_trace_{spec_name}.json")
    prof.export_chrome_trace(trace_path)
    with open(trace_path, "rb") as handle:
        trace = handle.read()
    os.remove(trace_path)
    with gzip.open(trace_path + ".gz", "wb") as target:
        target.write(trace)
    events = [e for e in json.loads(trace)["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    lines = [f"{spec_name}: one step, rank 0"] + kind_and_kernel_lines(events) + stream_gap_lines(events)
    lines += communication_lane_lines(events)
    with open(os.path.join(out_dir, f"megatron_profile_{spec_name}.txt"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def kind_and_kernel_lines(events: list) -> list:
    """GPU time by kernel kind, then the 25 kernels with the most total time."""
    by_kind, by_name = {}, {}
    for event in events:
        kind = kernel_kind(event["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + event["dur"]
        count, total = by_name.get(event["name"], (0, 0.0))
        by_name[event["name"]] = (count + 1, total + event["dur"])
    lines = ["GPU time by kernel kind (ms; kinds on different streams overlap)"]
    lines += [f"  {kind:<22}{us / 1e3:>9.2f}" for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    lines.append("longest kernels: calls, total ms, name")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        lines.append(f"  {count:>5}{us / 1e3:>9.2f}  {name[:140]}")
    return lines


def stream_gap_lines(events: list, top: int = 20) -> list:
    """Idle time of the stream with the most kernel time (the compute stream) between its first and last
    kernel, and its longest gaps with the kernels before and after (what it waited for)."""
    streams = {}
    for event in events:
        streams.setdefault(event.get("args", {}).get("stream"), []).append(event)
    busy = {stream: sum(e["dur"] for e in kernels) for stream, kernels in streams.items()}
    stream = max(busy, key=busy.get)
    kernels = sorted(streams[stream], key=lambda e: e["ts"])
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    gaps = [(after["ts"] - (before["ts"] + before["dur"]), before["name"], after["name"])
            for before, after in zip(kernels, kernels[1:])]
    idle = sum(gap for gap, _, _ in gaps if gap > 0)
    lines = [f"stream {stream}: {len(kernels)} kernels, span {span / 1e3:.2f} ms, busy {busy[stream] / 1e3:.2f} ms, "
             f"idle {idle / 1e3:.2f} ms (other streams' busy ms: "
             f"{', '.join(f'{s}: {b / 1e3:.2f}' for s, b in busy.items() if s != stream)})",
             f"its {top} longest gaps: ms, kernel before -> kernel after"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap / 1e3:7.3f}  {before[:70]}  ->  {after[:70]}")
    return lines


def communication_lane_lines(events: list, top: int = 12) -> list:
    """The communication lane: when any NCCL kernel runs, on any stream (time when several run at once counted
    once). Its busy time bounds the step from below, however well the transfers hide; its idle stretches are where
    they could hide more. Lines: busy and idle time within the step, then the longest idle stretches with the
    kernels that ran during them (the work between two transfers)."""
    span_start = min(e["ts"] for e in events)
    span_end = max(e["ts"] + e["dur"] for e in events)
    busy = []  # merged [start, end) of NCCL kernels, in time order
    for event in sorted((e for e in events if kernel_kind(e["name"]) == "NCCL"), key=lambda e: e["ts"]):
        start, end = event["ts"], event["ts"] + event["dur"]
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    edges = [span_start] + [t for interval in busy for t in interval] + [span_end]
    idle = [(start, end) for start, end in zip(edges[::2], edges[1::2]) if end > start]
    busy_us = sum(end - start for start, end in busy)
    lines = [f"communication lane (NCCL kernels, any stream): busy {busy_us / 1e3:.2f} ms of the step's "
             f"{(span_end - span_start) / 1e3:.2f} ms, idle {sum(e - s for s, e in idle) / 1e3:.2f} ms",
             f"its {top} longest idle stretches: ms, ms into the step, the kernels that ran then (ms)"]
    others = [e for e in events if kernel_kind(e["name"]) != "NCCL"]
    for start, end in sorted(idle, key=lambda stretch: stretch[1] - stretch[0], reverse=True)[:top]:
        by_name = {}
        for event in others:
            overlap = min(end, event["ts"] + event["dur"]) - max(start, event["ts"])
            if overlap > 0:
                by_name[event["name"]] = by_name.get(event["name"], 0.0) + overlap
        kernels = "; ".join(f"{name[:60]} {us / 1e3:.2f}" for name, us in
                            sorted(by_name.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"  {(end - start) / 1e3:7.3f}  at {(start - span_start) / 1e3:8.2f}  {kernels or 'none'}")
    return lines


def host_table(args, tp: int) -> None:
    """The HOST_TABLE models on one GPU: NVFP4 spec vs Megatron's local BF16 spec, step and host ms."""
    if tp != 1:
        raise SystemExit("--host-table runs on one GPU: torchrun --nproc-per-node 1")
    rows = []
    for hidden, ffn, layers, seq, micro_batch in HOST_TABLE:
        args.hidden, args.ffn, args.layers, args.seq, args.micro_batch = hidden, ffn, layers, seq, micro_batch
        args.heads = hidden // 128
        bf16, nvfp4 = measure("local_bf16", args, tp), measure("nvfp4", args, tp, True)
        row = {"hidden": hidden, "ffn": ffn, "layers": layers, "seq": seq, "micro_batch": micro_batch,
               "heads": args.heads, "local_bf16": bf16, "nvfp4": nvfp4,
               "tokens_per_s_ratio": nvfp4["tokens_per_s"] / bf16["tokens_per_s"],
               "nvfp4_host_over_step": nvfp4["host_ms"] / nvfp4["step_ms"]}
        rows.append(row)
        print(f"hidden {hidden} ffn {ffn} layers {layers} seq {seq} x {micro_batch}: BF16 {bf16['step_ms']:.1f} ms "
              f"(host {bf16['host_ms']:.1f}), NVFP4 {nvfp4['step_ms']:.1f} ms (host {nvfp4['host_ms']:.1f}); "
              f"NVFP4/BF16 tokens/s {row['tokens_per_s_ratio']:.3f}x", flush=True)
    record = {"benchmark": "megatron_gpt_host_graphed" if args.cuda_graphs else "megatron_gpt_host",
              "device": torch.cuda.get_device_name(), "gpus": 1,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": git_commit(),
              "command": command_line(), "megatron_core": MEGATRON_CORE_VERSION,
              "iters": args.iters, "warmup": args.warmup, "rows": rows}
    graphed = "_graphed" if args.cuda_graphs else ""
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"megatron_gpt_host{graphed}_{gpu_label()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as handle:
        json.dump(record, handle, indent=1)
    print(f"wrote {out}")


def main():
    args = parse_args()
    _, tp = init_nccl(args.links)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=args.cuda_graphs)
    if args.cuda_graphs and not args.host_table:
        raise SystemExit("--cuda-graphs goes with --host-table")
    if args.host_table:
        host_table(args, tp)
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        return
    results = {"local_bf16": measure("local_bf16", args, tp)}
    for name, fused in FUSED_PRODUCER_CHOICES[args.fused_producers]:
        results[name] = measure(name, args, tp, fused)
    for transport in args.overlap_transports:
        results[f"nvfp4_{transport}"] = measure(f"nvfp4_{transport}", args, tp, True, transport)
    speedup = results["nvfp4"]["tokens_per_s"] / results["local_bf16"]["tokens_per_s"]
    transport_ratios = {transport: results[f"nvfp4_{transport}"]["tokens_per_s"] / results["local_bf16"]["tokens_per_s"]
                        for transport in args.overlap_transports}
    unfused = results.get("nvfp4_unfused")
    memory = results["nvfp4"]["peak_memory_gib"] / results["local_bf16"]["peak_memory_gib"]
    if torch.distributed.get_rank() == 0:
        print(f"GPT {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, seq {args.seq}, "
              f"micro-batch {args.micro_batch}, TP={tp} SP, links {args.links}, overlap={args.overlap}, "
              f"fused producers {args.fused_producers}, "
              f"CUDA_DEVICE_MAX_CONNECTIONS="
              f"{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset (8)')}")
        print(f"{'spec':<18}{'tokens/s':>12}{'step ms':>10}{'host ms':>10}{'peak GiB':>10}{'fwd GiB':>9}{'loss':>9}")
        for name, r in results.items():
            print(f"{name:<18}{r['tokens_per_s']:>12.0f}{r['step_ms']:>10.1f}{r['host_ms']:>10.1f}"
                  f"{r['peak_memory_gib']:>10.2f}{r['memory_after_forward_gib']:>9.2f}{r['loss']:>9.4f}")
        target = TOKENS_PER_S_TARGETS.get(args.links)
        print(f"NVFP4/BF16: tokens/s {speedup:.3f}x" + (f" (target >= {target:.2f})" if target else "")
              + f", peak memory {memory:.3f}x (target <= {MEMORY_TARGET:.2f})")
        for transport, ratio in transport_ratios.items():
            print(f"NVFP4 with overlap transport {transport} / BF16: tokens/s {ratio:.3f}x")
        if unfused is not None:
            print(f"fused producers: tokens/s {results['nvfp4']['tokens_per_s'] / unfused['tokens_per_s']:.3f}x "
                  f"of the NVFP4 model without them")
        record = {"benchmark": "megatron_gpt", "device": torch.cuda.get_device_name(), "gpus": tp,
                  **links_record(args.links), "tokens_per_s_target": target,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": git_commit(),
                  "command": command_line(),
                  "megatron_core": MEGATRON_CORE_VERSION, "args": vars(args), "results": results,
                  "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)"),
                  "tokens_per_s_ratio": speedup, "peak_memory_ratio": memory}
        record.update({f"{transport}_tokens_per_s_ratio": ratio for transport, ratio in transport_ratios.items()})
        if unfused is not None:
            record["unfused_tokens_per_s_ratio"] = unfused["tokens_per_s"] / results["local_bf16"]["tokens_per_s"]
            record["fused_vs_unfused_tokens_per_s"] = results["nvfp4"]["tokens_per_s"] / unfused["tokens_per_s"]
        out = args.out or result_path(f"megatron_gpt_{gpu_label()}x{tp}", args.links)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as handle:
            json.dump(record, handle, indent=1)
        print(f"wrote {out}")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
