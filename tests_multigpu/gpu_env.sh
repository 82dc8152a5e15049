# Sourced by the GPU suite scripts: environment, megatron-core wheel, editable install, kernel build.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# No CUDA_DEVICE_MAX_CONNECTIONS=1 here: one hardware queue serialises the overlap's comm and GEMM streams.
# Megatron's own runs set it where they want it (test_megatron_gpt.py, the megatron_bench steps).
unset CUDA_DEVICE_MAX_CONNECTIONS
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
python3 -m nvfp4_dist.build
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
