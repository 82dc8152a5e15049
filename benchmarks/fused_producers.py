"""Fused producers against the unfused chain: time and bytes of a norm's / an activation's NVFP4 copies.

For each producer, width and token count, two chains give the same bytes (tests_multigpu/test_fused_producers_gpu.py):
- unfused: the producer's kernel writes its BF16 output, the amax kernel reads it (plain and post-RHT amax), the
  cast reads it again and writes the rowwise copy and the RHT columnwise copy (csrc/quantize.cu);
- fused: pass 1 reads the producer's input (the norm: row statistics and plain amax, then the input again for the
  post-RHT amax from the statistics; the activation: both amaxes), pass 2 reads it again and writes both copies,
  the BF16 output never written (csrc/norm_quantize.cu, csrc/activation_quantize.cu).
"Needed" bytes are those any chain must move: the input read once and both copies (codes and E4M3 scales) written;
GB/s counts those, against a device-to-device copy of the input in the same run (read + write). "Moved" bytes are
each chain's own traffic to memory by design (L2 hits not counted). Row-scaled variants (rowwise copy, per-row
amax) are timed too. Kernels are called with preallocated outputs (no allocation in the timed loop; the unfused
cast through nvfp4_dist.kernels.launch_quantize, the call quantize_tensor makes) and timed in interleaved rounds
(benchmarks/quantize.py time_interleaved).

    python benchmarks/fused_producers.py [--tokens 8192 16384 32768 65536] [--hidden 4096 8192]
                                         [--ffn 14336 28672] [--out benchmarks/results/fused_producers_<gpu>.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time

import torch

from nvfp4_dist import fused_kernels, kernels
from nvfp4_dist._extension import load_extension
from provenance import command_line, default_results_path, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)
from quantize import CardSampler, time_interleaved  # noqa: E402

BLOCK = 16
NORMALIZATION_CODES = {"LayerNorm": 0, "RMSNorm": 1}
ACTIVATION_CODES = {"gelu": 0, "swiglu": 1}


def copies_bytes(rows: int, cols: int, copies: int) -> int:
    """Packed codes plus E4M3 scales of `copies` NVFP4 copies of a [rows, cols] tensor."""
    return copies * (rows * cols // 2 + rows * cols // BLOCK)


def chain_bytes(tokens: int, input_cols: int, output_cols: int, copies: int, fused_input_reads: int) -> dict:
    """Bytes (BF16 input [tokens, input_cols], output [tokens, output_cols]): what any chain must move, and what the
    unfused chain (output written, read for the amax, read for the cast) and the fused one (input read
    `fused_input_reads` times) move."""
    input_bytes, output_bytes = 2 * tokens * input_cols, 2 * tokens * output_cols
    written = copies_bytes(tokens, output_cols, copies)
    return dict(needed=input_bytes + written,
                unfused=input_bytes + output_bytes + output_bytes + output_bytes + written,
                fused=fused_input_reads * input_bytes + written)


def speedups(results: list[dict]) -> list[dict]:
    """Unfused time / fused time per case measured in both chains (same run)."""
    ms = {(r["producer"], r["copies"], r["width"], r["tokens"], r["chain"]): r["ms"] for r in results}
    out = []
    for (producer, copies, width, tokens, chain), fused_ms in ms.items():
        unfused_ms = ms.get((producer, copies, width, tokens, "unfused"))
        if chain == "fused" and unfused_ms is not None:
            out.append(dict(producer=producer, copies=copies, width=width, tokens=tokens,
                            speedup=unfused_ms / fused_ms))
    return out


class Buffers:
    """Preallocated amaxes and NVFP4 copies of a [rows, cols] output."""

    def __init__(self, rows: int, cols: int, row_scaled: bool):
        device = "cuda"
        self.amax_plain = torch.empty(rows if row_scaled else 1, dtype=torch.float32, device=device)
        self.amax_rht = torch.empty(1, dtype=torch.float32, device=device)
        self.row_data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
        self.row_scale = torch.empty(rows, cols // BLOCK, dtype=torch.uint8, device=device)
        self.col_data = None if row_scaled else torch.empty(cols, rows // 2, dtype=torch.uint8, device=device)
        self.col_scale = None if row_scaled else torch.empty(cols, rows // BLOCK, dtype=torch.uint8, device=device)
        self.row_scaled = row_scaled

    def cast_outputs(self):
        """(amax_rowwise, amax_columnwise, rowwise data, scale, columnwise data, scale) as the casts take them."""
        return (self.amax_plain, None if self.row_scaled else self.amax_rht, self.row_data, self.row_scale,
                self.col_data, self.col_scale)


def unfused_cast(extension, stream, output: torch.Tensor, buffers: Buffers):
    """The amax pass(es) and the cast of a written BF16 output (csrc/amax.cu, csrc/quantize.cu)."""
    def run():
        if buffers.row_scaled:
            extension.amax_rows(output, buffers.amax_plain, stream)
        else:
            extension.amax_rht(output, True, buffers.amax_plain, buffers.amax_rht, stream)
        kernels.launch_quantize(output, *buffers.cast_outputs(), row_scaled=buffers.row_scaled,
                                rht=not buffers.row_scaled, rht_random_sign=True)
    return run


def norm_chains(extension, stream, tokens: int, hidden: int, normalization: str, row_scaled: bool):
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(hidden, device="cuda")
    bias = 0.1 * torch.randn(hidden, device="cuda") if normalization == "LayerNorm" else None
    mean = torch.empty(tokens, device="cuda") if normalization == "LayerNorm" else None
    rstd = torch.empty(tokens, device="cuda")
    y = torch.empty_like(x)
    buffers = Buffers(tokens, hidden, row_scaled)
    code = NORMALIZATION_CODES[normalization]
    cast = unfused_cast(extension, stream, y, buffers)

    def unfused():
        extension.norm_rows(x, weight, bias, code, 1e-5, mean, rstd, None, y, None, False, None, True, stream)
        cast()

    def fused():
        extension.norm_rows(x, weight, bias, code, 1e-5, mean, rstd, None, None, buffers.amax_plain, row_scaled,
                            None if row_scaled else buffers.amax_rht, True, stream)
        extension.norm_cast(x, weight, bias, code, mean, rstd, *buffers.cast_outputs(), row_scaled, not row_scaled,
                            True, stream)
    return x, unfused, fused


def activation_chains(extension, stream, tokens: int, ffn: int, activation: str, row_scaled: bool):
    h = torch.randn(tokens, ffn * (2 if activation == "swiglu" else 1), device="cuda", dtype=torch.bfloat16)
    a = torch.empty(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    buffers = Buffers(tokens, ffn, row_scaled)
    code = ACTIVATION_CODES[activation]
    cast = unfused_cast(extension, stream, a, buffers)
    table = fused_kernels.activation_table(h.device, activation)  # both chains look the activation up

    def unfused():
        extension.activation_forward(h, code, a, table, stream)
        cast()

    def fused():
        extension.activation_amaxes(h, code, buffers.amax_plain, row_scaled, None if row_scaled else buffers.amax_rht,
                                    True, table, stream)
        extension.activation_cast(h, code, *buffers.cast_outputs(), row_scaled, not row_scaled, True, table, stream)
    return h, unfused, fused


def run_case(producer: str, width: int, tokens: int, row_scaled: bool) -> list[dict]:
    extension = load_extension()
    stream = torch.cuda.current_stream().cuda_stream
    chains = norm_chains if producer in NORMALIZATION_CODES else activation_chains
    source, unfused, fused = chains(extension, stream, tokens, width, producer, row_scaled)
    copy_target = torch.empty_like(source)
    (copy_ms,) = time_interleaved([lambda: copy_target.copy_(source)])
    copy_gbps = 2 * source.numel() * source.element_size() / copy_ms / 1e6
    unfused_ms, fused_ms = time_interleaved([unfused, fused])
    copies = 1 if row_scaled else 2
    # the fused norm reads its input a third time for the post-RHT amax
    fused_reads = 3 if producer in NORMALIZATION_CODES and not row_scaled else 2
    moved = chain_bytes(tokens, source.shape[1], width, copies, fused_reads)
    kind = "rowwise (row-scaled)" if row_scaled else "rowwise + RHT columnwise"
    results = []
    for chain, ms in (("unfused", unfused_ms), ("fused", fused_ms)):
        gbps = moved["needed"] / ms / 1e6
        results.append(dict(producer=producer, copies=kind, width=width, tokens=tokens, chain=chain, ms=ms,
                            bytes_needed=moved["needed"], bytes_moved=moved[chain], gbps_needed=gbps,
                            copy_gbps=copy_gbps, fraction_of_copy=gbps / copy_gbps))
    del source
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--ffn", type=int, nargs="+", default=[14336, 28672])
    parser.add_argument("--norms", nargs="+", default=list(NORMALIZATION_CODES), choices=list(NORMALIZATION_CODES))
    parser.add_argument("--activations", nargs="+", default=list(ACTIVATION_CODES), choices=list(ACTIVATION_CODES))
    parser.add_argument("--settle-seconds", type=float, default=1.0,
                        help="idle time before each case, so that none inherits the power-capped clock of the last")
    parser.add_argument("--out", default=None, help="default benchmarks/results/fused_producers_<gpu>.json")
    args = parser.parse_args()
    for name in ("tokens", "hidden", "ffn"):
        bad = [v for v in getattr(args, name) if v <= 0 or v % 64]
        if bad:
            parser.error(f"--{name} {bad}: must be positive multiples of 64")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fused_producers.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    out = pathlib.Path(args.out) if args.out else default_results_path("fused_producers")
    cases = [(norm, hidden) for norm in args.norms for hidden in args.hidden]
    cases += [(activation, ffn) for activation in args.activations for ffn in args.ffn]
    results, card = [], []
    for producer, width in cases:
        for tokens in args.tokens:
            for row_scaled in (False, True):
                torch.cuda.synchronize()
                time.sleep(args.settle_seconds)
                with CardSampler() as sampler:
                    results += run_case(producer, width, tokens, row_scaled)
                card.append(dict(producer=producer, width=width, tokens=tokens, row_scaled=row_scaled,
                                 during=sampler.summary()))
                last = results[-2:]
                print(f"{producer:9s} {width:6d} x {tokens:6d} {last[0]['copies']:26s} unfused {last[0]['ms']:8.3f} ms"
                      f"  fused {last[1]['ms']:8.3f} ms  ({last[0]['ms'] / last[1]['ms']:.2f}x, fused at "
                      f"{last[1]['fraction_of_copy']:.0%} of copy)", flush=True)
    report = dict(benchmark="fused_producers", command=command_line(), gpu=gpu,
                  date=datetime.datetime.now().isoformat(), commit=git_commit(),
                  torch=torch.__version__, cuda=torch.version.cuda, results=results, speedups=speedups(results),
                  settle_seconds=args.settle_seconds, card_state_per_case=card)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
