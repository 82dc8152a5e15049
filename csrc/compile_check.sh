#!/usr/bin/env bash
# Compile every csrc/*.cu for sm_90a and sm_100a (compile only, no link) against the installed
# torch's headers, and csrc/bindings.cpp with the host compiler; exit non-zero on any failure.
# Usage: csrc/compile_check.sh   (NVCC=/path/to/nvcc to pick a compiler; JOBS=n parallel files;
#        CUBLAS_INCLUDE=dir holding cublasLt.h where the CUDA toolkit lacks the cuBLAS headers: else they
#        are taken once from NVIDIA's cuBLAS wheel into ~/.cache/nvfp4_dist/cublas_include)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nvcc="${NVCC:-nvcc}"
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

torch_includes=$("$python" -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
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
# The flags nvfp4_dist/_extension.py builds with, plus torch's own nvcc defines.
nvcc_flags=(-c -O3 -std=c++17 -fmad=false -lineinfo -I"$here" ${CUBLAS_INCLUDE:+-I"$CUBLAS_INCLUDE"}
            -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
            -D__CUDA_NO_HALF2_OPERATORS__
            -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100a,code=sm_100a)

compile_cu() {
  local source="$1" object
  object="$out/$(basename "$source").o"
  if "$nvcc" "${nvcc_flags[@]}" $torch_includes "$source" -o "$object" >"$object.log" 2>&1; then
    echo "ok    $(basename "$source")"
  else
    echo "FAIL  $(basename "$source")"; cat "$object.log"; return 1
  fi
}

host_cxx="${CXX:-g++}"
compile_bindings() {
  if "$host_cxx" -c -std=c++17 -O0 -fPIC $torch_includes -I"$python_include" -I"$cuda_include" -I"$here" \
       -DTORCH_EXTENSION_NAME=nvfp4_dist_C "$here/bindings.cpp" -o "$out/bindings.o" >"$out/bindings.log" 2>&1; then
    echo "ok    bindings.cpp"
  else
    echo "FAIL  bindings.cpp"; cat "$out/bindings.log"; return 1
  fi
}

status=0
compile_bindings &
pids=($!)
for source in "$here"/*.cu; do
  compile_cu "$source" &
  pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 0.2; done
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
