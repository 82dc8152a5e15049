"""Effective bandwidth of the NVFP4 quantization kernels against a device-to-device copy (same run).

Bytes counted are those that must move: the input read once, every output written once. Each
kernel's GB/s is compared with torch's copy of a BF16 tensor of the same element count (bytes
read + written), timed first on its own. The kernels are timed in rounds: each round times every
kernel once, in turn, and each gets the median over the rounds. "cast" times the cast kernel alone
(amax given, as after an amax all-reduce); "amax+cast" adds the amax pass before it. With three or more element counts, each kernel's times
are also fitted as a per-launch fixed cost plus a cost per element (least squares), which tells a
kernel slowed at the grid's start and end (its first wave, its last CTAs) from one slow throughout.

Each shape starts after --settle-seconds of idle: on an H200 the card's power average climbs through a
run of back-to-back casts until the power cap throttles the SM clock (1290-1575 MHz seen during the last
shape, against 1980 MHz idle), which slowed the issue-bound casts of whichever shape came last by up to
a fifth while the memory-bound copy kept its speed. nvidia-smi's SM clock, power draw and throttle
reasons, sampled during each shape where nvidia-smi exists, go into the JSON (their range).

    python benchmarks/quantize.py [--sizes 4096 8192 16384] [--shapes 8192x16384 ...]
                                  [--settle-seconds 2] [--out benchmarks/results/quantize_<gpu>.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shutil
import subprocess
import time

import torch

from nvfp4_dist import kernels
from nvfp4_dist._extension import load_extension
from nvfp4_dist.reference.fourover6 import FourOverSix
from provenance import command_line, default_results_path, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)

BLOCK = 16


def time_interleaved(fns, repeats: int = 20, rounds: int = 5) -> list[float]:
    """For each fn, the median over rounds of the mean time of `repeats` back-to-back calls, by CUDA events.
    Each round times every fn once, in turn, so that slow drifts of the clocks (power capping, heat) reach
    all of them alike rather than the ones timed last."""
    for fn in fns:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / repeats)
    return [sorted(times)[len(times) // 2] for times in samples]


def quantized_bytes(rows: int, cols: int, copies: int) -> int:
    """Packed codes plus E4M3 scales of `copies` copies."""
    return copies * (rows * cols // 2 + rows * cols // BLOCK)


def run_shape(rows: int, cols: int) -> list[dict]:
    extension = load_extension()
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    x32 = torch.randn(rows, cols, device="cuda", dtype=torch.float32) if rows * cols <= 8192 * 8192 else None
    copy_target = torch.empty_like(x)

    amax = kernels.compute_amaxes(x)[0]
    _, amax_rht = kernels.compute_amaxes(x, rht=True)
    row_amax, column_amax = kernels.compute_amaxes(x, row_scaled=True)
    _, column_amax_rht = kernels.compute_amaxes(x, rowwise=False, row_scaled=True, rht=True)
    row_data = torch.empty(rows, cols // 2, dtype=torch.uint8, device="cuda")
    row_scale = torch.empty(rows, cols // BLOCK, dtype=torch.uint8, device="cuda")
    col_data = torch.empty(cols, rows // 2, dtype=torch.uint8, device="cuda")
    col_scale = torch.empty(cols, rows // BLOCK, dtype=torch.uint8, device="cuda")
    scratch = torch.empty(1, dtype=torch.float32, device="cuda")
    scratch2 = torch.empty(1, dtype=torch.float32, device="cuda")

    def cast(inp, *, rowwise=True, columnwise=True, block_2d=False, rht=False, sr=False, row_scaled=False,
             amax_col=None, four_over_six=None):
        a_row = row_amax if row_scaled else amax
        a_col = amax_col if amax_col is not None else amax
        bound = four_over_six.e4m3_bound if four_over_six is not None else 448
        mse = four_over_six is not None and four_over_six.err_mode == "MSE"
        fast = four_over_six is not None and four_over_six.fast_math
        return lambda: extension.quantize(
            inp, a_row if rowwise else None, a_col if columnwise else None, row_data if rowwise else None,
            row_scale if rowwise else None, col_data if columnwise else None, col_scale if columnwise else None,
            row_scaled, block_2d, rht, True, sr, 12345, None, 0, four_over_six is not None, bound, mse, fast, stream)

    def amax_pass(inp):
        return lambda: extension.amax_tensor(inp, scratch, stream)

    def rht_amax_pass(inp):
        return lambda: extension.amax_rht(inp, True, scratch2, scratch, stream)

    column_amax_scratch = torch.empty(cols, dtype=torch.float32, device="cuda")

    def column_amax_pass(inp, rht):
        return lambda: extension.amax_columns(inp, rht, True, column_amax_scratch, stream)

    def chain(*fns):
        def run():
            for fn in fns:
                fn()
        return run

    q = kernels.quantize_tensor(x)
    dequant_out = torch.empty_like(x)
    both, one = quantized_bytes(rows, cols, 2), quantized_bytes(rows, cols, 1)
    in_bytes = x.numel() * x.element_size()
    cases = [
        ("amax (per tensor)", amax_pass(x), in_bytes),
        ("amax (RHT columnwise + plain)", rht_amax_pass(x), in_bytes),
        ("1D cast rowwise+columnwise", cast(x), in_bytes + both),
        ("1D amax+cast rowwise+columnwise", chain(amax_pass(x), cast(x)), in_bytes + both),
        ("1D cast rowwise only", cast(x, columnwise=False), in_bytes + one),
        ("1D cast columnwise only", cast(x, rowwise=False), in_bytes + one),
        ("1D cast row-scaled rowwise", cast(x, columnwise=False, row_scaled=True), in_bytes + one),
        ("2D cast (16x16) both copies", cast(x, block_2d=True), in_bytes + both),
        ("1D SR cast rowwise+columnwise", cast(x, sr=True), in_bytes + both),
        ("RHT cast (rowwise + RHT columnwise)", cast(x, rht=True, amax_col=amax_rht), in_bytes + both),
        ("RHT amax+cast", chain(rht_amax_pass(x), cast(x, rht=True, amax_col=amax_rht)), in_bytes + both),
        ("RHT SR cast", cast(x, rht=True, sr=True, amax_col=amax_rht), in_bytes + both),
        ("4over6 cast 1D MAE exact, both copies", cast(x, four_over_six=FourOverSix("MAE", 256)), in_bytes + both),
        ("4over6 cast 1D MSE exact, both copies", cast(x, four_over_six=FourOverSix("MSE", 256)), in_bytes + both),
        ("4over6 cast 1D MAE fast-math, both copies", cast(x, four_over_six=FourOverSix("MAE", 256, True)),
         in_bytes + both),
        ("4over6 cast 2D MAE exact, both copies", cast(x, block_2d=True, four_over_six=FourOverSix("MAE", 256)),
         in_bytes + both),
        ("4over6 cast 1D MAE exact, rowwise only", cast(x, columnwise=False, four_over_six=FourOverSix("MAE", 256)),
         in_bytes + one),
        ("amax per column (row-scaled columnwise)", column_amax_pass(x, False), in_bytes),
        ("amax per column after the RHT", column_amax_pass(x, True), in_bytes),
        ("row-scaled cast, both copies", cast(x, row_scaled=True, amax_col=column_amax), in_bytes + both),
        ("row-scaled RHT cast, both copies", cast(x, row_scaled=True, rht=True, amax_col=column_amax_rht),
         in_bytes + both),
        ("dequantize rowwise -> bf16", lambda: extension.dequantize_rowwise(
            q.rowwise_data, q.rowwise_scale.view(torch.uint8), q.amax_rowwise, False, 448, dequant_out, stream),
         one + in_bytes),
    ]
    if x32 is not None:
        cases.append(("1D cast rowwise+columnwise, FP32 input", cast(x32), x32.numel() * 4 + both))
        cases.append(("1D SR cast rowwise+columnwise, FP32 input", cast(x32, sr=True), x32.numel() * 4 + both))
    shape = dict(size=rows, rows=rows, cols=cols) if rows == cols else dict(rows=rows, cols=cols)
    # the copy alone first, as the kernels' baseline: interleaved with them it came out 2.4% slower on
    # H100 at 8192^2 (0.0942 against 0.0920 ms), which would flatter every kernel
    (copy_ms,) = time_interleaved([lambda: copy_target.copy_(x)])
    case_ms = time_interleaved([fn for _, fn, _ in cases])
    copy_gbps = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    results = [dict(kernel="copy (bf16, read+write)", **shape, ms=copy_ms, gbps=copy_gbps, fraction_of_copy=1.0)]
    for (name, _, nbytes), ms in zip(cases, case_ms):
        gbps = nbytes / ms / 1e6
        results.append(dict(kernel=name, **shape, ms=ms, gbps=gbps, fraction_of_copy=gbps / copy_gbps))
    return results


def fixed_and_per_element_cost(results: list[dict]) -> list[dict]:
    """Per kernel measured at 3+ element counts: time = fixed_us + us_per_million_elements * elements / 1e6."""
    fits = []
    for kernel in dict.fromkeys(r["kernel"] for r in results):
        points = [(r["rows"] * r["cols"] / 1e6, r["ms"] * 1e3) for r in results if r["kernel"] == kernel]
        if len({m for m, _ in points}) < 3:
            continue
        n = len(points)
        mean_m, mean_t = sum(m for m, _ in points) / n, sum(t for _, t in points) / n
        slope = (sum((m - mean_m) * (t - mean_t) for m, t in points) / sum((m - mean_m) ** 2 for m, _ in points))
        fits.append(dict(kernel=kernel, fixed_us=mean_t - slope * mean_m, us_per_million_elements=slope, shapes=n))
    return fits


# (stochastic-rounding kernel, its round-to-nearest twin): the "SR within 10%" compares their times
SR_PAIRS = (("1D SR cast rowwise+columnwise", "1D cast rowwise+columnwise"),
            ("RHT SR cast", "RHT cast (rowwise + RHT columnwise)"),
            ("1D SR cast rowwise+columnwise, FP32 input", "1D cast rowwise+columnwise, FP32 input"))


def stochastic_rounding_ratios(results: list[dict]) -> list[dict]:
    """SR time / plain time for each SR kernel and shape measured (same run)."""
    ms = {(r["kernel"], r["rows"], r["cols"]): r["ms"] for r in results}
    ratios = []
    for sr, plain in SR_PAIRS:
        for (kernel, rows, cols), sr_ms in ms.items():
            if kernel == sr and (plain, rows, cols) in ms:
                ratios.append(dict(kernel=sr, baseline=plain, rows=rows, cols=cols,
                                   time_ratio=sr_ms / ms[(plain, rows, cols)]))
    return ratios


class CardSampler:
    """nvidia-smi sampling GPU 0's SM clock, power draw and throttle reasons every 100 ms while in the
    `with` block; summary() gives their range (None without nvidia-smi)."""

    QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"

    def __enter__(self):
        self.process = None
        if shutil.which("nvidia-smi") is not None:
            self.process = subprocess.Popen(
                ["nvidia-smi", "-i", "0", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self.lines = []
        if self.process is not None:
            self.process.terminate()
            self.lines = self.process.communicate(timeout=10)[0].splitlines()

    def summary(self) -> dict | None:
        samples = []
        for line in self.lines:
            try:
                clock, power, reasons = (field.strip() for field in line.split(","))
                samples.append((float(clock), float(power), int(reasons, 16)))
            except ValueError:
                continue
        if not samples:
            return None
        clocks = [c for c, _, _ in samples]
        reasons = 0
        for _, _, r in samples:
            reasons |= r
        return dict(samples=len(samples), sm_clock_mhz_min=min(clocks), sm_clock_mhz_max=max(clocks),
                    power_w_max=max(p for _, p, _ in samples), throttle_reasons_seen=f"{reasons:#x}")


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.partition("x")
    if not (rows.isdigit() and cols.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is ROWSxCOLS, e.g. 8192x16384")
    return int(rows), int(cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384], help="square shapes")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[], help="more shapes, ROWSxCOLS")
    parser.add_argument("--settle-seconds", type=float, default=2.0,
                        help="idle time before each shape, so that none inherits the power-capped clock of the last")
    parser.add_argument("--out", default=None, help="default benchmarks/results/quantize_<gpu>.json")
    args = parser.parse_args()
    if args.settle_seconds < 0:
        parser.error(f"--settle-seconds {args.settle_seconds}: must be >= 0")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quantize.py needs a CUDA GPU")
    results, card = [], []
    for rows, cols in [(size, size) for size in args.sizes] + args.shapes:
        torch.cuda.synchronize()
        time.sleep(args.settle_seconds)
        print(f"timing {rows}x{cols}", flush=True)
        with CardSampler() as sampler:
            results += run_shape(rows, cols)
        card.append(dict(rows=rows, cols=cols, during=sampler.summary()))
        print(f"  card during the shape: {card[-1]['during']}", flush=True)
        torch.cuda.empty_cache()
    print(f"{'kernel':42s} {'shape':>11s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s}")
    for r in results:
        print(f"{r['kernel']:42s} {r['rows']:5d}x{r['cols']:<5d} {r['ms']:9.4f} {r['gbps']:8.0f} {r['fraction_of_copy']:8.1%}")
    fits = fixed_and_per_element_cost(results)
    for f in fits:
        print(f"{f['kernel']:42s} fit over {f['shapes']} shapes: {f['fixed_us']:5.1f} us per launch + "
              f"{f['us_per_million_elements']:.4f} us per million elements")
    ratios = stochastic_rounding_ratios(results)
    for r in ratios:
        print(f"{r['kernel']:42s} {r['rows']:5d}x{r['cols']:<5d} time / {r['baseline']}: {r['time_ratio']:.3f}x")
    report = dict(benchmark="quantize", gpu=torch.cuda.get_device_name(), date=datetime.datetime.now().isoformat(),
                  commit=git_commit(), command=command_line(), torch=torch.__version__, cuda=torch.version.cuda,
                  results=results,
                  settle_seconds=args.settle_seconds, card_state_per_shape=card,
                  fixed_and_per_element_cost=fits, stochastic_rounding_time_ratios=ratios)
    out = pathlib.Path(args.out) if args.out else default_results_path("quantize")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
