#!/usr/bin/env bash
# Compile every csrc/*.cu for every SASS target nvfp4_dist builds (sm_90a, sm_100a, sm_103a, sm_120a) and its
# generic PTX fallback (compile only, no link), and csrc/bindings.cpp with the host compiler, against torch's
# headers, with the flags and C++ standard nvfp4_dist/_extension.py builds with; exit non-zero on any failure.
# A target the toolkit cannot build is named and left out.
# Usage: csrc/compile_check.sh
#   PYTHON=interpreter   the Python whose torch and nvfp4_dist to use (default: python3)
#   TORCH_INCLUDE=dir    another torch's include folder (e.g. torch/include unpacked from its wheel) instead of
#                        the installed torch's
#   NVCC=/path/to/nvcc   the compiler (default: nvcc);  JOBS=n  parallel compilations (default: nproc)
#   CUBLAS_INCLUDE=dir   the folder of cublasLt.h where the CUDA toolkit lacks the cuBLAS headers: else they
#                        are taken once from NVIDIA's cuBLAS wheel into ~/.cache/nvfp4_dist/cublas_include
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nvcc="${NVCC:-nvcc}"
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

if [ -f "$here/../nvfp4_dist/_extension.py" ]; then  # a checkout: its nvfp4_dist, installed or not
  export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"
fi
torch_include="${TORCH_INCLUDE:-$("$python" -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])")}"
if [ ! -f "$torch_include/ATen/ATen.h" ]; then
  echo "no torch headers in $torch_include (ATen/ATen.h is missing)" >&2; exit 2
fi
# the flags, the standard and the targets of nvfp4_dist/_extension.py, as bash assignments
settings=$("$python" - "$torch_include" "$nvcc" <<'PY'
import shlex, sys
from nvfp4_dist import _extension
include, nvcc = sys.argv[1:]
cxx_flags, nvcc_flags = _extension.compile_flags(include)
toolkit = _extension.cuda_toolkit(nvcc)
targets = [*_extension.SASS_TARGETS.values(), _extension.PTX_FALLBACK]
print(f"cxx_flags=({shlex.join(cxx_flags)})")
print(f"nvcc_base_flags=({shlex.join(nvcc_flags)})")
print(f"toolkit={shlex.quote(toolkit.version)}")
print(f"targets=({shlex.join(t for t in targets if toolkit.builds(t))})")
print(f"lacking=({shlex.join(t for t in targets if not toolkit.builds(t))})")
print(f"gencodes=({shlex.join(_extension.gencode(t) for t in targets if toolkit.builds(t))})")
PY
)
eval "$settings"
torch_includes=(-I"$torch_include" -I"$torch_include/torch/csrc/api/include")
python_include=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
probe="$out/probe.cu"; : >"$probe"
cuda_top=$("$nvcc" --dryrun -c "$probe" -o "$out/probe.o" 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)
cuda_include="${CUDA_HOME:-$cuda_top}/include"
if [ -z "${CUBLAS_INCLUDE:-}" ] && ! echo '#include <cublasLt.h>' | "$nvcc" -x cu -E - -o /dev/null >/dev/null 2>&1; then
  CUBLAS_INCLUDE="${XDG_CACHE_HOME:-$HOME/.cache}/nvfp4_dist/cublas_include"
  if [ ! -f "$CUBLAS_INCLUDE/cublasLt.h" ]; then  # headers only: the wheel's libraries are not kept
    "$python" -m pip download -q --no-deps -d "$out/wheel" "nvidia-cublas==13.*"
    "$python" - "$out"/wheel/nvidia_cublas*.whl "$CUBLAS_INCLUDE" <<'PY'
import os, sys, zipfile
wheel, target = zipfile.ZipFile(sys.argv[1]), sys.argv[2]
os.makedirs(target, exist_ok=True)
for name in wheel.namelist():  # nvidia/cu13/include/cublasLt.h, ...
    folder, _, file = name.rpartition("/")
    if folder.endswith("/include") and file.endswith(".h"):
        with open(os.path.join(target, file), "wb") as f:
            f.write(wheel.read(name))
PY
  fi
fi
# _extension.py's flags plus torch's own nvcc defines
nvcc_flags=(-c "${nvcc_base_flags[@]}" -I"$here" ${CUBLAS_INCLUDE:+-I"$CUBLAS_INCLUDE"}
            -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
            -D__CUDA_NO_HALF2_OPERATORS__)

echo "torch headers $torch_include (${cxx_flags[*]: -1}), nvcc $toolkit: ${targets[*]}"
if [ "${#lacking[@]}" -gt 0 ]; then
  echo "nvcc $toolkit cannot build ${lacking[*]}: not compiled"
fi

compile_cu() {  # one file for one target
  local source="$1" target="$2" flag="$3" object
  object="$out/$(basename "$source").$target.o"
  if "$nvcc" "${nvcc_flags[@]}" "$flag" "${torch_includes[@]}" "$source" -o "$object" >"$object.log" 2>&1; then
    echo "ok    $(basename "$source") $target"
  else
    echo "FAIL  $(basename "$source") $target"; cat "$object.log"; : >"$out/failed"; return 1
  fi
}

host_cxx="${CXX:-g++}"
compile_bindings() {
  if "$host_cxx" -c "${cxx_flags[@]/-O3/-O0}" -fPIC "${torch_includes[@]}" -I"$python_include" -I"$cuda_include" \
       -I"$here" -DTORCH_EXTENSION_NAME=nvfp4_dist_C "$here/bindings.cpp" -o "$out/bindings.o" >"$out/bindings.log" 2>&1; then
    echo "ok    bindings.cpp"
  else
    echo "FAIL  bindings.cpp"; cat "$out/bindings.log"; : >"$out/failed"; return 1
  fi
}

# Each failing compilation leaves $out/failed: waiting on saved PIDs is not reliable once a loaded machine has
# reused them ("pid ... is not a child of this shell").
compile_bindings &
for source in "$here"/*.cu; do
  for i in "${!targets[@]}"; do
    compile_cu "$source" "${targets[$i]}" "${gencodes[$i]}" &
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 0.2; done
  done
done
wait
[ ! -e "$out/failed" ]
