"""Build and load the CUDA extension nvfp4_dist._C (csrc/) with torch.utils.cpp_extension.

Built with ninja on first use and cached (NVFP4_BUILD_DIR, default ~/.cache/nvfp4_dist/...);
`python -m nvfp4_dist.build` builds it ahead of time.
"""
from __future__ import annotations

import logging
import os
import pathlib
import re
import subprocess
import sys
import threading

import torch

logger = logging.getLogger("nvfp4_dist")

EXTENSION_NAME = "nvfp4_dist_C"
CSRC_DIR = pathlib.Path(__file__).resolve().parent.parent / "csrc"
BUILD_HOW_TO = ("Build it on a machine with a CUDA GPU, a CUDA build of torch, nvcc and ninja: "
                "`python -m nvfp4_dist.build` (set NVFP4_BUILD_DIR to choose the cache folder), "
                "or set NVFP4_FORCE_REFERENCE=1 to use the pure-torch reference instead.")
# -fmad=false: no FMA contraction, so every product and sum is rounded as the SPEC orders it;
# no fast-math, so divisions are IEEE (docs/numerics.md §2.2).
NVCC_FLAGS = ("-O3", "-std=c++17", "-fmad=false", "-lineinfo")
CXX_FLAGS = ("-O3", "-std=c++17")

_lock = threading.Lock()
_module = None


def stream_handle(device: torch.device | None = None) -> int:
    """The current CUDA stream of `device` (default: the current device) as the integer the bindings take,
    by torch's cheapest lookup: small kernels' launches are host-bound."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw else torch.cuda.current_stream(index).cuda_stream


def cublas_lt_flags() -> tuple[list[str], list[str]]:
    """(include dirs, linker flags) for cuBLASLt (csrc/cublaslt_gemm.cu): the CUDA toolkit's, else those of
    NVIDIA's cuBLAS wheel that CUDA builds of torch install (the library torch itself loads at run time)."""
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "include", "cublasLt.h")):
        for libdir in ("lib64", "lib"):
            if os.path.exists(os.path.join(CUDA_HOME, libdir, "libcublasLt.so")):
                return [], [f"-L{os.path.join(CUDA_HOME, libdir)}", "-lcublasLt"]
    try:
        import nvidia
        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        headers = sorted(pathlib.Path(root).glob("**/include/cublasLt.h"))
        libraries = sorted(pathlib.Path(root).glob("**/lib/libcublasLt.so*"))
        if headers and libraries:
            library = libraries[-1]
            return [str(headers[-1].parent)], [f"-L{library.parent}", f"-l:{library.name}", f"-Wl,-rpath,{library.parent}"]
    return [], ["-lcublasLt"]  # let the linker search; its error says what is missing


def source_files() -> list[str]:
    """Every csrc/*.cu plus csrc/bindings.cpp."""
    return [str(p) for p in sorted(CSRC_DIR.glob("*.cu"))] + [str(CSRC_DIR / "bindings.cpp")]


def nvcc_supports(arch: str) -> bool:
    """Whether the local nvcc knows the virtual architecture `arch` (e.g. compute_100a)."""
    from torch.utils.cpp_extension import CUDA_HOME
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else "nvcc"
    try:
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    return arch in listed.split()


def arch_flags() -> list[str]:
    """sm_90a always; sm_100a too when nvcc has it and a visible GPU is sm_100 or newer."""
    flags = ["-gencode=arch=compute_90a,code=sm_90a"]
    blackwell = torch.cuda.is_available() and any(
        torch.cuda.get_device_capability(i)[0] >= 10 for i in range(torch.cuda.device_count()))
    if blackwell and nvcc_supports("compute_100a"):
        flags.append("-gencode=arch=compute_100a,code=sm_100a")
    return flags


def build_directory() -> pathlib.Path:
    """NVFP4_BUILD_DIR, or a cache folder keyed by the torch and CUDA versions."""
    if os.environ.get("NVFP4_BUILD_DIR"):
        path = pathlib.Path(os.environ["NVFP4_BUILD_DIR"])
    else:
        key = re.sub(r"[^A-Za-z0-9_.]", "_", f"torch{torch.__version__}_cuda{torch.version.cuda}")
        path = pathlib.Path.home() / ".cache" / "nvfp4_dist" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_extension(verbose: bool = False):
    """The compiled module (built on first use, then cached); RuntimeError saying how to build otherwise."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if torch.version.cuda is None:
            raise RuntimeError(f"nvfp4_dist._C needs a CUDA build of torch (this one is {torch.__version__}). "
                               + BUILD_HOW_TO)
        try:
            from torch.utils.cpp_extension import load
            directory = build_directory()
            logger.info("building/loading %s in %s", EXTENSION_NAME, directory)
            cublas_includes, cublas_link = cublas_lt_flags()
            module = load(name=EXTENSION_NAME, sources=source_files(), extra_cflags=list(CXX_FLAGS),
                          extra_cuda_cflags=list(NVCC_FLAGS) + arch_flags(),
                          extra_include_paths=[str(CSRC_DIR), *cublas_includes], extra_ldflags=cublas_link,
                          build_directory=str(directory), verbose=verbose)
        except Exception as error:  # compiler missing, compile error, load error: all need the same advice
            raise RuntimeError(f"nvfp4_dist._C could not be built or loaded ({type(error).__name__}: {error}). "
                               + BUILD_HOW_TO) from error
        sys.modules["nvfp4_dist._C"] = module
        _module = module
        return module
