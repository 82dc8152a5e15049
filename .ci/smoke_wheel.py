"""Smoke test of an installed (non-editable) nvfp4-dist, run from outside the repository on a CPU:

1. nvfp4_dist comes from site-packages, and every module of it imports (those of the GPU GEMM that need triton
   excepted on a CPU build of torch, which lacks it; the Megatron-Core ones need the [megatron] extra);
2. the kernel sources the extension builds from are inside the installed package;
3. quantize/dequantize and nv.Linear forward and backward work on CPU, close to full precision;
4. `nvfp4-train --help` and `nvfp4-train --steps 3` (2 gloo processes) succeed.

Usage: cd "$(mktemp -d)" && /path/to/venv/bin/python /path/to/repo/.ci/smoke_wheel.py
"""
import importlib
import json
import math
import os
import pathlib
import pkgutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings

import torch


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"smoke test FAILED: {what}")
    print(f"ok    {what}", flush=True)


def imports_from_site_packages():
    import nvfp4_dist
    package = pathlib.Path(nvfp4_dist.__file__).resolve().parent
    site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
    check(package.parent == site, f"nvfp4_dist is the installed one ({package})")
    modules, gpu_only = [], []
    for module in pkgutil.walk_packages(nvfp4_dist.__path__, "nvfp4_dist.", onerror=lambda name: sys.exit(
            f"smoke test FAILED: importing {name}")):
        try:
            importlib.import_module(module.name)
            modules.append(module.name)
        except ModuleNotFoundError as error:  # triton comes with CUDA builds of torch only
            if error.name != "triton" or torch.version.cuda is not None:
                raise
            gpu_only.append(module.name)
    for public in ("nvfp4_dist.reference", "nvfp4_dist.parallel", "nvfp4_dist.launch", "nvfp4_dist.launch.train"):
        check(public in modules, f"{public} imports")
    check(True, f"{len(modules) + 1} modules import"
          + (f"; not {', '.join(gpu_only)}, which CPU builds of torch lack (it needs triton)" if gpu_only else ""))
    return package


def kernel_sources_are_installed(package: pathlib.Path):
    from nvfp4_dist import _extension
    csrc = _extension.csrc_directory()
    check(csrc == package / "csrc", f"the extension builds from the installed {csrc}")
    sources = [pathlib.Path(s) for s in _extension.source_files()]
    check(len(sources) > 1 and all(s.is_file() for s in sources), f"{len(sources)} kernel sources present")
    check((csrc / "compile_check.sh").is_file(), "csrc/compile_check.sh present")


def quantize_and_linear_on_cpu():
    import nvfp4_dist as nv
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    q = nv.quantize(x.bfloat16())
    error = (nv.dequantize(q, torch.float32) - x).norm() / x.norm()
    check(q.rowwise_data.shape == (64, 128) and bool(error < 0.15), f"quantize/dequantize (relative error {error:.3f})")

    layer = nv.Linear(256, 128)
    inputs = x.clone().requires_grad_()
    out = layer(inputs)
    exact = torch.nn.functional.linear(x, layer.weight.detach(), layer.bias.detach())
    error = (out.detach() - exact).norm() / exact.norm()
    check(out.shape == (64, 128) and bool(error < 0.25), f"nv.Linear forward (relative error {error:.3f})")
    out.square().mean().backward()
    grads = {"input": inputs.grad, "weight": layer.weight.grad, "bias": layer.bias.grad}
    check(all(g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0) for g in grads.values()),
          "nv.Linear backward: finite, non-zero gradients of input, weight and bias")


def train_three_steps():
    train = pathlib.Path(sys.executable).parent / "nvfp4-train"
    check(train.is_file(), f"nvfp4-train is installed beside {sys.executable}")
    help_text = subprocess.run([train, "--help"], capture_output=True, text=True, check=True).stdout
    check("--out-dir" in help_text, "nvfp4-train --help")
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run([train, "--steps", "3", "--out-dir", out, "--no-progress"], capture_output=True,
                                text=True, timeout=600)
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:])
        check(result.returncode == 0, "nvfp4-train --steps 3 exits 0")
        records = [json.loads(line) for line in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in records if "loss" in r]
        check(len(losses) == 3 and all(math.isfinite(v) for v in losses), f"3 finite losses {losses}")
        check(any((pathlib.Path(out) / "checkpoints").iterdir()), "a checkpoint at the end")


def main():
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # no Apex/TE on CPU
    check(not (pathlib.Path.cwd() / "nvfp4_dist").exists(), f"run outside a checkout ({os.getcwd()})")
    package = imports_from_site_packages()
    kernel_sources_are_installed(package)
    quantize_and_linear_on_cpu()
    train_three_steps()
    print("smoke test passed")


if __name__ == "__main__":
    main()
