"""nvfp4_dist.Linear vs torch.nn.Linear in BF16 on one GPU: forward+backward time and saved memory.

For each (tokens, in, out): the median time of one forward+backward of each layer (weights cached, as
in every micro-batch after the first of an optimizer step), its breakdown into NVFP4 quantization (input
and output gradient, both copies), the three GEMMs (on pre-quantized operands) and the rest, the weight
quantization done once per optimizer step, and the bytes each layer saves for backward. Then each backward
mode (recipe.backward_mode, docs/numerics.md §10: default, high_precision, dequantized): its time, the bytes its
forward saves for backward, and the peak memory one forward+backward allocates above what was allocated before
it (inputs, parameters and the cached quantized weight), against BF16's in the same run. Then a LayerNorm in front
of the linear: nvfp4_dist.LayerNormLinear's forward+backward with the recipe's fused producers on and off (the
norm fused into the input's cast, or written in BF16 and cast), against BF16 torch.nn.LayerNorm + torch.nn.Linear.

    python benchmarks/linear.py [--shapes 16384,8192,8192 16384,8192,28672] [--backward-modes default dequantized]
                                [--no-layernorm-linear] [--out benchmarks/results/linear_<gpu>.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import torch

import nvfp4_dist as nv
from nvfp4_dist.gemm import gemm
from nvfp4_dist.linear import Linear, quantize_operand
from provenance import command_line, default_results_path, git_commit  # noqa: E402 (benchmarks/ is on sys.path when run)

DEFAULT_SHAPES = ["16384,8192,8192", "16384,8192,28672"]
BACKWARD_MODES = ("default", "high_precision", "dequantized")


def median_ms(fn, warmup: int = 3, iterations: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def saved_bytes(module, x) -> int:
    """Bytes autograd keeps for backward beyond the parameters and the cached quantized weight."""
    excluded = {p.data_ptr() for p in module.parameters()}
    cache = getattr(module, "weight_cache", None)
    if cache is not None and cache.quantized is not None:
        excluded |= {t.data_ptr() for t in cache.quantized.tensors() if t is not None}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in excluded and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return total


def peak_bytes(fn) -> int:
    """Peak bytes allocated while fn() runs, above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def bench_backward_modes(baseline, x, step, recipe: nv.NVFP4Recipe, modes) -> dict:
    """{mode: time, saved bytes and step peak} of nv.Linear with each backward mode, baseline's weights."""
    results = {}
    for mode in modes:
        mode_recipe = recipe.replace(backward_mode=mode)
        layer = Linear(baseline.in_features, baseline.out_features, device="cuda", dtype=torch.bfloat16,
                       recipe=mode_recipe)
        layer.load_state_dict(baseline.state_dict())
        ms = median_ms(lambda: step(layer))  # also caches the weight's copies for this mode
        results[mode] = dict(ms=ms, saved_bytes=saved_bytes(layer, x), peak_bytes=peak_bytes(lambda: step(layer)))
        del layer
    return results


def bench_shape(tokens: int, in_features: int, out_features: int, recipe: nv.NVFP4Recipe, modes=()) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    baseline = torch.nn.Linear(in_features, out_features, device="cuda", dtype=torch.bfloat16)
    layer = Linear(in_features, out_features, device="cuda", dtype=torch.bfloat16, recipe=recipe)
    layer.load_state_dict(baseline.state_dict())

    def step(module):
        module(x).backward(dy)
        x.grad = None
        module.weight.grad = module.bias.grad = None

    bf16_ms = median_ms(lambda: step(baseline))
    nvfp4_ms = median_ms(lambda: step(layer))

    xq = quantize_operand(x.detach(), "activation", recipe)
    dyq = quantize_operand(dy, "gradient", recipe, sr_seed=1)
    wq = layer.weight_cache.get(layer.weight, recipe)
    quantize_ms = median_ms(lambda: (quantize_operand(x.detach(), "activation", recipe),
                                     quantize_operand(dy, "gradient", recipe, sr_seed=1)))
    weight_quantize_ms = median_ms(lambda: nv.quantize(layer.weight.detach(), "weight", recipe=recipe))
    gemm_ms = median_ms(lambda: (
        gemm(xq, wq, bias=layer.bias, recipe=recipe),
        gemm(dyq, wq, b_copy="columnwise", recipe=recipe),
        gemm(dyq, xq, a_copy="columnwise", b_copy="columnwise", recipe=recipe)))
    bf16_saved, nvfp4_saved = saved_bytes(baseline, x), saved_bytes(layer, x)
    bf16_peak = peak_bytes(lambda: step(baseline))
    del layer, xq, dyq, wq
    modes = bench_backward_modes(baseline, x, step, recipe, modes)
    for result in modes.values():
        result.update(speedup_vs_bf16=bf16_ms / result["ms"], saved_ratio_vs_bf16=result["saved_bytes"] / bf16_saved,
                      peak_ratio_vs_bf16=result["peak_bytes"] / bf16_peak)
    return dict(tokens=tokens, in_features=in_features, out_features=out_features,
                bf16_ms=bf16_ms, nvfp4_ms=nvfp4_ms, speedup=bf16_ms / nvfp4_ms,
                nvfp4_quantize_ms=quantize_ms, nvfp4_gemm_ms=gemm_ms,
                nvfp4_other_ms=nvfp4_ms - quantize_ms - gemm_ms, weight_quantize_once_per_step_ms=weight_quantize_ms,
                bf16_saved_bytes=bf16_saved, nvfp4_saved_bytes=nvfp4_saved,
                saved_ratio=nvfp4_saved / bf16_saved, saved_bytes_reduction=bf16_saved - nvfp4_saved,
                bf16_peak_bytes=bf16_peak, backward_modes=modes)



def bench_layernorm_linear(tokens: int, in_features: int, out_features: int, recipe: nv.NVFP4Recipe) -> dict:
    """Forward+backward of LayerNorm + linear: BF16 torch against nv.LayerNormLinear with fused producers on, off."""
    torch.manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    norm = torch.nn.LayerNorm(in_features, device="cuda", dtype=torch.bfloat16)
    linear = torch.nn.Linear(in_features, out_features, device="cuda", dtype=torch.bfloat16)
    baseline = torch.nn.Sequential(norm, linear)

    def step(module):
        module(x).backward(dy)
        x.grad = None
        for parameter in module.parameters():
            parameter.grad = None

    bf16_ms = median_ms(lambda: step(baseline))
    row = dict(tokens=tokens, in_features=in_features, out_features=out_features, bf16_ms=bf16_ms)
    for fused in (True, False):
        layer = nv.LayerNormLinear(in_features, out_features, device="cuda", dtype=torch.bfloat16,
                                   recipe=recipe.replace(fused_producers=fused))
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            layer.bias.copy_(linear.bias)
            layer.layer_norm_weight.copy_(norm.weight)
            layer.layer_norm_bias.copy_(norm.bias)
        ms = median_ms(lambda: step(layer))
        key = "fused" if fused else "unfused"
        row[f"nvfp4_{key}_ms"] = ms
        row[f"speedup_{key}_vs_bf16"] = bf16_ms / ms
        del layer
    row["fused_vs_unfused"] = row["nvfp4_unfused_ms"] / row["nvfp4_fused_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="tokens,in,out triples")
    parser.add_argument("--backward-modes", nargs="*", choices=BACKWARD_MODES, default=list(BACKWARD_MODES),
                        help="backward modes to time and measure (none: skip that table)")
    parser.add_argument("--layernorm-linear", action=argparse.BooleanOptionalAction, default=True,
                        help="also time LayerNorm + linear (fused producers on and off) against BF16")
    parser.add_argument("--out", default=None, help="default benchmarks/results/linear_<gpu>.json")
    args = parser.parse_args()
    recipe = nv.NVFP4Recipe.from_env()
    shapes = [tuple(map(int, shape.split(","))) for shape in args.shapes]
    rows = [bench_shape(*shape, recipe, args.backward_modes) for shape in shapes]
    norm_rows = [bench_layernorm_linear(*shape, recipe) for shape in shapes] if args.layernorm_linear else []
    header = (f"{'tokens':>6} {'in':>6} {'out':>6} | {'BF16 ms':>8} {'NVFP4 ms':>8} {'speedup':>7} | "
              f"{'quant':>6} {'GEMM':>6} {'other':>6} {'Wquant':>6} | {'saved BF16':>10} {'NVFP4':>10} {'ratio':>5}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['tokens']:>6} {r['in_features']:>6} {r['out_features']:>6} | {r['bf16_ms']:>8.2f} "
              f"{r['nvfp4_ms']:>8.2f} {r['speedup']:>6.2f}x | {r['nvfp4_quantize_ms']:>6.2f} "
              f"{r['nvfp4_gemm_ms']:>6.2f} {r['nvfp4_other_ms']:>6.2f} {r['weight_quantize_once_per_step_ms']:>6.2f} | "
              f"{r['bf16_saved_bytes'] / 2**20:>8.0f}MB {r['nvfp4_saved_bytes'] / 2**20:>8.0f}MB "
              f"{r['saved_ratio']:>5.3f}")
    if args.backward_modes:
        header = (f"{'tokens':>6} {'in':>6} {'out':>6} {'backward mode':>15} | {'ms':>7} {'vs BF16':>7} | "
                  f"{'saved':>8} {'vs BF16':>7} | {'peak':>8} {'vs BF16':>7}")
        print("\n" + header)
        print("-" * len(header))
        for r in rows:
            print(f"{r['tokens']:>6} {r['in_features']:>6} {r['out_features']:>6} {'BF16 (torch)':>15} | "
                  f"{r['bf16_ms']:>7.2f} {'':>7} | {r['bf16_saved_bytes'] / 2**20:>6.0f}MB {'':>7} | "
                  f"{r['bf16_peak_bytes'] / 2**20:>6.0f}MB")
            for mode, m in r["backward_modes"].items():
                print(f"{'':>6} {'':>6} {'':>6} {mode:>15} | {m['ms']:>7.2f} {m['speedup_vs_bf16']:>6.2f}x | "
                      f"{m['saved_bytes'] / 2**20:>6.0f}MB {m['saved_ratio_vs_bf16']:>7.3f} | "
                      f"{m['peak_bytes'] / 2**20:>6.0f}MB {m['peak_ratio_vs_bf16']:>7.3f}")
    if norm_rows:
        header = (f"{'tokens':>6} {'in':>6} {'out':>6} | {'LN+Linear BF16 ms':>17} {'fused ms':>8} {'vs BF16':>7} | "
                  f"{'unfused ms':>10} {'vs BF16':>7} | {'fused vs unfused':>16}")
        print("\n" + header)
        print("-" * len(header))
        for r in norm_rows:
            print(f"{r['tokens']:>6} {r['in_features']:>6} {r['out_features']:>6} | {r['bf16_ms']:>17.2f} "
                  f"{r['nvfp4_fused_ms']:>8.2f} {r['speedup_fused_vs_bf16']:>6.2f}x | {r['nvfp4_unfused_ms']:>10.2f} "
                  f"{r['speedup_unfused_vs_bf16']:>6.2f}x | {r['fused_vs_unfused']:>15.2f}x")
    out = pathlib.Path(args.out) if args.out else default_results_path("linear")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(benchmark="linear", gpu=torch.cuda.get_device_name(),
                                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=git_commit(),
                                   command=command_line(),
                                   torch=torch.__version__, recipe=repr(recipe), results=rows,
                                   layernorm_linear=norm_rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
