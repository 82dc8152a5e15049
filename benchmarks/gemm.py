"""NVFP4 emulated GEMM on Hopper vs cuBLAS BF16 torch.matmul, same shapes, one run.

Times (median, CUDA events via triton.testing.do_bench) the fused Triton GEMM and the
dequantize + cuBLAS path (cuBLASLt scaling and writing BF16, and the FP32-product + epilogue
path it replaced), against torch.matmul of BF16 operands; reports TFLOP/s, the ratios, and the
device memory each NVFP4 path allocates beyond its output. The dequantize path decodes A at every
call; B's BF16 copy is reused while B is unchanged (in a layer: once per weight copy and step),
so its one decode is not in the timed calls. Writes JSON (--out).

    python benchmarks/gemm.py [--sweep] [--out benchmarks/results/gemm_<gpu>.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import torch
import triton

from nvfp4_dist import reference
from nvfp4_dist.gemm import hopper
from nvfp4_dist.reference.quantize import decode_scale
from provenance import command_line, default_results_path, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)

SHAPES = [  # (M, N, K): y[M, N] = A[M, K] . B[N, K]^T
    (8192, 8192, 8192),
    (16384, 10240, 8192),
    (16384, 7168, 8192),
    (16384, 8192, 28672),
    (16384, 28672, 8192),
]
FUSED = hopper.FusedConfig
# Candidates timed by --sweep; the fastest fused and dequantize-path ones run on all SHAPES.
FUSED_CANDIDATES = {
    "fused_both_128x128x64": FUSED(),
    "fused_bfirst_128x256x64_s3": FUSED(block_n=256, num_stages=3, dequantize_b_first=True),
    "fused_bfirst_128x256x64_s4": FUSED(block_n=256, num_stages=4, dequantize_b_first=True),
    "fused_bfirst_128x128x64_s4": FUSED(dequantize_b_first=True),
    "fused_bfirst_128x256x128_s3": FUSED(block_n=256, block_k=128, num_stages=3, dequantize_b_first=True),
    "fused_bfirst_256x128x64_s3": FUSED(block_m=256, num_stages=3, dequantize_b_first=True),
}
DEQUANTIZE_CANDIDATES = {"dequantize_full": 1 << 30, "dequantize_auto": None, "dequantize_chunk512": 512, "dequantize_chunk1024": 1024,
                         "dequantize_chunk2048": 2048}


def quantized_operand(rows: int, k: int, scale: float, device) -> tuple:
    """(data, scale, amax) of random N(0, scale^2) data with a few larger blocks, quantized rowwise."""
    x = torch.randn(rows, k, device=device) * scale
    x[:, ::97] *= 8.0  # spread the block scales
    q = reference.quantize_tensor(x, rowwise=True, columnwise=False)
    return q.rowwise_data, q.rowwise_scale, q.amax_rowwise


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def extra_memory(fn, output_bytes: int) -> int:
    """Peak device bytes allocated during fn beyond its output."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return peak - base - output_bytes


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_fused(a, b, config):
    return lambda: hopper.gemm_fused(*a, *b, out_dtype=torch.bfloat16, config=config)


def run_dequantize(a, b, rows_per_chunk, via_fp32=False):
    return lambda: hopper.gemm_dequantize_matmul(*a, *b, out_dtype=torch.bfloat16, rows_per_chunk=rows_per_chunk,
                                                      via_fp32=via_fp32)


def measure_shape(m: int, n: int, k: int, fused_config, rows_per_chunk, device) -> dict:
    a = quantized_operand(m, k, 1.0, device)
    b = quantized_operand(n, k, 0.02, device)
    a_bf16 = hopper.dequantize_to_bf16(a[0], a[1])
    b_bf16 = hopper.dequantize_to_bf16(b[0], b[1])
    bf16_ms = time_ms(lambda: torch.matmul(a_bf16, b_bf16.t()))
    expected = torch.matmul(a_bf16, b_bf16.t()).float() * decode_scale(a[2]) * decode_scale(b[2])
    a_bf16 = b_bf16 = None  # free before the NVFP4 paths run
    row = dict(m=m, n=n, k=k, bf16_matmul_ms=bf16_ms, bf16_matmul_tflops=tflops(m, n, k, bf16_ms))
    output_bytes = m * n * 2
    for name, fn in (("fused", run_fused(a, b, fused_config)), ("dequantize_matmul", run_dequantize(a, b, rows_per_chunk)),
                     ("dequantize_fp32", run_dequantize(a, b, rows_per_chunk, via_fp32=True))):
        error = relative_error(fn(), expected)
        ms = time_ms(fn)
        row.update({f"{name}_ms": ms, f"{name}_tflops": tflops(m, n, k, ms), f"{name}_ratio": bf16_ms / ms,
                    f"{name}_extra_bytes": extra_memory(fn, output_bytes),
                    f"{name}_relative_error_vs_bf16_matmul": error})
    return row


def sweep(m: int, n: int, k: int, device) -> dict:
    """Every candidate, and the parts of the dequantize path, timed on one shape."""
    a = quantized_operand(m, k, 1.0, device)
    b = quantized_operand(n, k, 0.02, device)
    a_bf16 = hopper.dequantize_to_bf16(a[0], a[1])
    b_bf16 = hopper.dequantize_to_bf16(b[0], b[1])
    acc = torch.mm(a_bf16, b_bf16.t(), out_dtype=torch.float32)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    parts = {"bf16_matmul": lambda: torch.matmul(a_bf16, b_bf16.t()),
             "bf16_matmul_fp32_out": lambda: torch.mm(a_bf16, b_bf16.t(), out_dtype=torch.float32),
             "dequantize_a": lambda: hopper.dequantize_to_bf16(a[0], a[1]),
             "epilogue": lambda: hopper.apply_epilogue(acc, a[2], b[2], None, out, False)}
    results = {"parts_ms": {name: time_ms(fn) for name, fn in parts.items()}, "candidates": {}}
    print(results["parts_ms"], flush=True)
    a_bf16 = b_bf16 = acc = out = None  # free before the candidates run
    candidates = {name: run_fused(a, b, config) for name, config in FUSED_CANDIDATES.items()}
    candidates.update({name: run_dequantize(a, b, chunk) for name, chunk in DEQUANTIZE_CANDIDATES.items()})
    for name, fn in candidates.items():
        try:
            ms = time_ms(fn)
            results["candidates"][name] = dict(ms=ms, tflops=tflops(m, n, k, ms))
        except Exception as error:  # a configuration the compiler rejects: record it
            results["candidates"][name] = dict(error=repr(error)[:300])
        print(name, results["candidates"][name], flush=True)
    return results


def fastest(results: dict, names) -> str:
    timed = {name: results["candidates"][name]["ms"] for name in names if "ms" in results["candidates"][name]}
    return min(timed, key=timed.get)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default benchmarks/results/gemm_<gpu>.json")
    parser.add_argument("--sweep", action="store_true", help="time the fused-kernel configurations first")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    report = dict(benchmark="gemm", gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                  commit=git_commit(), command=command_line(),
                  torch=torch.__version__, triton=triton.__version__)
    config, rows_per_chunk = hopper.DEFAULT_FUSED_CONFIG, None  # None: hopper.CHUNK_BYTES
    if args.sweep:
        report["sweep_8192"] = sweep(8192, 8192, 8192, device)
        config = FUSED_CANDIDATES[fastest(report["sweep_8192"], FUSED_CANDIDATES)]
        rows_per_chunk = DEQUANTIZE_CANDIDATES[fastest(report["sweep_8192"], DEQUANTIZE_CANDIDATES)]
        torch.cuda.empty_cache()
    report["fused_config"] = dataclasses.asdict(config)
    report["dequantize_rows_per_chunk"] = rows_per_chunk
    report["shapes"] = []
    for m, n, k in SHAPES:
        report["shapes"].append(measure_shape(m, n, k, config, rows_per_chunk, device))
        torch.cuda.empty_cache()
        print(report["shapes"][-1], flush=True)
    out = args.out or str(default_results_path("gemm"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\n{report['gpu']}  fused config {report['fused_config']}, dequantize rows_per_chunk "
          f"{report['dequantize_rows_per_chunk']}")
    print("deq+mm: dequantize + cuBLASLt scaling and writing BF16; deq+fp32: cuBLAS FP32 product + epilogue kernel")
    print(f"{'M':>6} {'N':>6} {'K':>6} | {'BF16 TF/s':>9} | {'fused TF/s':>10} {'ratio':>6} | "
          f"{'deq+mm TF/s':>11} {'ratio':>6} | {'deq+fp32':>8} {'ratio':>6} | {'extra MiB fused/deq':>20}")
    for r in report["shapes"]:
        print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} | {r['bf16_matmul_tflops']:>9.1f} | "
              f"{r['fused_tflops']:>10.1f} {r['fused_ratio']:>6.3f} | {r['dequantize_matmul_tflops']:>11.1f} "
              f"{r['dequantize_matmul_ratio']:>6.3f} | {r['dequantize_fp32_tflops']:>8.1f} "
              f"{r['dequantize_fp32_ratio']:>6.3f} | {r['fused_extra_bytes'] / 2**20:>9.1f}/"
              f"{r['dequantize_matmul_extra_bytes'] / 2**20:<9.1f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
