"""Host time against GPU time of one linear layer's forward+backward: torch.nn.Linear (BF16) and nvfp4_dist.Linear,
eager and captured in a CUDA graph (torch.cuda.make_graphed_callables; nvfp4_dist.make_graphed_callables for the
NVFP4 layer), on one GPU.

Per shape (tokens, in, out) and layer: the host microseconds one forward+backward call takes to return, the GPU
microseconds its kernels take, and (eager) the CUDA launches it makes (kernels and memsets, counted by torch's
profiler). Both times come from one timed loop run while the GPU is held busy by a sleep kernel queued first: the
host never waits for the GPU, so the loop's wall time per call is pure host cost, and the kernels, all queued before
the sleep ends, run back to back between two events, so their time per call is pure GPU cost. A layer
whose host time exceeds its GPU time leaves the GPU idle in a real step. The NVFP4 layer runs the default recipe
(RHT and stochastic rounding on gradients, the weight's cached copy reused as in every micro-batch after the first).

The Blackwell projection puts the layer's host time on Blackwell's GEMM path (cuBLASLt FP4 through
torch._scaled_mm, whose scale swizzles and epilogue kernel differ from the Hopper emulation's launches) beside the GPU
time its work would take on a B200: its three GEMMs at 70% of the dense NVFP4 peak (9 PFLOP/s) and its quantize
passes' bytes (the input, the output gradient and their copies) at 80% of 8 TB/s. On a GPU without FP4 tensor cores
that host time is measured with the backend resolved to cuBLASLt and torch._scaled_mm replaced by the allocation of
its FP32 output (every other launch of the path runs; the GEMM's own launch is missing); on a Blackwell GPU it is the
eager row itself. The GPU time is an assumption, not a measurement: no B200 was available.

    python benchmarks/host_overhead.py [--shapes 1024,1024,1024 4096,2048,2048 8192,4096,4096]
                                       [--out benchmarks/results/host_overhead_<gpu>.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import time

import torch

import nvfp4_dist as nv
from provenance import command_line, default_results_path, git_commit  # noqa: E402 (benchmarks/ is on sys.path)

DEFAULT_SHAPES = ["1024,1024,1024", "4096,2048,2048", "8192,4096,4096"]
CALLS = 20        # forward+backward calls per timed loop (their ~30 launches each stay well inside the queue)
ROUNDS = 7        # timed loops per layer; the median is reported
B200_NVFP4_FLOPS = 9e15 * 0.7
B200_BYTES_PER_SECOND = 8e12 * 0.8


def timed_loop(step, sleep_cycles: int) -> tuple[float, float]:
    """(host us, GPU us) per call of `step` over CALLS calls queued behind a sleep kernel."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for _ in range(CALLS):
        step()
    host = (time.perf_counter() - began) / CALLS * 1e6
    end.record()
    end.synchronize()
    if not start.query():
        raise RuntimeError("the sleep kernel ended before the host finished queueing: raise sleep_cycles")
    return host, start.elapsed_time(end) / CALLS * 1e3


def measure(step, sleep_cycles: int) -> dict:
    for _ in range(3):
        step()
    rounds = [timed_loop(step, sleep_cycles) for _ in range(ROUNDS)]
    return {"host_us": statistics.median(r[0] for r in rounds), "gpu_us": statistics.median(r[1] for r in rounds)}


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync")


def launches_per_call(step) -> float:
    """CUDA runtime launches (kernels and memsets) per call of `step`, counted by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile
    calls = 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
    torch.cuda.synchronize()
    return sum(event.count for event in prof.key_averages() if event.key in LAUNCH_CALLS) / calls


def cublaslt_path(layer, x, dy, sleep_cycles: int) -> dict:
    """The layer's forward+backward on the cuBLASLt FP4 path with torch._scaled_mm stood in (module docstring): host
    us and launches per call on the layers' path (hot_path.gemm), and launches per call through nv.gemm (without the
    GEMMs' own launches, which the stand-in does not make)."""
    from nvfp4_dist import hot_path
    from nvfp4_dist.gemm import dispatch
    resolve, scaled_mm, takes = dispatch.resolve_backend, torch._scaled_mm, hot_path._scaled_mm_takes
    dispatch.resolve_backend = lambda backend, device: "cublaslt"
    torch._scaled_mm = lambda a, b, scale_a, scale_b, out_dtype: torch.empty(a.shape[0], b.shape[1], dtype=out_dtype,
                                                                             device=a.device)
    hot_path._gpu_gemm_path.cache_clear()
    step = layer_step(layer, x, dy)
    try:
        result = {"host_us": measure(step, sleep_cycles)["host_us"], "launches": launches_per_call(step)}
        hot_path._scaled_mm_takes = lambda *args: False
        result["launches through nv.gemm"] = launches_per_call(step)
        return result
    finally:
        dispatch.resolve_backend, torch._scaled_mm, hot_path._scaled_mm_takes = resolve, scaled_mm, takes
        hot_path._gpu_gemm_path.cache_clear()


def layer_step(layer, x, dy):
    def step():
        y = layer(x)
        y.backward(dy)
    return step


def b200_projection_us(tokens: int, k: int, n: int) -> float:
    """GPU time of one NVFP4 forward+backward on a B200 under the module docstring's assumptions."""
    gemm_flops = 3 * 2 * tokens * k * n
    bf16_bytes = 2 * (tokens * k + tokens * n)                       # read x and dy
    nvfp4_bytes = 2 * 0.5625 * (tokens * k + tokens * n)             # write both copies of each
    return (gemm_flops / B200_NVFP4_FLOPS + 2 * bf16_bytes / B200_BYTES_PER_SECOND
            + nvfp4_bytes / B200_BYTES_PER_SECOND) * 1e6


def run_shape(tokens: int, k: int, n: int, sleep_cycles: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    layers = {"nn.Linear": torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16),
              "nv.Linear": nv.Linear(k, n, device="cuda", dtype=torch.bfloat16, recipe=nv.NVFP4Recipe())}
    row = {"tokens": tokens, "in": k, "out": n}
    for name, layer in layers.items():
        row[f"{name} eager"] = measure(layer_step(layer, x, dy), sleep_cycles)
        row[f"{name} eager"]["launches"] = launches_per_call(layer_step(layer, x, dy))
        graph = nv.make_graphed_callables if isinstance(layer, nv.Linear) else torch.cuda.make_graphed_callables
        graphed = graph(layer, (x,))
        row[f"{name} graphed"] = measure(layer_step(graphed, x, dy), sleep_cycles)
    blackwell = torch.cuda.get_device_capability() >= (10, 0)
    if blackwell:
        row["nv.Linear eager cuBLASLt path host_us"] = row["nv.Linear eager"]["host_us"]
    else:
        fresh = nv.Linear(k, n, device="cuda", dtype=torch.bfloat16, recipe=nv.NVFP4Recipe())  # the other is graphed
        stood_in = cublaslt_path(fresh, x, dy, sleep_cycles)
        row["nv.Linear eager cuBLASLt path host_us"] = stood_in["host_us"]
        row["cuBLASLt path launches (GEMMs not counted)"] = stood_in["launches"]
        row["cuBLASLt path launches through nv.gemm (GEMMs not counted)"] = stood_in["launches through nv.gemm"]
    row["cuBLASLt path stood in"] = not blackwell
    nv.raise_pending_nonfinite()
    base = row["nn.Linear eager"]["host_us"]
    for mode in ("eager", "graphed"):
        row[f"nv/nn host ratio {mode}"] = row[f"nv.Linear {mode}"]["host_us"] / base
    row["nv.Linear eager host / GPU"] = row["nv.Linear eager"]["host_us"] / row["nv.Linear eager"]["gpu_us"]
    row["b200 projected gpu_us"] = b200_projection_us(tokens, k, n)
    print(f"{tokens}x{k}x{n}: " + ", ".join(
        f"{name} host {row[name]['host_us']:.0f} us / GPU {row[name]['gpu_us']:.0f} us"
        for name in row if isinstance(row[name], dict))
        + f"; nv/nn host eager {row['nv/nn host ratio eager']:.2f}x, graphed {row['nv/nn host ratio graphed']:.2f}x;"
        f" cuBLASLt path host {row['nv.Linear eager cuBLASLt path host_us']:.0f} us against B200 projected GPU "
        f"{row['b200 projected gpu_us']:.0f} us", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="tokens,in,out")
    parser.add_argument("--sleep-cycles", type=int, default=300_000_000,
                        help="length of the sleep kernel that keeps the GPU busy while the host queues (cycles)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/host_overhead_<gpu>.json")
    args = parser.parse_args()
    rows = [run_shape(*map(int, shape.split(",")), args.sleep_cycles) for shape in args.shapes]
    result = {"benchmark": "host_overhead", "gpu": torch.cuda.get_device_name(), "commit": git_commit(),
              "date": datetime.date.today().isoformat(), "command": command_line(), "torch": torch.__version__,
              "calls_per_loop": CALLS, "rounds": ROUNDS, "rows": rows}
    out = pathlib.Path(args.out) if args.out else default_results_path("host_overhead")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
