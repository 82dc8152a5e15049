"""Build and load the CUDA extension nvfp4_dist._C (csrc/) with torch.utils.cpp_extension.

Built with ninja on first use and cached (NVFP4_BUILD_DIR, default ~/.cache/nvfp4_dist/...);
`python -m nvfp4_dist.build` builds it ahead of time. The kernels are compiled for the visible GPUs
(SASS_TARGETS) plus generic PTX that the driver compiles for newer GPUs, in the C++ standard that the
installed torch's headers require.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import pathlib
import re
import subprocess
import sys
import threading

import torch

from nvfp4_dist import environment

logger = logging.getLogger("nvfp4_dist")

EXTENSION_NAME = "nvfp4_dist_C"
FORCE_REFERENCE_HINT = "NVFP4_FORCE_REFERENCE=1 to use the pure-torch reference instead"
BUILD_HOW_TO = ("Build it on a machine with a CUDA GPU, a CUDA build of torch, nvcc and ninja: "
                "`python -m nvfp4_dist.build` (set NVFP4_BUILD_DIR to choose the cache folder), "
                f"or set {FORCE_REFERENCE_HINT}.")
# -fmad=false: no FMA contraction, so every product and sum is rounded as docs/numerics.md orders it;
# no fast-math, so divisions are IEEE (docs/numerics.md §2.2). The C++ standard comes from cxx_standard().
NVCC_FLAGS = ("-O3", "-fmad=false", "-lineinfo")
CXX_FLAGS = ("-O3",)
# The kernels' own minimum; torch's headers may require a newer standard (cxx_standard).
MIN_CXX_YEAR = 2017

# Compute capability -> the architecture-specific SASS target built for it.
SASS_TARGETS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a"}
# The first CUDA release whose nvcc builds each target, for the error that names a too-old toolkit.
FIRST_CUDA_RELEASE = {"sm_90a": "12.0", "sm_100a": "12.8", "sm_103a": "12.9", "sm_120a": "12.8"}
# Generic PTX for the oldest supported capability: the kernels use no architecture-specific instruction,
# so the driver can compile it for any newer GPU, including those SASS_TARGETS does not name.
PTX_FALLBACK = "compute_90"
MIN_CAPABILITY = (9, 0)


def csrc_directory() -> pathlib.Path:
    """The kernel sources: nvfp4_dist/csrc in an installed package, csrc/ beside nvfp4_dist/ in a checkout
    (an editable install included)."""
    package = pathlib.Path(__file__).resolve().parent
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "bindings.cpp").is_file():
            return candidate
    raise RuntimeError(f"nvfp4_dist's kernel sources are missing: neither {package / 'csrc'} nor "
                       f"{package.parent / 'csrc'} holds bindings.cpp; reinstall nvfp4-dist from a wheel or a checkout")


def cxx_standard(torch_include: str | os.PathLike | None = None) -> str:
    """The -std value to compile with: the newest of C++17 (the kernels') and the standard that torch's
    headers in `torch_include` (default: the installed torch's) require; torch 2.14's require C++20."""
    include = pathlib.Path(torch_include) if torch_include else pathlib.Path(torch.__file__).parent / "include"
    year = MIN_CXX_YEAR
    for header in ("ATen/ATen.h", "torch/csrc/api/include/torch/all.h"):
        path = include / header
        if path.is_file():  # e.g. `#if !defined(_MSC_VER) && __cplusplus < 202002L` then `#error C++20 ...`
            for required in re.findall(r"__cplusplus\s*<\s*(\d{4})\d{2}L", path.read_text(errors="replace")):
                year = max(year, int(required))
    return f"c++{year % 100:02d}"


def compile_flags(torch_include: str | os.PathLike | None = None) -> tuple[list[str], list[str]]:
    """(host compiler flags, nvcc flags without the targets) for building against torch's headers in
    `torch_include` (default: the installed torch's); csrc/compile_check.sh uses the same."""
    standard = f"-std={cxx_standard(torch_include)}"
    return [*CXX_FLAGS, standard], [*NVCC_FLAGS, standard]


@dataclasses.dataclass(frozen=True)
class CudaToolkit:
    """The nvcc that builds the extension: its path, release ("13.0") and the SASS targets it can build
    (`nvcc --list-gpu-code`, e.g. "sm_90", "sm_100": an arch-specific target like sm_100a needs its base)."""
    nvcc: str
    version: str
    gpu_codes: frozenset[str]

    def builds(self, target: str) -> bool:
        """Whether this nvcc can build `target` (sm_100a, compute_90, ...)."""
        number = re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", target)
        return number is not None and f"sm_{number.group(1)}" in self.gpu_codes


def nvcc_path() -> str:
    """The nvcc that torch.utils.cpp_extension runs: CUDA_HOME/bin/nvcc, else nvcc on the PATH."""
    from torch.utils.cpp_extension import CUDA_HOME
    return os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else "nvcc"


@functools.lru_cache(maxsize=None)
def cuda_toolkit(nvcc: str | None = None) -> CudaToolkit:
    """`nvcc` (default: nvcc_path()) with its release and targets; RuntimeError when it cannot run."""
    nvcc = nvcc or nvcc_path()
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
        codes = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(f"nvcc could not run ({nvcc}: {error}); install the CUDA toolkit and set CUDA_HOME. "
                           + BUILD_HOW_TO) from error
    release = re.search(r"release (\d+\.\d+)", version)
    return CudaToolkit(nvcc, release.group(1) if release else "(unknown release)", frozenset(codes.split()))


def gencode(target: str) -> str:
    """The nvcc flag that builds `target`: SASS for sm_* (from its compute_* PTX), embedded PTX for compute_*."""
    return f"-gencode=arch={target.replace('sm_', 'compute_', 1)},code={target}"


def visible_devices() -> list[tuple[int, str, tuple[int, int]]]:
    """(index, name, compute capability) of each visible CUDA device."""
    if not torch.cuda.is_available():
        return []
    return [(i, torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())]


def build_targets(toolkit: CudaToolkit | None = None) -> list[str]:
    """The SASS targets of the visible devices (SASS_TARGETS; every one this nvcc can build when no device is
    visible), then PTX_FALLBACK. RuntimeError naming the device, its capability and the toolkit when a device
    is older than MIN_CAPABILITY or needs a target this nvcc cannot build."""
    toolkit = toolkit or cuda_toolkit()
    devices = visible_devices()
    if devices:
        wanted = set()
        for index, name, capability in devices:
            where = f"GPU {index} ({name}, compute capability {capability[0]}.{capability[1]})"
            if capability < MIN_CAPABILITY:
                raise RuntimeError(f"{where} is older than the kernels need (compute capability "
                                   f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer): hide it with "
                                   f"CUDA_VISIBLE_DEVICES, or set {FORCE_REFERENCE_HINT}")
            target = SASS_TARGETS.get(capability)
            if target is None:
                logger.info("%s has no SASS target among %s: it runs the %s PTX, which the driver compiles for it",
                            where, sorted(SASS_TARGETS.values()), PTX_FALLBACK)
            elif not toolkit.builds(target):
                raise RuntimeError(f"{where} needs {target}, which nvcc {toolkit.version} ({toolkit.nvcc}) cannot "
                                   f"build: install CUDA {FIRST_CUDA_RELEASE[target]} or newer and point CUDA_HOME "
                                   f"at it, or set {FORCE_REFERENCE_HINT}")
            else:
                wanted.add(target)
        sass = [t for t in SASS_TARGETS.values() if t in wanted]
    else:  # an ahead-of-time build on a machine without a GPU: every target this toolkit can build
        sass = [t for t in SASS_TARGETS.values() if toolkit.builds(t)]
    if not toolkit.builds(PTX_FALLBACK):
        raise RuntimeError(f"nvcc {toolkit.version} ({toolkit.nvcc}) cannot build {PTX_FALLBACK}: install CUDA "
                           f"12.0 or newer and point CUDA_HOME at it, or set {FORCE_REFERENCE_HINT}")
    return sass + [PTX_FALLBACK]


def arch_flags(toolkit: CudaToolkit | None = None) -> list[str]:
    """The -gencode flags of build_targets()."""
    return [gencode(target) for target in build_targets(toolkit)]


def stream_handle(device: torch.device | None = None) -> int:
    """The current CUDA stream of `device` (default: the current device) as the integer the bindings take,
    by torch's cheapest lookup: small kernels' launches are host-bound."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw else torch.cuda.current_stream(index).cuda_stream


_ALREADY_CURRENT = contextlib.nullcontext()


def on_device(device: torch.device):
    """torch.cuda.device(device), or nothing when `device` is already the current one (the usual case: switching
    costs microseconds of host time, paid at every launch)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return _ALREADY_CURRENT
    return torch.cuda.device(device)


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
    csrc = csrc_directory()
    return [str(p) for p in sorted(csrc.glob("*.cu"))] + [str(csrc / "bindings.cpp")]


_lock = threading.Lock()
_module = None


def build_directory(arch: list[str]) -> pathlib.Path:
    """NVFP4_BUILD_DIR, or a cache folder keyed by the torch and CUDA versions and the targets of the
    -gencode flags `arch` (machines of different GPUs can share a home folder)."""
    chosen = environment.BUILD_DIR.read()
    if chosen:
        path = pathlib.Path(chosen)
    else:
        targets = "-".join(flag.rpartition("code=")[2] for flag in arch)
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", f"torch{torch.__version__}_cuda{torch.version.cuda}_{targets}")
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
        arch = arch_flags()  # its RuntimeError names a GPU the toolkit cannot build for
        cxx_flags, nvcc_flags = compile_flags()
        csrc = csrc_directory()
        try:
            from torch.utils.cpp_extension import load
            directory = build_directory(arch)
            logger.info("building/loading %s in %s for %s (-std from torch's headers: %s)", EXTENSION_NAME,
                        directory, " ".join(arch), cxx_flags[-1])
            cublas_includes, cublas_link = cublas_lt_flags()
            module = load(name=EXTENSION_NAME, sources=source_files(), extra_cflags=cxx_flags,
                          extra_cuda_cflags=nvcc_flags + arch,
                          extra_include_paths=[str(csrc), *cublas_includes], extra_ldflags=cublas_link,
                          build_directory=str(directory), verbose=verbose)
        except Exception as error:  # compiler missing, compile error, load error: all need the same advice
            raise RuntimeError(f"nvfp4_dist._C could not be built or loaded ({type(error).__name__}: {error}). "
                               + BUILD_HOW_TO) from error
        sys.modules["nvfp4_dist._C"] = module
        _module = module
        return module
