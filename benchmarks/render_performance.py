"""Render docs/performance.md from benchmarks/results/*.json: one table per GPU kind, one row per benchmark; and
the block of docs/slow_links.md between its BLOCK_BEGIN and BLOCK_END lines: the gains on each link class.

    python benchmarks/render_performance.py           # rewrite docs/performance.md and the block of slow_links.md
    python benchmarks/render_performance.py --check   # exit 1 when either is not what this renders

Each row names the command that made its JSON: the command line the JSON records (benchmarks/provenance.py),
or, for a JSON without one, the command rebuilt from the benchmark's script and the arguments the JSON records.
benchmarks/results/ keeps one JSON per benchmark, GPU kind and variant (a recorded setting that changes what is
measured, such as CUDA_DEVICE_MAX_CONNECTIONS); two JSONs for the same row are refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys
from typing import Callable

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPOSITORY / "benchmarks" / "results"
OUTPUT = REPOSITORY / "docs" / "performance.md"
SLOW_LINKS = REPOSITORY / "docs" / "slow_links.md"  # its block between BLOCK_BEGIN and BLOCK_END is rendered
OUTPUT_FLAGS = ("--out", "--out-dir")  # where a benchmark wrote its files: left out of the commands shown
# Recorded settings that make two runs of one benchmark on one GPU kind different measurements.
VARIANT_SETTINGS = ("CUDA_DEVICE_MAX_CONNECTIONS", "NVFP4_SYMMETRIC_MEMORY", "NCCL_P2P_DISABLE", "NVFP4_HOPPER_GEMM")
UNSET_MAX_CONNECTIONS = "unset (8)"


def times(value: float) -> str:
    return f"{value:.2f}x"


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def shape_label(rows: int, cols: int) -> str:
    return f"{rows}²" if rows == cols else f"{rows}x{cols}"


def joined(values) -> str:
    return " / ".join(values)


# ---------------------------------------------------------------------------------------------------------
# One summary and one rebuilt command per benchmark.

def quantize_summary(record: dict) -> list[str]:
    shapes = list(dict.fromkeys((r["rows"], r["cols"]) for r in record["results"]))
    by_kernel: dict = {}
    for r in record["results"]:
        by_kernel.setdefault(r["kernel"], {})[(r["rows"], r["cols"])] = r
    lines = [f"share of the copy's bandwidth at {joined(shape_label(*s) for s in shapes)}:"]
    for kernel, at in by_kernel.items():
        if kernel.startswith("copy"):
            values = [f"{at[s]['gbps']:.0f}" if s in at else "-" for s in shapes]
            lines.append(f"{kernel}: {joined(values)} GB/s")
        else:
            values = [percent(at[s]["fraction_of_copy"]) if s in at else "-" for s in shapes]
            lines.append(f"{kernel}: {joined(values)}")
    ratios: dict = {}
    for r in record.get("stochastic_rounding_time_ratios", []):
        ratios.setdefault((r["kernel"], r["baseline"]), {})[(r["rows"], r["cols"])] = r["time_ratio"]
    for (kernel, baseline), at in ratios.items():
        lines.append(f"time of {kernel} / {baseline}: {joined(times(at[s]) if s in at else '-' for s in shapes)}")
    return lines


def quantize_command(record: dict) -> str:
    shapes = list(dict.fromkeys((r["rows"], r["cols"]) for r in record["results"]))
    squares = []
    for rows, cols in shapes:  # --sizes (square) come first, --shapes after them
        if rows != cols:
            break
        squares.append(rows)
    extra = [f"{rows}x{cols}" for rows, cols in shapes[len(squares):]]
    return shlex.join(["python", "benchmarks/quantize.py", "--sizes", *map(str, squares),
                       *(["--shapes", *extra] if extra else []), "--settle-seconds", f"{record['settle_seconds']:g}"])


def gemm_summary(record: dict) -> list[str]:
    lines = ["M x N x K (cuBLAS BF16): dequantize + cuBLASLt / fused Triton / FP32 product + epilogue"]
    for s in record["shapes"]:
        ratios = [times(s[key]) for key in ("dequantize_matmul_ratio", "fused_ratio", "dequantize_fp32_ratio")]
        lines.append(f"{s['m']}x{s['n']}x{s['k']} ({s['bf16_matmul_tflops']:.0f} TFLOP/s): {joined(ratios)}")
    return lines


def gemm_command(record: dict) -> str:
    return shlex.join(["python", "benchmarks/gemm.py", *(["--sweep"] if "sweep_8192" in record else [])])


def linear_summary(record: dict) -> list[str]:
    lines = []
    for r in record["results"]:
        lines.append(f"{r['tokens']} tokens, {r['in_features']} -> {r['out_features']}: {times(r['speedup'])} "
                     f"({r['nvfp4_ms']:.2f} ms vs {r['bf16_ms']:.2f} ms); saved for backward "
                     f"{times(r['saved_ratio'])} the bytes")
        lines += [f"backward mode {mode}: {times(m['speedup_vs_bf16'])} ({m['ms']:.2f} ms); saved for backward "
                  f"{times(m['saved_ratio_vs_bf16'])}, step peak {times(m['peak_ratio_vs_bf16'])} BF16's bytes"
                  for mode, m in r.get("backward_modes", {}).items()]
    for r in record.get("layernorm_linear", []):
        lines.append(f"LayerNorm + linear vs BF16 `nn.LayerNorm` + `nn.Linear`, {r['tokens']} tokens, "
                     f"{r['in_features']} -> {r['out_features']}: fused producers on "
                     f"{times(r['speedup_fused_vs_bf16'])} ({r['nvfp4_fused_ms']:.2f} ms), off "
                     f"{times(r['speedup_unfused_vs_bf16'])} ({r['nvfp4_unfused_ms']:.2f} ms), BF16 {r['bf16_ms']:.2f} ms")
    return lines


def linear_command(record: dict) -> str:
    shapes = [f"{r['tokens']},{r['in_features']},{r['out_features']}" for r in record["results"]]
    return shlex.join(["python", "benchmarks/linear.py", "--shapes", *shapes])


def fused_producers_summary(record: dict) -> list[str]:
    """Fused chain time / unfused chain time per producer, copies and width (the range over the token counts), and
    the ratio of the bytes the two chains move: the speedup of chains equally close to copy bandwidth."""
    groups: dict = {}
    for r in record["speedups"]:
        groups.setdefault((r["producer"], r["copies"], r["width"]), []).append(r["speedup"])
    moved = {(r["producer"], r["copies"], r["width"], r["chain"]): r["bytes_moved"] for r in record["results"]}
    lines = []
    for (producer, copies, width), v in groups.items():
        line = f"{producer}, width {width}, {copies}: fused {times(min(v))}-{times(max(v))} the speed of unfused"
        unfused, fused = (moved.get((producer, copies, width, chain)) for chain in ("unfused", "fused"))
        if unfused and fused:
            line += f" (bytes moved, unfused / fused: {times(unfused / fused)})"
        lines.append(line)
    return lines


def fused_producers_command(record: dict) -> str:
    return record.get("command") or "python benchmarks/fused_producers.py"


def allgather_summary(record: dict) -> list[str]:
    rows = record["results"]
    transport = "NVLink symmetric memory" if rows[0]["transport"] == "peer_memory" else "NCCL"
    sizes = [f"{r['size_mb']} MB" for r in rows]
    ratios = [times(r["ratio"]) for r in rows]
    lines = [f"{joined(sizes)}:", f"amax all-reduce + all-gather, default transport ({transport}): {joined(ratios)}"]
    if rows[0]["transport"] == "peer_memory":
        lines.append(f"the same on NCCL: {joined(times(r['ratio_nccl']) for r in rows)}")
    lines.append(f"amax MAX all-reduce alone: {microseconds(r['amax_allreduce_ms'] for r in rows)} ({transport}), "
                 f"{microseconds(r['amax_allreduce_nccl_ms'] for r in rows)} (NCCL)")
    return lines


def microseconds(milliseconds) -> str:
    """The range of some times in ms, in us."""
    values = sorted(1e3 * ms for ms in milliseconds)
    low, high = f"{values[0]:.1f}", f"{values[-1]:.1f}"
    return f"{low} us" if low == high else f"{low}-{high} us"


def allgather_command(record: dict) -> str:
    rows = record["results"]
    return shlex.join(["torchrun", "--nproc-per-node", str(record["world_size"]), "benchmarks/allgather.py",
                       "--sizes-mb", *(str(r["size_mb"]) for r in rows), "--hidden", str(rows[0]["hidden"])])


def overlap_summary(record: dict) -> list[str]:
    lines = [f"column+row-parallel MLP pair, TP={record['tp']} SP; speed vs the plain layers, fwd / fwd+bwd:"]
    for s in record["shapes"]:
        fwd, both = s["fwd"], s["fwd+bwd"]
        path = s.get("auto_path", "ring" if s["auto_pipelined"] else "plain")
        auto = {"plain": "plain", "ring": "on the ring", "collectives": "on split collectives"}[path]
        if "overlap_transport" in record:  # results that record the transport the automatic rows ran with
            auto = f"overlap_transport={record['overlap_transport']}: {auto}"
        split = ""
        if "split" in both:  # results that measured split collectives too
            split = (f"; every layer on split collectives {times(fwd['split_speedup'])} / "
                     f"{times(both['split_speedup'])}, split / max(no-comm, comm) "
                     f"{fwd['split_over_max_no_comm_comm']:.2f} / {both['split_over_max_no_comm_comm']:.2f}")
        lines.append(f"{s['tokens']} tokens, hidden {s['hidden']}, ffn {s['ffn']}: every layer on the ring "
                     f"{times(fwd['speedup'])} / {times(both['speedup'])}, ring / max(no-comm, comm) "
                     f"{fwd['overlapped_over_max_no_comm_comm']:.2f} / {both['overlapped_over_max_no_comm_comm']:.2f}; "
                     f"as overlap=True runs it ({auto}) {times(fwd['auto_speedup'])} / {times(both['auto_speedup'])}, "
                     f"its step / max(no-comm, comm) {over_max(fwd, 'auto'):.2f} / {over_max(both, 'auto'):.2f}"
                     f"{split}")
    picture = timeline_picture(record)
    if picture is not None:
        lines.append(f"[timeline of one plain and one overlapped step](../benchmarks/results/{picture})")
    return lines


def over_max(phase: dict, path: str) -> float:
    """A path's step time over the larger of the pair's time without communication and its communication alone."""
    return phase[path] / max(phase["no_comm"], phase["comm"])


def timeline_picture(record: dict) -> str | None:
    """The timeline PNG kept beside the JSON in benchmarks/results/, if any."""
    recorded = (record.get("timeline") or {}).get("png")
    if recorded and (RESULTS / pathlib.PurePath(recorded).name).is_file():
        return pathlib.PurePath(recorded).name
    return None


def overlap_command(record: dict) -> str:
    shapes = ";".join(f"{s['tokens']},{s['hidden']},{s['ffn']}" for s in record["shapes"])
    return shlex.join([f"NVFP4_HOPPER_GEMM={record['hopper_gemm']}",
                       f"NVFP4_OVERLAP_MIN_CHUNK_GFLOPS={record['overlap_min_chunk_gflops']}",
                       *max_connections_setting(record), "torchrun", "--standalone", "--nproc-per-node",
                       str(record["tp"]), "benchmarks/overlap.py", "--shapes", shapes])


def tp_linear_summary(record: dict) -> list[str]:
    lines = [f"column-parallel -> GELU -> row-parallel, seq {record['seq']}, batch {record['batch']}, "
             f"hidden {record['hidden']}, ffn {record['ffn']}, TP={record['world_size']} SP, fwd+bwd"]
    if record.get("megatron_bf16_ms") is not None:
        lines.append(f"vs Megatron-Core's BF16 layers: {times(record['speedup_vs_megatron_bf16'])} "
                     f"({record['nvfp4_ms']:.2f} ms vs {record['megatron_bf16_ms']:.2f} ms)")
    lines.append(f"vs the same layers in their BF16 fallback: {times(record['speedup_vs_bf16_fallback'])} "
                 f"({record['nvfp4_ms']:.2f} ms vs {record['bf16_fallback_ms']:.2f} ms)")
    return lines


def tp_linear_command(record: dict) -> str:
    return shlex.join(["torchrun", "--nproc-per-node", str(record["world_size"]), "benchmarks/tp_linear.py",
                       "--seq", str(record["seq"]), "--batch", str(record["batch"]), "--hidden", str(record["hidden"]),
                       "--ffn", str(record["ffn"])])


def megatron_summary(record: dict) -> list[str]:
    args, nvfp4, bf16 = record["args"], record["results"]["nvfp4"], record["results"]["local_bf16"]
    return [f"GPTModel of {args['layers']} layers, hidden {args['hidden']}, ffn {args['ffn']}, {args['heads']} heads, "
            f"seq {args['seq']}, micro-batch {args['micro_batch']}, TP={record['gpus']} SP, overlap "
            f"{'on' if args['overlap'] else 'off'}; megatron-core {record['megatron_core']}",
            f"tokens/s: {times(record['tokens_per_s_ratio'])} ({nvfp4['tokens_per_s']:.0f} vs "
            f"{bf16['tokens_per_s']:.0f})",
            f"peak memory: {times(record['peak_memory_ratio'])} ({nvfp4['peak_memory_gib']:.2f} vs "
            f"{bf16['peak_memory_gib']:.2f} GiB)", *fused_producers_lines(record), *transport_lines(record)]


def transport_lines(record: dict) -> list[str]:
    """The overlap transport of the NVFP4 model, and the models measured on other transports in the same run."""
    nvfp4 = record["results"]["nvfp4"]
    if "overlap_transport" not in nvfp4:
        return []
    others = [f"{transport} {times(record[f'{transport}_tokens_per_s_ratio'])} "
              f"(step {record['results'][f'nvfp4_{transport}']['step_ms']:.1f} ms)"
              for transport in record["args"].get("overlap_transports", ())]
    return [f"overlap transport: {nvfp4['overlap_transport']}"
            + (f"; on other transports, tokens/s vs BF16: {', '.join(others)}" if others else "")]


def fused_producers_lines(record: dict) -> list[str]:
    """The NVFP4 model's fused producers, and its speed without them where the run measured that too."""
    nvfp4, unfused = record["results"]["nvfp4"], record["results"].get("nvfp4_unfused")
    if "fused_producers" not in nvfp4:
        return []
    lines = [f"fused norm/activation casts: {'on' if nvfp4['fused_producers'] else 'off'}"]
    if unfused is not None:
        lines.append(f"without them: tokens/s {times(record['unfused_tokens_per_s_ratio'])} "
                     f"({unfused['tokens_per_s']:.0f}, step {unfused['step_ms']:.1f} ms vs {nvfp4['step_ms']:.1f} ms); "
                     f"fused / unfused {times(record['fused_vs_unfused_tokens_per_s'])}")
    return lines


def megatron_command(record: dict) -> str:
    flags = []
    for name, value in record["args"].items():
        flag = "--" + name.replace("_", "-")
        if flag in OUTPUT_FLAGS or value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            if value:
                flags += [flag, ",".join(str(item) for item in value)]
        else:
            flags += [flag, str(value)]
    return shlex.join([*max_connections_setting(record), "torchrun", "--nproc-per-node", str(record["gpus"]),
                       "benchmarks/megatron_gpt.py", *flags])


def max_connections_setting(record: dict) -> list[str]:
    value = record.get("cuda_device_max_connections", UNSET_MAX_CONNECTIONS)
    return [] if value == UNSET_MAX_CONNECTIONS else [f"CUDA_DEVICE_MAX_CONNECTIONS={value}"]


def blackwell_host(row: dict) -> str:
    """The row's Blackwell projection: the host time of Blackwell's GEMM path against the B200 GPU time."""
    host = row.get("nv.Linear eager cuBLASLt path host_us")
    if host is None:  # a record from before the cuBLASLt path was measured
        return f" (B200 projected: {row['b200 projected gpu_us']:.0f} us)"
    how = ""
    if row["cuBLASLt path stood in"]:
        how = (f", cuBLASLt stood in: {row['cuBLASLt path launches (GEMMs not counted)']:.0f} launches besides the "
               f"GEMMs, {row['cuBLASLt path launches through nv.gemm (GEMMs not counted)']:.0f} through `nv.gemm`")
    return (f"; on Blackwell's GEMM path host {host:.0f} us eager{how}, against a B200 projected GPU time of "
            f"{row['b200 projected gpu_us']:.0f} us")


def launches(row: dict) -> str:
    """The eager layers' launch counts, where the record has them."""
    nv_eager, nn_eager = row["nv.Linear eager"], row["nn.Linear eager"]
    if "launches" not in nv_eager:
        return ""
    return f", {nv_eager['launches']:.0f} launches against {nn_eager['launches']:.0f}"


def host_overhead_summary(record: dict) -> list[str]:
    lines = []
    for row in record["rows"]:
        eager, graphed = row["nv.Linear eager"], row["nv.Linear graphed"]
        lines.append(f"{row['tokens']}x{row['in']}x{row['out']}: `nv.Linear` host {eager['host_us']:.0f} us eager "
                     f"({times(row['nv/nn host ratio eager'])} `nn.Linear`'s {row['nn.Linear eager']['host_us']:.0f} us"
                     f"{launches(row)}), {graphed['host_us']:.0f} us graphed ({times(row['nv/nn host ratio graphed'])}); "
                     f"its GPU time {eager['gpu_us']:.0f} us" + blackwell_host(row))
    return lines


def host_overhead_command(record: dict) -> str:
    return "python benchmarks/host_overhead.py"


def megatron_gpt_host_summary(record: dict) -> list[str]:
    lines = []
    for row in record["rows"]:
        bf16, nvfp4 = row["local_bf16"], row["nvfp4"]
        lines.append(f"hidden {row['hidden']}, {row['layers']} layers, {row['seq']} x {row['micro_batch']}: NVFP4/BF16 "
                     f"tokens/s {times(row['tokens_per_s_ratio'])}; NVFP4 step {nvfp4['step_ms']:.1f} ms, host "
                     f"{nvfp4['host_ms']:.1f} ms; BF16 step {bf16['step_ms']:.1f} ms")
    return lines


def megatron_gpt_host_command(record: dict) -> str:
    return "torchrun --nproc-per-node 1 benchmarks/megatron_gpt.py --host-table"


def param_gather_summary(record: dict) -> list[str]:
    mib = 2 ** 20
    lines = [f"{row['weight_blocks']} weight blocks: {row['ratio']:.3f}x the bytes ({row['nvfp4_bytes_per_rank'] / mib:.2f} "
             f"/ {row['bf16_bytes_per_rank'] / mib:.2f} MiB per rank and step), {row['amax_allreduces_per_step']} amax "
             f"all-reduce per step" for row in record["results"]]
    megatron = record.get("megatron")
    if megatron:
        lines.append(f"Megatron-Core distributed optimizer (DP={record['world_size']}, {megatron['weight_blocks']} "
                     f"weight blocks): {megatron['ratio']:.3f}x the bytes of its BF16 param all-gather "
                     f"({megatron['nvfp4_bytes'] / mib:.2f} / {megatron['bf16_bytes'] / mib:.2f} MiB per rank and "
                     f"step, target {megatron['target']:.2f}x)")
    return lines


def param_gather_command(record: dict) -> str:
    return "python benchmarks/param_gather.py" + (" --megatron" if "megatron" in record else "")


def param_gather_cost_summary(record: dict) -> list[str]:
    return [f"GPTModel hidden {record['hidden']}, {record['layers']} layers, {record['seq']} x {record['micro_batch']}, "
            f"DP={record['dp']}: step {record['step_ms_nvfp4_gather']:.1f} ms with the NVFP4 param gather "
            f"({record['nvfp4_weights']} weights) vs {record['step_ms_bf16_gather']:.1f} ms with Megatron's: step cost "
            f"{100 * record['step_cost']:+.1f}% (target <= {percent(record['target_step_cost'])}); the gather alone "
            f"{record['gather_ms']:.2f} ms synchronised ({percent(record['gather_fraction_of_step'])} of the step)"]


def moe_summary(record: dict) -> list[str]:
    mib = 2 ** 20
    dispatch = record["dispatch_bytes"]
    lines = [f"EP={record['ep']}, hidden {record['hidden']}, top-{record['topk']} of {record['experts']} experts: NVFP4 "
             f"dispatch moves {dispatch['ratio']:.3f}x the bytes of BF16 dispatch ({dispatch['nvfp4_bytes'] / mib:.2f} "
             f"/ {dispatch['bf16_bytes'] / mib:.2f} MiB; {dispatch['ratio_with_probs']:.3f}x with the FP32 routing "
             f"probabilities)"]
    timing = record.get("experts_timing")
    if timing:
        variants = timing["variants"]
        lines.append(f"experts forward + backward: NVFP4 grouped {variants['nvfp4_grouped']['ms']:.2f} ms, "
                     f"{times(timing['speed_vs_fastest_bf16'])} the speed of the fastest BF16 experts and "
                     f"{times(timing['speed_vs_nvfp4_sequential'])} that of the per-expert NVFP4 SequentialMLP; host "
                     f"time at 8x the experts {times(timing['host_ratio_8x_experts'])}" + _host_probe_note(timing))
    return lines


def _host_probe_note(timing: dict) -> str:
    probe = timing.get("host_probe")
    if probe is None:
        return ""
    return (f" (measured on a hidden-{probe['hidden']} model, {probe['tokens']} tokens, whose kernels keep up with "
            f"the host)")


def moe_command(record: dict) -> str:
    return f"python benchmarks/moe.py --ep {record['ep']}"


MOE_DISPATCH_NAMES = {"nvfp4": "BF16 dispatch", "nvfp4_dispatch": "NVFP4 dispatch"}
MOE_SOURCE_NAMES = {"fables": "windows of the bundled corpus", "markov": "its order-3 Markov stream"}


def moe_convergence_summary(record: dict) -> list[str]:
    settings = record["settings"]
    shared = " and a shared expert" if settings["shared_expert"] else ""
    lines = [f"GPTModel of {settings['layers']} layers ({settings['layers'] - settings['moe_layers']} dense, "
             f"{settings['moe_layers']} MoE: top-{settings['topk']} of {settings['experts']} experts{shared}), hidden "
             f"{settings['hidden']}, SwiGLU, EP={record['ep']}; {settings['steps']} steps of "
             f"{settings['tokens_per_step']} tokens in Megatron's schedule; final loss: the mean of the last "
             f"{settings['final_window']} steps; tolerance {percent(record['tolerance'])} of BF16's; megatron-core "
             f"{record['megatron_core']}",
             "data: " + ", ".join(f"{source} ({MOE_SOURCE_NAMES.get(source, source)}"
                                  + (f", entropy rate {entry['data_entropy_rate']:.3f} nats/byte"
                                     if entry.get("data_entropy_rate") is not None else "") + ")"
                                  for source, entry in record["sources"].items())]
    for source, entry in record["sources"].items():
        models = entry["models"]
        for name, label in MOE_DISPATCH_NAMES.items():
            if name not in models or "rel_diff_vs_bf16" not in models[name]:
                continue
            model = models[name]
            verdict = "within" if model["within_tolerance"] else "outside"
            lines.append(f"{source}, {label}: final loss {model['final_loss']:.4f} vs "
                         f"{models['bf16']['final_loss']:.4f} ({model['rel_diff_vs_bf16'] * 100:+.2f}%, {verdict} "
                         f"{percent(record['tolerance'])}; "
                         f"first loss {model['first_loss']:.3f})")
    return lines


def moe_convergence_command(record: dict) -> str:
    return f"python benchmarks/moe_convergence.py --ep {record['ep']} --steps {record['settings']['steps']}"


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """How one benchmark's JSON becomes a row."""

    title: str
    baseline: str  # what it is compared with, in the same run
    summary: Callable[[dict], list]
    command: Callable[[dict], str]


BENCHMARKS = {  # row order
    "quantize": Benchmark("quantize kernels", "a BF16 device-to-device copy of the same element count",
                          quantize_summary, quantize_command),
    "gemm": Benchmark("GEMM (Hopper emulation)", "cuBLAS BF16 `torch.matmul`, same shapes", gemm_summary, gemm_command),
    "linear": Benchmark("`nv.Linear` forward + backward", "`torch.nn.Linear` in BF16", linear_summary,
                        linear_command),
    "host_overhead": Benchmark("host time of one forward + backward, eager and CUDA-graphed", "`torch.nn.Linear` "
                               "in BF16, eager (host time; docs/cuda_graphs.md has the method and the B200 "
                               "projection's assumptions)", host_overhead_summary, host_overhead_command),
    "fused_producers": Benchmark("norm / activation fused into the NVFP4 cast", "the unfused chain (BF16 output "
                                 "written, then quantized)", fused_producers_summary, fused_producers_command),
    "allgather": Benchmark("NVFP4 all-gather", "NCCL's BF16 all-gather of the same tensor", allgather_summary,
                           allgather_command),
    "tp_linear": Benchmark("tensor-parallel MLP block", "Megatron-Core's BF16 layers; the BF16 fallback",
                           tp_linear_summary, tp_linear_command),
    "overlap": Benchmark("communication/GEMM overlap", "the same layers without overlap", overlap_summary,
                         overlap_command),
    "megatron_gpt": Benchmark("Megatron-Core GPT training step", "Megatron's BF16 linears, same model",
                              megatron_summary, megatron_command),
    "megatron_gpt_host": Benchmark("Megatron-Core GPT step on one GPU, eager: step and host time", "Megatron's local "
                                   "BF16 spec, same model (both with SDPA attention)", megatron_gpt_host_summary,
                                   megatron_gpt_host_command),
    "megatron_gpt_host_graphed": Benchmark("Megatron-Core GPT step on one GPU, Megatron's CUDA graphs "
                                           "(cuda_graph_impl='local'): step and host time", "Megatron's local BF16 "
                                           "spec, same model, graphed the same way", megatron_gpt_host_summary,
                                           lambda record: megatron_gpt_host_command(record) + " --cuda-graphs"),
    "param_gather": Benchmark("parameter all-gather in NVFP4, FSDP2 and Megatron-Core's distributed optimizer "
                              "(bytes counted: the same on any device)",
                              "the same gather in BF16 (FSDP2's; Megatron's), same model", param_gather_summary,
                              param_gather_command),
    "param_gather_cost": Benchmark("NVFP4 parameter gather of Megatron-Core's distributed optimizer: its cost in a "
                                   "training step (on one GPU every band is cast here: the most it costs a rank)",
                                   "the step with Megatron's own BF16 gather, same model",
                                   param_gather_cost_summary,
                                   lambda record: "torchrun --nproc-per-node 1 benchmarks/param_gather_cost.py"),
    "moe": Benchmark("mixture of experts: NVFP4 dispatch bytes (counted: the same on any device) and experts' time",
                     "BF16 dispatch of the same routed tokens; Megatron's BF16 experts", moe_summary, moe_command),
    "moe_convergence": Benchmark("MoE GPTModel convergence, NVFP4 spec with BF16 and NVFP4 dispatch (NVFP4 emulated "
                                 "on the CPU)", "Megatron's own MoE model (local spec, SequentialMLP experts, "
                                 "unquantized), same seed and data", moe_convergence_summary, moe_convergence_command),
}


# ---------------------------------------------------------------------------------------------------------
# The convergence section: one table per model and GPU kind, one row per recipe variant.

def gpt_convergence_setup(record: dict) -> str:
    config = record["config"]
    return (f"{config['num_layers']} layers, hidden {config['hidden_size']}, {config['num_heads']} heads, seq "
            f"{config['seq_length']}, a fixed Markov token stream; {record['steps']} steps of batch "
            f"{record['batch_size']}, lr {record['lr']:g}")


def gpt_convergence_command(record: dict) -> str:
    return shlex.join(["python", "-m", "tests_multigpu.gpt_convergence", "--steps", str(record["steps"]),
                       "--batch-size", str(record["batch_size"]), "--lr", f"{record['lr']:g}", "--bound",
                       f"{record['bound']:g}", "--variants", *[name for name in record["variants"] if name != "bf16"]])


def megatron_convergence_setup(record: dict) -> str:
    return (f"{record['layers']} layers, hidden {record['hidden']}, ffn {record['ffn']} (SwiGLU), {record['heads']} "
            f"heads, vocab {record['vocab']}, {record['data']} text (entropy rate {record['data_entropy_rate']:.3f} "
            f"nats/byte); {record['steps']} steps of {record['micro_batch']} x {record['seq']} tokens, seed "
            f"{record['seed']}, TP={record['tp']} on {record['gpus']} GPU{'s' if record['gpus'] > 1 else ''}; "
            f"megatron-core {record['megatron_core']}")


def megatron_convergence_command(record: dict) -> str:
    tp = [] if record["tp"] == record["gpus"] else ["--tp", str(record["tp"])]
    return shlex.join(["python", "-m", "tests_multigpu.megatron_convergence", "--nproc", str(record["gpus"]), *tp,
                       "--steps", str(record["steps"]), "--seq", str(record["seq"]), "--micro-batch",
                       str(record["micro_batch"]), "--seed", str(record["seed"]), "--variants",
                       *[name for name in record["variants"] if name != "bf16"]])


@dataclasses.dataclass(frozen=True)
class Convergence:
    """How one model's convergence JSON becomes a table."""

    model: str
    driver: str  # the module that writes the JSON
    setup: Callable[[dict], str]
    command: Callable[[dict], str]


CONVERGENCE = {  # table order
    "gpt_convergence": Convergence("GPT of `tests/helpers/gpt_model.py`", "tests_multigpu.gpt_convergence",
                                   gpt_convergence_setup, gpt_convergence_command),
    "megatron_convergence": Convergence("Megatron-Core GPTModel of `tests_multigpu/megatron_train.py`",
                                        "tests_multigpu.megatron_convergence", megatron_convergence_setup,
                                        megatron_convergence_command),
}
CONVERGENCE_INTRODUCTION = (
    "Training runs of one model under each recipe variant of `tests_multigpu/convergence_variants.py`, same initial "
    "weights and data: BF16, the default NVFP4 recipe, the RHT off, 4over6 on the weights, on the activations or on "
    "both ([docs/numerics.md](numerics.md) §12; on the activations with the RHT off), and row-scaled activations "
    "(§6, §6b) with their NVFP4 backward or their BF16 backward (`backward_mode` dequantized, §10). Final loss: the "
    "mean of the last 10 steps' training losses. Each gap is (final loss - the other's) / the other's, to BF16 and to "
    "the variant's baseline, the variant it differs from in one respect; negative means a lower loss. Seconds: the "
    "variant's whole run (for Megatron, process start to exit, with the training loop alone in parentheses).")


def signed_percent(value) -> str:
    return "" if value is None else f"{100 * value:+.2f}%"


def convergence_rows(record: dict) -> list[str]:
    rows = ["| variant | recipe fields | final loss | vs BF16 | baseline | vs baseline | seconds |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, variant in record["variants"].items():
        fields = ("BF16 linears" if variant["recipe"] is None else
                  ", ".join(f"`{field}={value}`" for field, value in variant["recipe"].items()) or "defaults")
        seconds = f"{variant['seconds']:.1f}" + (f" ({variant['train_seconds']:.1f})" if "train_seconds" in variant
                                                 else "")
        rows.append(f"| {name}: {variant['description']} | {fields} | {variant['final_loss']:.4f} | "
                    f"{signed_percent(variant['gap_vs_bf16'])} | {variant['baseline'] or ''} | "
                    f"{signed_percent(variant['gap_vs_baseline'])} | {seconds} |")
    return rows


def render_convergence(results: list) -> list[str]:
    """The convergence section: per model, one table per GPU kind, or a line saying no result is there."""
    out = ["## Convergence", "", CONVERGENCE_INTRODUCTION, ""]
    for benchmark, convergence in CONVERGENCE.items():
        runs = sorted((r for r in results if r.benchmark == benchmark), key=lambda r: r.kind)
        if not runs:
            out += [f"### {convergence.model}", "",
                    f"No result in `benchmarks/results/` yet: `python -m {convergence.driver}` on a GPU writes "
                    f"`{benchmark}_<gpu>.json` there.", ""]
        for result in runs:
            out += [f"### {convergence.model}, {result.kind}", "", convergence.setup(result.record) + ".", "",
                    f"Command: `{result.command}`; JSON {result.provenance.replace('<br>', ', ')}", "", *convergence_rows(result.record), ""]
    return out


# ---------------------------------------------------------------------------------------------------------
# A projection of the fused producers onto a B200, from the bytes benchmarks/fused_producers.py counts.

B200_HBM_BYTES_PER_S = 8e12        # HBM3e, per GPU, as NVIDIA publishes it for B200
B200_DENSE_FP4_FLOP_PER_S = 9e15   # dense NVFP4 tensor throughput, per GPU, as NVIDIA publishes it
B200_DENSE_BF16_FLOP_PER_S = 2.25e15
PROJECTION_HIDDEN, PROJECTION_FFN = 8192, 28672
BOTH_COPIES = "rowwise + RHT columnwise"


def layer_gemm_flop_per_token(hidden: int, ffn: int) -> float:
    """Forward + backward (3x the forward) FLOPs per token of one layer's linears: QKV (no grouped-query attention)
    and output projection, SwiGLU fc1 (hidden -> 2 ffn) and fc2."""
    forward = 2 * (3 * hidden * hidden + hidden * hidden + hidden * 2 * ffn + ffn * hidden)
    return 3 * forward


def both_copies_rows(record: dict, producer: str, width: int) -> list[dict]:
    """The record's rows of a producer at a width, with both copies."""
    return [r for r in record["results"]
            if r["producer"] == producer and r["width"] == width and r["copies"] == BOTH_COPIES]


def chain_bytes_per_token(record: dict, producer: str, width: int) -> dict | None:
    """{'fused', 'unfused'}: bytes per token of a producer's chain (both copies), from the record's byte counts."""
    out = {r["chain"]: r["bytes_moved"] / r["tokens"] for r in both_copies_rows(record, producer, width)}
    return out if {"fused", "unfused"} <= out.keys() else None


def chain_ns_per_token(record: dict, producer: str, width: int) -> dict | None:
    """{'fused', 'unfused'}: measured time per token of a producer's chain (both copies), the mean over token counts."""
    times = {}
    for r in both_copies_rows(record, producer, width):
        times.setdefault(r["chain"], []).append(1e6 * r["ms"] / r["tokens"])
    return {chain: sum(t) / len(t) for chain, t in times.items()} if {"fused", "unfused"} <= times.keys() else None


def layer_chains(record: dict, per_token) -> dict | None:
    """{'fused', 'unfused'}: per_token (chain_bytes_per_token or chain_ns_per_token) of the producer chains of one
    projection layer, the norms before QKV and before fc1 (RMSNorm, else LayerNorm) and SwiGLU before fc2."""
    norms = [per_token(record, norm, PROJECTION_HIDDEN) for norm in ("RMSNorm", "LayerNorm")]
    norm = next((n for n in norms if n is not None), None)
    swiglu = per_token(record, "swiglu", PROJECTION_FFN)
    if norm is None or swiglu is None:
        return None
    return {chain: 2 * norm[chain] + swiglu[chain] for chain in ("unfused", "fused")}


def measured_layer_chains(results: list[Result]) -> list[str]:
    """Rows of the projection's layer chains as measured on each GPU that ran benchmarks/fused_producers.py."""
    rows = []
    for result in results:
        if result.benchmark != "fused_producers":
            continue
        record = result.record
        ns, moved = layer_chains(record, chain_ns_per_token), layer_chains(record, chain_bytes_per_token)
        if ns is None or moved is None:
            continue
        copy_gbps = sum(r["copy_gbps"] for r in record["results"]) / len(record["results"])
        share = {chain: percent(moved[chain] / (ns[chain] * copy_gbps)) for chain in ns}
        rows.append(f"| {result.gpu} | {copy_gbps:.0f} GB/s | {ns['unfused']:.1f} ns | {ns['fused']:.1f} ns | "
                    f"{ns['unfused'] / ns['fused']:.2f}x | {share['unfused']}, {share['fused']} |")
    if not rows:
        return []
    return ["The same chains as measured on Hopper (`benchmarks/fused_producers.py`, the mean over its token counts); "
            "the shares of copy bandwidth count the bytes each chain moves, as above. The fused chain does more "
            "arithmetic per byte: it forms the producer's output in both of its passes, the unfused chain once (both "
            "transform the columnwise copy twice, for its amax and for its cast). Where a GPU has more bandwidth per "
            "multiprocessor, the fused chain falls further below copy speed than the unfused one, so the byte times "
            "above are lower bounds, more so for the fused chain. On Blackwell the casts round to FP4 with the GPU's "
            "conversion instruction, two values per instruction (docs/numerics.md §2.5), which Hopper emulates with "
            "about ten; that part of the arithmetic shrinks there.", "",
            "| GPU | copy bandwidth | unfused chain | fused chain | fused speedup | unfused, fused at share of copy |",
            "| --- | --- | --- | --- | --- | --- |", *rows, ""]


def b200_projection(results: list[Result]) -> list[str]:
    """The B200 projection section (empty without a fused-producer result holding the layer's widths)."""
    records = [r.record for r in results if r.benchmark == "fused_producers"]
    chains = next((c for c in (layer_chains(record, chain_bytes_per_token) for record in records) if c is not None), None)
    if chains is None:
        return []
    cast_ns = {chain: 1e9 * b / B200_HBM_BYTES_PER_S for chain, b in chains.items()}
    flop = layer_gemm_flop_per_token(PROJECTION_HIDDEN, PROJECTION_FFN)
    fp4_ns, bf16_ns = 1e9 * flop / B200_DENSE_FP4_FLOP_PER_S, 1e9 * flop / B200_DENSE_BF16_FLOP_PER_S
    return ["## B200 projection: fused producers", "",
            "A projection, not a measurement: no B200 ran it. One transformer layer of hidden "
            f"{PROJECTION_HIDDEN}, SwiGLU ffn {PROJECTION_FFN}, per token: the bytes that the producer chains in front "
            "of its NVFP4 linears move (the norm before QKV, the norm before fc1, SwiGLU before fc2; each with both "
            "copies, RHT on the columnwise one), as benchmarks/fused_producers.py counts them (its JSON's "
            "`bytes_moved`), at B200's published HBM3e bandwidth (8 TB/s), against the layer's linear GEMMs "
            "(forward + backward, QKV without grouped-query attention, attention's own products not counted) at "
            "B200's published dense tensor throughput (NVIDIA: 9 PFLOP/s FP4, 2.25 PFLOP/s BF16, per GPU). "
            "Full bandwidth and full tensor throughput are both upper bounds, so the times are lower bounds.", "",
            "| per token | bytes | time | vs NVFP4 GEMMs | vs BF16 GEMMs |", "| --- | --- | --- | --- | --- |",
            *[f"| producer chains, {chain} | {chains[chain] / 1024:.1f} KiB | {cast_ns[chain]:.1f} ns | "
              f"{percent(cast_ns[chain] / fp4_ns)} | {percent(cast_ns[chain] / bf16_ns)} |"
              for chain in ("unfused", "fused")],
            f"| linear GEMMs, NVFP4 | {flop / 1e9:.2f} GFLOP | {fp4_ns:.1f} ns | | |",
            f"| linear GEMMs, BF16 | {flop / 1e9:.2f} GFLOP | {bf16_ns:.1f} ns | | |", "",
            *measured_layer_chains(results)]


# ---------------------------------------------------------------------------------------------------------
# The rendered block of docs/slow_links.md: what overlap and NVFP4 gain on each link class.

BLOCK_BEGIN = "<!-- rendered by python benchmarks/render_performance.py from benchmarks/results/: do not edit -->"
BLOCK_END = "<!-- end of the rendered block -->"
LINK_CLASSES = ("nvlink", "slow", "two-node")  # benchmarks/torchrun_setup.py's --links, fastest first
PATH_NAMES = {"plain": "plain", "ring": "ring", "collectives": "split collectives"}


def links_label(record: dict) -> str:
    """The link class a result ran over, with the node count of a run over more than one torchrun node."""
    nodes = record.get("torchrun_nodes", 1)
    return record.get("links", "nvlink") + (f" ({nodes} nodes)" if nodes > 1 else "")


def link_class_order(result) -> tuple:
    return kind_order(result.kind) + (LINK_CLASSES.index(result.record.get("links", "nvlink")),)


def overlap_gain_rows(results: list) -> list[str]:
    """One row per overlap result and shape: the MLP pair forward + backward on each path."""
    rows = ["| GPUs | links | tokens, hidden, ffn | communication alone | pair without communication | plain pair | "
            "ring | split collectives | `auto` (the path it took) | JSON |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in sorted((r for r in results if r.benchmark == "overlap"), key=link_class_order):
        for shape in result.record["shapes"]:
            both = shape["fwd+bwd"]
            path = shape.get("auto_path", "ring" if shape["auto_pipelined"] else "plain")
            split = times(both["split_speedup"]) if "split_speedup" in both else "not measured"
            rows.append(f"| {result.kind} | {links_label(result.record)} | {shape['tokens']}, {shape['hidden']}, "
                        f"{shape['ffn']} | {both['comm']:.1f} ms | {both['no_comm']:.1f} ms | {both['plain']:.1f} ms | "
                        f"{times(both['speedup'])} | {split} | {times(both['auto_speedup'])} ({PATH_NAMES[path]}) | "
                        f"{result.provenance} |")
    return rows


def gpt_gain_rows(results: list) -> list[str]:
    """One row per Megatron GPT result: the NVFP4 spec against Megatron's BF16 linears over the same links."""
    rows = ["| GPUs | links | model | BF16 step | NVFP4 step | NVFP4 / BF16 tokens/s | on other overlap transports | "
            "JSON |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in sorted((r for r in results if r.benchmark == "megatron_gpt"), key=link_class_order):
        record = result.record
        args, nvfp4, bf16 = record["args"], record["results"]["nvfp4"], record["results"]["local_bf16"]
        others = [f"{transport} {times(record[f'{transport}_tokens_per_s_ratio'])}"
                  for transport in args.get("overlap_transports", ())]
        transport = f" ({nvfp4['overlap_transport']})" if "overlap_transport" in nvfp4 else ""
        rows.append(f"| {result.kind} | {links_label(record)} | {args['layers']} layers, hidden {args['hidden']}, "
                    f"seq {args['seq']}, micro-batch {args['micro_batch']} | {bf16['step_ms']:.1f} ms | "
                    f"{nvfp4['step_ms']:.1f} ms{transport} | {times(record['tokens_per_s_ratio'])} | "
                    f"{', '.join(others) or '-'} | {result.provenance} |")
    return rows


def slow_links_block(results: list) -> list[str]:
    """The lines between BLOCK_BEGIN and BLOCK_END in docs/slow_links.md."""
    return ["", "The MLP pair of `benchmarks/overlap.py` (column-parallel then row-parallel linear, sequence parallel, "
            "forward + backward): its communication alone, the pair without communication, the plain pair, and each "
            "path's speed against the plain pair of the same run (above 1.00x: faster). The commands are in "
            "[performance.md](performance.md).", "", *overlap_gain_rows(results), "",
            "The GPT model of `benchmarks/megatron_gpt.py` (overlap on, the NVFP4 spec against Megatron's BF16 linears "
            "on the same links; a step is forward + backward of one micro-batch):", "", *gpt_gain_rows(results), ""]


def with_rendered_block(page: str, block: list[str], name: str) -> str:
    """`page` with the lines between its BLOCK_BEGIN and BLOCK_END lines replaced by `block`."""
    lines = page.splitlines()
    if lines.count(BLOCK_BEGIN) != 1 or lines.count(BLOCK_END) != 1:
        raise ValueError(f"{name}: needs one line {BLOCK_BEGIN!r} and, after it, one line {BLOCK_END!r}")
    begin, end = lines.index(BLOCK_BEGIN), lines.index(BLOCK_END)
    if begin > end:
        raise ValueError(f"{name}: its line {BLOCK_END!r} comes before its line {BLOCK_BEGIN!r}")
    return "\n".join([*lines[:begin + 1], *block, *lines[end:]]) + "\n"


# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    path: pathlib.Path
    record: dict

    @property
    def benchmark(self) -> str:
        """The recorded benchmark name, else the longest known name that starts the file name."""
        known = [*BENCHMARKS, *CONVERGENCE]
        if self.record.get("benchmark") in known:
            return self.record["benchmark"]
        names = [name for name in known if self.path.stem.startswith(name + "_")]
        if not names:
            raise ValueError(f"{self.path.name}: its benchmark is none of {known}; give it a summary and a "
                             f"command in BENCHMARKS (or CONVERGENCE) of benchmarks/render_performance.py")
        return max(names, key=len)

    @property
    def gpu(self) -> str:
        return self.record.get("gpu") or self.record["device"]

    @property
    def gpu_count(self) -> int:
        for key in ("world_size", "gpus", "tp"):
            if key in self.record:
                return int(self.record[key])
        return 1

    @property
    def kind(self) -> str:
        return self.gpu if self.gpu_count == 1 else f"{self.gpu_count} x {self.gpu}"

    @property
    def settings(self) -> dict:
        """Environment settings recorded in front of the command line, by name."""
        settings = {}
        for word in shlex.split(self.record.get("command", "")):
            name, equals, value = word.partition("=")
            if not equals or not name.replace("_", "").isalnum():
                break
            settings[name] = value
        for value in max_connections_setting(self.record):
            settings.setdefault(*value.split("=", 1))
        return settings

    @property
    def variant(self) -> str:
        links = self.record.get("links", "nvlink")  # benchmarks/torchrun_setup.py's link class (--links)
        settings = [f"{name}={self.settings[name]}" for name in VARIANT_SETTINGS if name in self.settings]
        return ", ".join(([] if links == "nvlink" else [f"links {links}"]) + settings)

    @property
    def command(self) -> str:
        """The recorded command line without its output-location flags, else the rebuilt one."""
        if "command" not in self.record:
            return (BENCHMARKS.get(self.benchmark) or CONVERGENCE[self.benchmark]).command(self.record)
        words, shown, skip = shlex.split(self.record["command"]), [], False
        for word in words:
            if skip:
                skip = False
            elif word in OUTPUT_FLAGS:
                skip = True
            elif not word.startswith(tuple(flag + "=" for flag in OUTPUT_FLAGS)):
                shown.append(word)
        return shlex.join(shown)

    @property
    def provenance(self) -> str:
        date = str(self.record.get("date", "?"))[:10]
        commit = str(self.record.get("commit", "?")).split()[0][:7]
        torch_version = self.record.get("torch")
        details = ", ".join(filter(None, [date, f"commit {commit}", torch_version and f"torch {torch_version}"]))
        return f"[{self.path.name}](../benchmarks/results/{self.path.name})<br>{details}"


def load_results(directory: pathlib.Path = RESULTS) -> list[Result]:
    """Every JSON in `directory`, checked to hold one result per benchmark, GPU kind and variant."""
    results = [Result(path, json.loads(path.read_text())) for path in sorted(directory.glob("*.json"))]
    seen: dict = {}
    for result in results:
        key = (result.benchmark, result.kind, result.variant)
        if key in seen:
            raise ValueError(f"{seen[key].name} and {result.path.name}: two results for benchmark {key[0]!r} on "
                             f"{key[1]}{f' ({key[2]})' if key[2] else ''}; keep the latest one only")
        seen[key] = result.path
    return results


def cell(lines) -> str:
    return "<br>".join(line.replace("|", "\\|") for line in lines)


def kind_order(kind: str) -> tuple:
    """GPU kinds by GPU, then by count: "NVIDIA H100", "2 x NVIDIA H100", ..."""
    return kind.split(" x ")[-1], int(kind.split(" x ")[0]) if " x " in kind else 1


def render(results: list[Result]) -> str:
    """The text of docs/performance.md."""
    out = ["# Performance", "",
           "Generated by `python benchmarks/render_performance.py` from `benchmarks/results/*.json`; do not edit by "
           "hand. One table per GPU kind; each row is the latest run of one benchmark there, with the command that "
           "made it (run from the repository root; flags that only say where output goes are left out, and for a "
           "JSON that predates recorded command lines the command is rebuilt from its script and the arguments the "
           "JSON records). Every number is compared with a baseline measured in the same run; a speed ratio is "
           "baseline time / NVFP4 time, so above 1.00x NVFP4 is faster.", "",
           "Correctness is not measured here: the kernels match the reference byte for byte, and the GEMMs agree "
           "with it within the tolerances of [docs/numerics.md](numerics.md) §11.", ""]
    benchmarks = [result for result in results if result.benchmark in BENCHMARKS]
    kinds = sorted({result.kind for result in benchmarks}, key=kind_order)
    order = list(BENCHMARKS)
    for kind in kinds:
        rows = sorted((r for r in benchmarks if r.kind == kind), key=lambda r: (order.index(r.benchmark), r.variant))
        out += [f"## {kind}", "", "| benchmark | compared with | result | command | JSON |",
                "| --- | --- | --- | --- | --- |"]
        for result in rows:
            benchmark = BENCHMARKS[result.benchmark]
            title = benchmark.title + (f" ({result.variant})" if result.variant else "")
            out.append(f"| {title} | {benchmark.baseline} | {cell(benchmark.summary(result.record))} | "
                       f"`{result.command}` | {result.provenance} |")
        out.append("")
    out += b200_projection(results)
    out += render_convergence(results)
    return "\n".join(out).rstrip("\n") + "\n"


def rendered_pages(results: list[Result]) -> dict:
    """The text of each page this renders, by path: docs/performance.md whole, docs/slow_links.md's block."""
    return {OUTPUT: render(results),
            SLOW_LINKS: with_rendered_block(SLOW_LINKS.read_text(), slow_links_block(results), SLOW_LINKS.name)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the pages instead of writing them; exit 1 when one is out of date")
    args = parser.parse_args(argv)
    pages = rendered_pages(load_results())
    if args.check:
        stale = [path for path, text in pages.items() if path.read_text() != text]
        for path in stale:
            print(f"{path.relative_to(REPOSITORY)} is out of date: run python benchmarks/render_performance.py",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(REPOSITORY)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
