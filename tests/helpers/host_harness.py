"""The kernels' host-device arithmetic (csrc/*.cuh, NVFP4_HD functions) compiled for the host by nvcc and loaded
through ctypes: the CPU tests run the kernels' own per-element code against the reference."""
import ctypes
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from nvfp4_dist import _extension

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) on the PATH")


def compile_harness(directory: pathlib.Path, source: str) -> ctypes.CDLL:
    """`source` (CUDA C++ including csrc headers) built as a host shared library in `directory`, loaded."""
    path = directory / "harness.cu"
    path.write_text(source)
    library = directory / "libharness.so"
    subprocess.run(["nvcc", "-O2", f"-std={_extension.cxx_standard()}", "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off",
                    f"-I{CSRC}", str(path), "-o", str(library)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(library))


def pointer(array: np.ndarray):
    return array.ctypes.data_as(ctypes.c_void_p)
