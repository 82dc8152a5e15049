"""Comm/GEMM overlap of the NVFP4 column+row parallel pair (SP on): overlapped vs plain, one run per TP size.

For each (tokens, hidden, ffn): column-parallel hidden -> ffn, then row-parallel ffn -> hidden, sequence parallel,
activations [tokens/TP, 1, hidden] per rank. Times for the forward and for forward+backward, each the median of
CUDA-event times over its steps, the slowest rank's. The rows below are timed in --rounds rounds, each running every
row in turn for --iters steps, so that drift over the run (clocks, the links' state) weighs on all rows alike:
  comm        the pair's communication alone, as the plain layers issue it (amax all-reduces, NVFP4 all-gathers,
              BF16 reduce-scatters) on tensors of the layer's sizes
  ring comm   the same transfers as the overlapped layers issue them (P2P rings with no GEMM in them)
  split comm  the same transfers as split collectives issue them (row pieces, no GEMM in them; the JSON's
              "split_pieces" are the pieces' row counts)
  GEMMs       the pair's NVFP4 GEMM kernels alone, on pre-quantized operands
  no-comm     the pair on a one-rank group with this rank's shard shapes and all tokens: every GEMM and
              quantization of a TP rank, no communication
  plain       the TP pair, overlap off
  overlapped  the TP pair with overlapped_comm (ring-pipelined all-gathers and reduce-scatters), every layer
  split       the TP pair with overlapped_comm on split collectives (transport="collectives"), every layer
  auto        the TP pair as recipe.overlap=True runs it (recipe.overlap_transport, NVFP4_OVERLAP_TRANSPORT):
              pipelined where one ring step's GEMM has at least recipe.overlap_min_chunk_gflops and the path is
              expected to win on the measured links (docs/slow_links.md), plain elsewhere ("auto_path": plain,
              ring or collectives; the JSON's "link_speed" is what the group measured)
  exposed     overlapped - no-comm (both definitions are in the JSON)
  *_host      host time per plain / overlapped step over HOST_STEPS steps queued behind a busy GPU: near the GPU
              time, the step is bound by Python and launches (cProfiles: the timeline's pair, and with
              --host-profiles every shape's overlapped fwd+bwd, into --out-dir)
It prints a table and writes JSON (--out, default benchmarks/results/overlap_<gpu>_tp<N>_<links>.json), plus a
timeline picture of one plain and one overlapped forward+backward step of the first shape (rank 0's CUDA kernels
from torch.profiler, lanes: comm (NCCL, peer kernels, copy-engine copies), GEMM, other) and the chrome traces, into
--out-dir (overlap_timeline_<gpu>_tp<N>_<links>.png). --links picks the link class (benchmarks/torchrun_setup.py).

    torchrun --standalone --nproc-per-node 4 benchmarks/overlap.py [--links nvlink|slow|two-node]
    tests_multigpu/two_node_local.sh benchmarks/overlap.py --links two-node   # two torchrun agents as two nodes
    python benchmarks/overlap.py --render-trace TRACE.json [TRACE2.json] --png out.png   # re-draw a timeline
NVFP4_HOPPER_GEMM=fused|dequantize picks the Hopper GEMM path.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from provenance import command_line, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)
from torchrun_setup import add_links_argument, gpu_label, init_nccl, links_record, result_path  # noqa: E402

SHAPES = [(16384, 8192, 28672), (8192, 4096, 14336)]  # (tokens, hidden, ffn)
GEMM_KERNEL_MARKERS = ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "cublas")
# Targets per link class: overlapped / max(no-comm, comm) at most OVERLAP_RATIO, and (at TP4) the fwd+bwd speedup
# over the plain pair at least SPEEDUP_TP4, for every shape (nvlink) or the first shape, the MLP pair (slow).
TARGETS = {"nvlink": dict(overlap_ratio=1.1, speedup_tp4=1.15, shapes="all"),
           "slow": dict(overlap_ratio=1.15, speedup_tp4=1.3, shapes="first")}
AUTO_SLACK = 1.05  # auto (the automatic choice) within 5 % of the fastest of plain, ring and split, any links
PATH_MARKS = {"plain": " ", "ring": "r", "collectives": "c"}
# Steps queued behind the GPU for the host time. CUDA's queue of pending launches is finite (about 1024), and ten
# big overlapped fwd+bwd steps (chunked GEMMs: many launches each) seem to fill it: with 10 steps the host waited
# ~1 s inside Triton's kernel launches (107 ms per step on 2 x H200 at fad9eeb), on the queue, not on its work.
HOST_STEPS = 3


def iteration_ms(step, iters: int, warmup: int) -> list:
    """CUDA-event times in ms of `iters` calls of step(), after `warmup` untimed ones (this rank's)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def interleaved_ms(variants: dict, iters: int, warmup: int, rounds: int) -> dict:
    """{name: ms} for variants {name: (setup, step)}: `rounds` rounds, each running setup() then `warmup` + `iters`
    steps of every variant in turn, so that drift (clocks, the links' state) spreads over all of them alike; each
    time is the median over its steps of every round, the slowest rank's."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (setup, step) in variants.items():
            setup()
            times[name] += iteration_ms(step, iters, warmup)
    medians = torch.tensor([statistics.median(t) for t in times.values()], device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(times, medians.tolist()))


def host_ms(step, iters: int = HOST_STEPS) -> float:
    """Host time per step() in ms while the GPU is kept busy (it never waits for the GPU), the slowest rank's.

    Close to the CUDA-event time, the step is bound by the host (Python, launches), not by the GPU.
    """
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles: every launch below queues behind it
    start = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = torch.tensor([(time.perf_counter() - start) * 1e3 / iters], device="cuda")
    torch.cuda.synchronize()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def host_profile(step, path: str, iters: int = HOST_STEPS) -> None:
    """cProfile of `iters` steps on rank 0, the 30 functions with the most own time, as text."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    profiler.enable()
    for _ in range(iters):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    if dist.get_rank() == 0:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        with open(path, "w") as f:
            f.write(f"cProfile of {iters} steps (rank 0), by own time\n{text.getvalue()}")


# ----------------------------------------------------------------------------------------------------------
# The measured steps.

class Pair:
    """A column+row parallel pair (SP on) over `group`, with its inputs and output gradient."""

    def __init__(self, tokens, hidden, ffn, group, recipe):
        from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear
        world_size = dist.get_world_size(group)
        torch.manual_seed(0)
        self.column = ColumnParallelLinear(hidden, ffn, sequence_parallel=True, tp_group=group, recipe=recipe,
                                           device="cuda")
        self.row = RowParallelLinear(ffn, hidden, sequence_parallel=True, tp_group=group, recipe=recipe,
                                     device="cuda")
        self.plain_comms = (self.column.comm, self.row.comm)
        self.x = torch.randn(tokens // world_size, 1, hidden, device="cuda").bfloat16().requires_grad_(True)
        self.dy = torch.randn(tokens // world_size, 1, hidden, device="cuda").bfloat16()

    def use_overlap(self, overlapped: bool, min_chunk_gflops: float = 0, measure_links: bool = False,
                    transport: str = "ring") -> None:
        """Plain comms, or their overlapped twins on `transport` pipelining steps of at least min_chunk_gflops (and
        with measure_links, only where a pipelined path is expected to win on the group's measured links)."""
        from nvfp4_dist.parallel.overlap import overlapped_comm
        column_comm, row_comm = self.plain_comms
        if overlapped:
            column_comm = overlapped_comm(column_comm, min_chunk_gflops, measure_links, transport)
            row_comm = overlapped_comm(row_comm, min_chunk_gflops, measure_links, transport)
        self.column.comm, self.row.comm = column_comm, row_comm

    def path(self) -> str:
        """The last forward's path (plain, ring or collectives): the column layer's (both layers have the same
        step size; the row layer's may differ only where the measured links make the choice)."""
        return getattr(self.column.comm, "path", "plain")

    def split_pieces(self) -> dict:
        """The row pieces of the pair's split collectives ("fwd gather", "fwd scatter", "bwd gather", "bwd scatter")
        as its layers size them (on the group's link speed where it is known), from one forward on that path."""
        self.use_overlap(True, transport="collectives")
        self.forward()
        column, row = self.column.comm, self.row.comm
        rows = self.x.shape[0]
        return {"fwd gather": column.split_pieces("all_gather", rows),
                "fwd scatter": row.split_pieces("reduce_scatter", rows),
                "bwd gather": row.split_pieces("all_gather", rows),
                "bwd scatter": column.split_pieces("reduce_scatter", rows)}

    def forward(self):
        return self.row(self.column(self.x)[0])[0]

    def forward_backward(self):
        for parameter in (self.x, self.column.weight, self.column.bias, self.row.weight, self.row.bias):
            parameter.grad = None
        self.forward().backward(self.dy)


def comm_steps(tokens, hidden, ffn, group, recipe, pieces):
    """(forward, forward+backward) callables issuing the pair's communication alone: plain, ring and split (in the
    row pieces of Pair.split_pieces())."""
    from nvfp4_dist import ops
    from nvfp4_dist.parallel import collectives
    from nvfp4_dist.parallel import overlap as O
    world_size = dist.get_world_size(group)
    local = torch.randn(tokens // world_size, hidden, device="cuda").bfloat16()
    xq = ops.quantize(local, "activation", recipe=recipe)
    dyq = ops.quantize(local, "gradient", recipe=recipe)
    partial = torch.randn(tokens, hidden, device="cuda").bfloat16()
    chunk = partial[:tokens // world_size]
    amaxes = [torch.ones(1, device="cuda") for _ in range(2)]

    def plain_forward():
        collectives.all_reduce_amax(amaxes, group)
        collectives.all_gather_nvfp4(xq.rowwise_only(), group)
        collectives.reduce_scatter_bf16(partial, group)

    def plain_backward():
        collectives.all_reduce_amax(amaxes, group)
        finish_x = collectives.all_gather_nvfp4(xq.columnwise_only(), group, async_op=True)[1]
        finish_dy = collectives.all_gather_nvfp4(dyq.columnwise_only(), group, async_op=True)[1]
        collectives.all_gather_nvfp4(dyq.rowwise_only(), group)
        collectives.reduce_scatter_bf16(partial, group)
        finish_x(), finish_dy()

    def ring_forward():
        collectives.all_reduce_amax(amaxes, group)
        O.ring_all_gather_consume(O.rowwise_pieces(xq), lambda tensors, source: None, group)
        O.ring_reduce_scatter_produce(lambda destination: chunk, group)

    def ring_backward():  # the row layer's ring, then the column input's re-gather it starts, the column's ring
        collectives.all_reduce_amax(amaxes, group)
        carry = O.ColumnwiseCarry(dyq.columnwise_only(), group)
        carry.start(world_size)
        O.ring_all_gather_consume(O.rowwise_pieces(dyq) + carry.pieces(), lambda tensors, source: None, group)
        finish_x = collectives.all_gather_nvfp4(xq.columnwise_only(), group, async_op=True)[1]
        O.ring_reduce_scatter_produce(lambda destination: chunk, group)
        finish_x()

    rows = tokens // world_size

    def split_gather(q, counts):
        finishes = O.start_piece_gathers(q, counts, group)
        return lambda: [finish() for finish in finishes]

    def scatter_pieces(counts):
        """Each piece's rows [c*rows + start, c*rows + stop) of every destination c, contiguous as the GEMMs write
        them, and where its sums land."""
        by_destination = partial.view(world_size, rows, hidden)
        return [(by_destination[:, start:stop].reshape(world_size * (stop - start), hidden), start, stop)
                for start, stop in O.piece_bounds(rows, counts)]
    forward_scatter, backward_scatter = scatter_pieces(pieces["fwd scatter"]), scatter_pieces(pieces["bwd scatter"])

    def split_scatter(scatter):
        out = torch.empty_like(chunk)
        finishes = [collectives.reduce_scatter_bf16(piece, group, async_op=True, out=out[start:stop])[1]
                    for piece, start, stop in scatter]
        return lambda: [finish() for finish in finishes]

    def split_forward():
        collectives.all_reduce_amax(amaxes, group)
        split_gather(xq, pieces["fwd gather"])()
        split_scatter(forward_scatter)()

    def split_backward():  # as ring_backward, on split collectives (the carried copy in one more collective)
        collectives.all_reduce_amax(amaxes, group)
        finish_dy = split_gather(dyq, pieces["bwd gather"])
        carried = collectives.all_gather_nvfp4(dyq.columnwise_only(), group, async_op=True, peer_memory=False)[1]
        finish_dy(), carried()
        finish_x = collectives.all_gather_nvfp4(xq.columnwise_only(), group, async_op=True)[1]
        split_scatter(backward_scatter)()
        finish_x()

    return {"plain": (plain_forward, lambda: (plain_forward(), plain_backward())),
            "ring": (ring_forward, lambda: (ring_forward(), ring_backward())),
            "split": (split_forward, lambda: (split_forward(), split_backward()))}


def gemm_steps(tokens, hidden, ffn_local, recipe):
    """(forward, forward+backward) callables running the pair's six NVFP4 GEMMs on pre-quantized operands."""
    from nvfp4_dist import ops
    from nvfp4_dist.gemm import gemm

    def operand(rows, cols, role):
        return ops.quantize(torch.randn(rows, cols, device="cuda").bfloat16(), role, recipe=recipe)
    x, w1, h = operand(tokens, hidden, "activation"), operand(ffn_local, hidden, "weight"), \
        operand(tokens, ffn_local, "activation")
    w2, dy, dh = operand(hidden, ffn_local, "weight"), operand(tokens, hidden, "gradient"), \
        operand(tokens, ffn_local, "gradient")
    bf16 = torch.bfloat16

    def forward():
        gemm(x, w1, out_dtype=bf16)                                                   # column fprop
        gemm(h, w2, out_dtype=bf16)                                                   # row fprop

    def backward():
        gemm(dy, w2, b_copy="columnwise", out_dtype=bf16)                             # row dgrad
        gemm(dy, h, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32)  # row wgrad
        gemm(dh, w1, b_copy="columnwise", out_dtype=bf16)                             # column dgrad
        gemm(dh, x, a_copy="columnwise", b_copy="columnwise", out_dtype=torch.float32)  # column wgrad

    return forward, lambda: (forward(), backward())


def measure_shape(tokens, hidden, ffn, group, self_group, recipe, iters, warmup, rounds, profile_dir=None) -> dict:
    """Every time of one shape; profile_dir: also the cProfile of the overlapped fwd+bwd host-time steps."""
    world_size = dist.get_world_size(group)
    result = dict(tokens=tokens, hidden=hidden, ffn=ffn, tp=world_size)
    pair = Pair(tokens, hidden, ffn, group, recipe)
    result["split_pieces"] = pair.split_pieces()
    comm = comm_steps(tokens, hidden, ffn, group, recipe, result["split_pieces"])
    gemms = gemm_steps(tokens, hidden, ffn // world_size, recipe)
    no_comm = Pair(tokens, hidden, ffn // world_size, self_group, recipe)
    pair_paths = {"plain": (False, 0, False, "ring"), "overlapped": (True, 0, False, "ring"),
                  "split": (True, 0, False, "collectives"),  # auto last: its path is the pair's path below
                  "auto": (True, recipe.overlap_min_chunk_gflops, recipe.overlap_measure_links,
                           recipe.overlap_transport)}
    for phase, index in (("fwd", 0), ("fwd+bwd", 1)):
        pair_step = pair.forward if index == 0 else pair.forward_backward
        variants = {"comm": (lambda: None, comm["plain"][index]), "ring_comm": (lambda: None, comm["ring"][index]),
                    "split_comm": (lambda: None, comm["split"][index]), "gemms": (lambda: None, gemms[index]),
                    "no_comm": (lambda: None, no_comm.forward if index == 0 else no_comm.forward_backward)}
        variants.update({name: (functools.partial(pair.use_overlap, *options), pair_step)
                         for name, options in pair_paths.items()})
        times = interleaved_ms(variants, iters, warmup, rounds)
        for name, options in pair_paths.items():
            pair.use_overlap(*options)
            times[f"{name}_host"] = host_ms(pair_step)
            if profile_dir and name == "overlapped" and index == 1:
                host_profile(pair_step, os.path.join(profile_dir, f"overlap_host_profile_{tokens}x{hidden}x{ffn}.txt"))
        result["auto_path"] = pair.path()
        result["auto_pipelined"] = result["auto_path"] != "plain"
        times.update(exposed_comm=times["overlapped"] - times["no_comm"],
                     exposed_comm_vs_gemms=times["overlapped"] - times["gemms"],
                     speedup=times["plain"] / times["overlapped"],
                     split_speedup=times["plain"] / times["split"],
                     auto_speedup=times["plain"] / times["auto"],
                     auto_over_best=times["auto"] / min(times["plain"], times["overlapped"], times["split"]),
                     overlapped_over_max_no_comm_comm=times["overlapped"] / max(times["no_comm"], times["comm"]),
                     split_over_max_no_comm_comm=times["split"] / max(times["no_comm"], times["comm"]),
                     overlapped_over_max_gemms_comm=times["overlapped"] / max(times["gemms"], times["comm"]))
        result[phase] = times
    del no_comm, pair
    torch.cuda.empty_cache()
    return result


# ----------------------------------------------------------------------------------------------------------
# Timeline picture.

COMM_LANE = "comm: NCCL, peer\nkernels, copies"


def kernel_lane(name: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered or "peer_" in lowered or lowered.startswith("memcpy"):
        return COMM_LANE
    if any(marker in lowered for marker in GEMM_KERNEL_MARKERS):
        return "GEMM"
    return "other kernels"


def trace_kernels(trace_path: str) -> list:
    """[(lane, start_ms, duration_ms, stream)] of the CUDA kernels and copies (copy engines: the symmetric-memory
    transport) in a chrome trace, from its first one."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]
    if not kernels:
        raise ValueError(f"trace_path={trace_path!r}: no CUDA kernel events in the trace")
    first = min(e["ts"] for e in kernels)
    return [(kernel_lane(e["name"]), (e["ts"] - first) / 1e3, e["dur"] / 1e3, e.get("args", {}).get("stream"))
            for e in kernels]


def render_timeline(trace_paths: list, titles: list, png_path: str) -> None:
    """One panel per trace, lanes comm / GEMM / other, time in ms on a shared axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lanes = [COMM_LANE, "GEMM", "other kernels"]
    colors = {COMM_LANE: "tab:red", "GEMM": "tab:blue", "other kernels": "tab:gray"}
    panels = [trace_kernels(path) for path in trace_paths]
    end = max(start + duration for kernels in panels for _, start, duration, _ in kernels)
    figure, axes = plt.subplots(len(panels), 1, figsize=(14, 1.6 + 1.3 * len(panels)), squeeze=False, sharex=True)
    for axis, kernels, title in zip(axes[:, 0], panels, titles):
        for row, lane in enumerate(lanes):
            bars = [(start, duration) for name, start, duration, _ in kernels if name == lane]
            axis.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors[lane])
        busy = {lane: sum(d for name, _, d, _ in kernels if name == lane) for lane in lanes}
        span = max(start + duration for _, start, duration, _ in kernels)
        axis.set_yticks(range(len(lanes)), [f"{lane}\n{busy[lane]:.1f} ms busy" for lane in lanes])
        axis.set_ylim(len(lanes) - 0.5, -0.5)
        axis.set_title(f"{title}: {span:.1f} ms", fontsize=10, loc="left")
        axis.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlim(0, end)
    axes[-1, 0].set_xlabel("time since the step's first kernel (ms)")
    figure.tight_layout()
    figure.savefig(png_path, dpi=130)
    plt.close(figure)


def profile_step(step, trace_path: str, warmup: int) -> None:
    """Run step() under torch.profiler (every rank, in lockstep); rank 0 writes the chrome trace."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        step()
    # A process's first profiler session spends hundreds of ms starting CUPTI, unevenly across ranks; the
    # first collective inside it then waits for the slowest rank (seen as a 329 ms NCCL kernel on 4 H200s).
    with profile(activities=[ProfilerActivity.CUDA]):
        step()
        torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        profiler.export_chrome_trace(trace_path)


def timeline(tokens, hidden, ffn, group, recipe, out_dir, label, warmup) -> dict:
    """The kernel timeline picture and chrome traces of one plain, one ring-overlapped and one split-collectives
    step, and their cProfiles."""
    pair = Pair(tokens, hidden, ffn, group, recipe)
    paths = {}
    for name, overlapped, transport in (("plain", False, "ring"), ("overlapped", True, "ring"),
                                        ("split", True, "collectives")):
        pair.use_overlap(overlapped, transport=transport)
        paths[name] = os.path.join(out_dir, f"overlap_trace_{label}_{name}.json")
        profile_step(pair.forward_backward, paths[name], warmup)
        host_profile(pair.forward_backward, os.path.join(out_dir, f"overlap_host_profile_{label}_{name}.txt"))
    png = os.path.join(out_dir, f"overlap_timeline_{label}.png")
    if dist.get_rank() == 0:
        shape = f"tokens={tokens} hidden={hidden} ffn={ffn} TP={dist.get_world_size(group)}"
        render_timeline([paths["plain"], paths["overlapped"], paths["split"]],
                        [f"plain fwd+bwd, {shape}", f"overlapped on the ring fwd+bwd, {shape}",
                         f"overlapped on split collectives fwd+bwd, {shape}"], png)
    del pair
    torch.cuda.empty_cache()
    return {"png": png, "traces": paths}


# ----------------------------------------------------------------------------------------------------------

def print_table(report: dict) -> None:
    header = (f"{'tokens,hidden,ffn':>18} {'TP':>2} {'phase':>7} | {'comm':>7} {'ring':>7} {'split':>7} {'GEMMs':>7} "
              f"{'no-comm':>7} | {'plain':>7} {'overlap':>7} {'exposed':>7} {'speedup':>7} {'ovl/max':>7} | "
              f"{'host p':>7} {'host o':>7} | {'split':>7} {'speedup':>7} {'spl/max':>7} | {'auto':>7} {'speedup':>7}")
    print(f"\n{report['gpu']}, TP={report['tp']}, links {report['links']} ({report['torchrun_nodes']} torchrun "
          f"node(s)), Hopper GEMM path {report['hopper_gemm']}; times in ms (median, "
          f"slowest rank); exposed = overlapped - no-comm; ovl/max = overlapped / max(no-comm, comm); "
          f"host p/o: host ms per plain/overlapped step; split: on split collectives; auto: as recipe.overlap runs it "
          f"(transport {report.get('overlap_transport', 'ring')}: pipelined where a ring step has >= "
          f"{report['overlap_min_chunk_gflops']} GFLOP and the path wins on the measured links, else plain; "
          f"r = went round the ring, c = on split collectives)")
    if report.get("link_speed"):
        print("measured link speed (ms per MB of a ring step, ms per GFLOP): " + ", ".join(
            f"{name} {value:.4g}" for name, value in report["link_speed"].items()))
    print(header)
    print("-" * len(header))
    for r in report["shapes"]:
        for phase in ("fwd", "fwd+bwd"):
            t = r[phase]
            print(f"{r['tokens']:>6},{r['hidden']:>5},{r['ffn']:>5} {r['tp']:>2} {phase:>7} | {t['comm']:7.2f} "
                  f"{t['ring_comm']:7.2f} {t['split_comm']:7.2f} {t['gemms']:7.2f} {t['no_comm']:7.2f} | {t['plain']:7.2f} "
                  f"{t['overlapped']:7.2f} {t['exposed_comm']:7.2f} {t['speedup']:7.3f} "
                  f"{t['overlapped_over_max_no_comm_comm']:7.3f} | {t['plain_host']:7.2f} {t['overlapped_host']:7.2f} | "
                  f"{t['split']:7.2f} {t['split_speedup']:7.3f} {t['split_over_max_no_comm_comm']:7.3f} | "
                  f"{t['auto']:6.2f}{PATH_MARKS[r['auto_path']]} {t['auto_speedup']:7.3f}")
    for name, met in report["targets"].items():
        print(f"target {name}: {'met' if met else 'NOT met'}")


def targets(report: dict, links: str, world_size: int) -> dict:
    """{target: met} for this link class (TARGETS) and the automatic choice (AUTO_SLACK)."""
    met = {}
    goal = TARGETS.get(links)
    if goal:
        shapes = report["shapes"] if goal["shapes"] == "all" else report["shapes"][:1]
        which = "every shape" if goal["shapes"] == "all" else "the first shape"
        phases = ("fwd", "fwd+bwd") if goal["shapes"] == "all" else ("fwd+bwd",)
        for path, prefix in (("ring", ""), ("split collectives", "split_")):
            met[f"overlapped on the {path} <= {goal['overlap_ratio']} x max(no-comm, comm), {which}"] = all(
                r[phase][f"{prefix or 'overlapped_'}over_max_no_comm_comm"] <= goal["overlap_ratio"]
                for r in shapes for phase in phases)
            if world_size == 4:
                met[f"fwd+bwd speedup on the {path} >= {goal['speedup_tp4']} at TP=4, {which}"] = all(
                    r["fwd+bwd"][f"{prefix}speedup"] >= goal["speedup_tp4"] for r in shapes)
    met[f"auto <= {AUTO_SLACK} x min(plain, ring, split), every shape and phase"] = all(
        r[phase]["auto_over_best"] <= AUTO_SLACK for r in report["shapes"] for phase in ("fwd", "fwd+bwd"))
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON path (default benchmarks/results/overlap_<gpu>_tp<N>_<links>.json)")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"),
                        help="folder for the timeline PNG and chrome traces")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds that each time every variant in turn for --iters steps (default: %(default)s)")
    parser.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES),
                        help="tokens,hidden,ffn;... (default: %(default)s)")
    parser.add_argument("--no-timeline", action="store_true", help="skip the profiled timeline step")
    parser.add_argument("--host-profiles", action="store_true",
                        help="cProfile the overlapped fwd+bwd host-time steps of each shape into --out-dir")
    parser.add_argument("--render-trace", nargs="+", metavar="TRACE", help="only draw TRACE.json file(s) to --png")
    parser.add_argument("--overlap-transport", choices=("auto", "ring", "collectives"), default="auto",
                        help="recipe.overlap_transport of the auto rows (default: %(default)s)")
    add_links_argument(parser)
    parser.add_argument("--png", help="picture path for --render-trace")
    args = parser.parse_args()
    if args.render_trace:
        if not args.png:
            parser.error("--render-trace needs --png")
        render_timeline(args.render_trace, [os.path.basename(p) for p in args.render_trace], args.png)
        print(f"wrote {args.png}")
        return
    for name in ("iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be at least 1")
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    os.makedirs(args.out_dir, exist_ok=True)

    import nvfp4_dist as nv
    from nvfp4_dist.gemm.gpu_backends import hopper_path
    from nvfp4_dist.parallel.overlap import group_link_speed
    rank, world_size = init_nccl(args.links)
    for tokens, hidden, ffn in shapes:
        if tokens % (16 * world_size) or ffn % (16 * world_size) or hidden % 16:
            raise ValueError(f"--shapes {tokens},{hidden},{ffn}: tokens and ffn must be multiples of 16 * TP "
                             f"({16 * world_size}) and hidden of 16")
    group = dist.group.WORLD
    self_group = [dist.new_group([r]) for r in range(world_size)][rank]
    recipe = nv.NVFP4Recipe(overlap_transport=args.overlap_transport)
    label = f"{gpu_label()}_tp{world_size}_{args.links}"
    report = dict(benchmark="overlap", gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                  commit=git_commit(), command=command_line(),
                  torch=torch.__version__, tp=world_size, **links_record(args.links), recipe=str(recipe),
                  hopper_gemm=hopper_path(), overlap_min_chunk_gflops=recipe.overlap_min_chunk_gflops,
                  overlap_transport=recipe.overlap_transport,
                  cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)"),
                  timing=dict(iters=args.iters, warmup=args.warmup, rounds=args.rounds), shapes=[])
    if recipe.overlap_measure_links:  # what the auto rows weigh (measured here, outside every timed step)
        device = torch.device("cuda", torch.cuda.current_device())
        report["link_speed"] = dataclasses.asdict(group_link_speed(group, device))
    for tokens, hidden, ffn in shapes:
        report["shapes"].append(measure_shape(tokens, hidden, ffn, group, self_group, recipe, args.iters,
                                              args.warmup, args.rounds, args.out_dir if args.host_profiles else None))
        if rank == 0:
            print(json.dumps(report["shapes"][-1]), flush=True)
    report["targets"] = targets(report, args.links, world_size)
    if not args.no_timeline:
        report["timeline"] = timeline(*shapes[0], group, recipe, args.out_dir, label, args.warmup)
    if rank == 0:
        out = args.out or result_path(f"overlap_{gpu_label()}_tp{world_size}", args.links)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
        print_table(report)
        print(f"wrote {out}" + (f" and {report['timeline']['png']}" if "timeline" in report else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
