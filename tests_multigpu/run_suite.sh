#!/usr/bin/env bash
# The GPU suite in few calls: build once, run the steps of one group side by side where GPUs allow.
#   bash tests_multigpu/run_suite.sh a OUTDIR   # 4 GPUs: tests (1-, 2- and 4-GPU lanes), nvfp4-train, Megatron
#   bash tests_multigpu/run_suite.sh b OUTDIR   # 4 GPUs: benchmarks and the test matrix (whole machine each)
#   bash tests_multigpu/run_suite.sh c OUTDIR   # 4 GPUs: nvfp4-train runs, 2-GPU benchmarks, checkpoint resharding
#   bash tests_multigpu/run_suite.sh d OUTDIR   # 4 GPUs: symmetric-memory collectives, then the layers and benchmarks on them
#   bash tests_multigpu/run_suite.sh e OUTDIR   # 4 GPUs: symmetric collectives and overlap on copy engines, Megatron GPT TP=2 SP off, TP=4
#   bash tests_multigpu/run_suite.sh f OUTDIR   # 4 GPUs: the test matrix (worlds 1, 2, 4)
#   bash tests_multigpu/run_suite.sh g OUTDIR   # 2 GPUs: Megatron GPT training at TP=1 and 2 against the BF16 spec
#   bash tests_multigpu/run_suite.sh h OUTDIR   # 2 GPUs: Hopper GEMM tests, overlap tests and benchmarks at TP=2
#   bash tests_multigpu/run_suite.sh i OUTDIR   # 2 GPUs: Hopper GEMM, symmetric collectives, overlap, layers, benchmarks at TP=2
#   bash tests_multigpu/run_suite.sh j OUTDIR   # 4 GPUs: TP=4 overlap tests and benchmarks, Megatron benchmark and training
#   bash tests_multigpu/run_suite.sh k OUTDIR   # 4 GPUs: Megatron TP=1/2 training and checkpoints, overlap TP=2/4, matrix
# Writes OUTDIR/summary.txt (per step: PASS/FAIL, seconds) and OUTDIR/results.tar.gz (logs, JSON, PNG),
# refreshed after every step so a cut run still returns what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
GROUP=$1; OUTDIR=$(realpath -m "$2"); R=$OUTDIR/results; mkdir -p "$R"
SUMMARY=$OUTDIR/summary.txt; : > "$SUMMARY"
source tests_multigpu/gpu_env.sh > "$R/setup.log" 2>&1 || { cat "$R/setup.log"; exit 2; }
tail -n 2 "$R/setup.log"
GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")
TORCHRUN="python3 -m torch.distributed.run --standalone"
export GIT_COMMIT=${GIT_COMMIT:-unknown} NVFP4_COMMIT=${GIT_COMMIT:-unknown}

step() {  # name, limit in seconds, command...: run under a time limit, log to $R/<name>.log
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" > "$R/$name.log" 2>&1
    local code=$?
    local verdict=PASS; [ $code -eq 0 ] || verdict="FAIL(exit $code)"; [ $code -eq 124 ] && verdict="TIMEOUT"
    printf '%-24s %-14s %4ds\n' "$name" "$verdict" $((SECONDS - start)) | tee -a "$SUMMARY"
    flock "$OUTDIR/.tar.lock" tar -czf "$OUTDIR/results.tar.gz" -C "$R" . 2>/dev/null
}
lane() {  # GPU list, function: run the function in the background with only those GPUs visible
    local gpus=$1; shift
    ( export CUDA_VISIBLE_DEVICES=$gpus; "$@" ) &
}

case $GROUP in
a)
    lane_01() {
        step parallel_tp2 150 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_parallel_gpu.py
        step overlap_tp2 120 $TORCHRUN --nproc-per-node 2 tests_multigpu/test_overlap_gpu.py
        step train_gpu_tp2 200 env OUT="$R/train_gpu" bash tests_multigpu/run_train_gpu.sh
        step linear_tests 120 python3 -m pytest -q tests_multigpu/test_linear_gpu.py
    }
    lane_23() {
        step megatron_tp1_tp2 300 env NVFP4_MEGATRON_STEPS=200 python3 -m pytest -q -s \
            tests_multigpu/test_megatron_gpt.py -k "1-False-0 or 1-False-1 or 2-True-0"
        step gpt_convergence 240 python3 tests_multigpu/gpt_convergence.py --out "$R/gpt_convergence_$GPU.json"
        step linear_bench 120 python3 benchmarks/linear.py --out "$R/linear_$GPU.json"
    }
    lane 0,1 lane_01; lane 2,3 lane_23; wait
    step parallel_tp4 150 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_parallel_gpu.py
    step overlap_tp4 120 $TORCHRUN --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py
    ;;
b)  # in priority order: a cut run keeps what finished
    step allgather_bench_tp4 90 $TORCHRUN --nproc-per-node 4 benchmarks/allgather.py --out "$R/allgather_${GPU}_x4.json"
    step overlap_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp4.json" \
        --out-dir "$R/overlap_tp4"
    step matrix 360 python3 tests_multigpu/matrix.py --driver --max-world 4 --launcher torchrun --profile b200 \
        --git-commit "$GIT_COMMIT" --out "$R/matrix"
    step megatron_bench 150 $TORCHRUN --nproc-per-node 4 benchmarks/megatron_gpt.py --out "$R/megatron_gpt_${GPU}x4.json"
    step tp_linear_bench 100 $TORCHRUN --nproc-per-node 4 benchmarks/tp_linear.py --out "$R/tp_linear_${GPU}_tp4.json"
    step allgather_bench_tp2 90 env CUDA_VISIBLE_DEVICES=0,1 $TORCHRUN --nproc-per-node 2 benchmarks/allgather.py \
        --out "$R/allgather_${GPU}_x2.json"
    ;;
c)  # re-runs after fixes, and what a and b left out
    step train_gpu_tp2 200 env OUT="$R/train_gpu" CUDA_VISIBLE_DEVICES=0,1 bash tests_multigpu/run_train_gpu.sh
    step allgather_bench_tp4 90 $TORCHRUN --nproc-per-node 4 benchmarks/allgather.py --out "$R/allgather_${GPU}_x4.json"
    step allgather_bench_tp2 90 env CUDA_VISIBLE_DEVICES=0,1 $TORCHRUN --nproc-per-node 2 benchmarks/allgather.py \
        --out "$R/allgather_${GPU}_x2.json"
    step megatron_checkpoint 240 env NVFP4_MEGATRON_STEPS=100 python3 -m pytest -q -s \
        tests_multigpu/test_megatron_gpt.py -k checkpoint
    step overlap_bench_tp2 120 env CUDA_VISIBLE_DEVICES=0,1 $TORCHRUN --nproc-per-node 2 benchmarks/overlap.py \
        --out "$R/overlap_${GPU}_tp2.json" --out-dir "$R/overlap_tp2"
    ;;
d)  # the symmetric-memory (NVLink peer) collectives first, then everything that now runs on them by default
    step symmetric_tp4 120 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_symmetric_gpu.py
    step allgather_bench_tp4 90 $TORCHRUN --nproc-per-node 4 benchmarks/allgather.py --out "$R/allgather_${GPU}_x4.json"
    step symmetric_tp2 90 env CUDA_VISIBLE_DEVICES=0,1 $TORCHRUN --nproc-per-node 2 -m pytest -q \
        tests_multigpu/test_symmetric_gpu.py
    step allgather_bench_tp2 90 env CUDA_VISIBLE_DEVICES=0,1 $TORCHRUN --nproc-per-node 2 benchmarks/allgather.py \
        --out "$R/allgather_${GPU}_x2.json"
    step parallel_tp4 150 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_parallel_gpu.py
    step overlap_tp4 120 $TORCHRUN --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py
    step overlap_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp4.json" \
        --out-dir "$R/overlap_tp4"
    step tp_linear_bench 100 $TORCHRUN --nproc-per-node 4 benchmarks/tp_linear.py --out "$R/tp_linear_${GPU}_tp4.json"
    step megatron_bench 150 $TORCHRUN --nproc-per-node 4 benchmarks/megatron_gpt.py --out "$R/megatron_gpt_${GPU}x4.json"
    step megatron_bench_conn1 150 env CUDA_DEVICE_MAX_CONNECTIONS=1 $TORCHRUN --nproc-per-node 4 benchmarks/megatron_gpt.py \
        --out "$R/megatron_gpt_${GPU}x4_max_connections_1.json"
    ;;
e)  # re-checks of the symmetric collectives and their benchmark, then the Megatron training cases group a left out
    step symmetric_tp4 120 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_symmetric_gpu.py
    step allgather_bench_tp4 90 $TORCHRUN --nproc-per-node 4 benchmarks/allgather.py --out "$R/allgather_${GPU}_x4.json"
    step allgather_bench_tp2 90 env CUDA_VISIBLE_DEVICES=0,1 $TORCHRUN --nproc-per-node 2 benchmarks/allgather.py \
        --out "$R/allgather_${GPU}_x2.json"
    step overlap_tp4 120 $TORCHRUN --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py
    step overlap_tp4_nccl_ring 120 env NVFP4_SYMMETRIC_MEMORY=0 $TORCHRUN --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py
    step overlap_tp2 120 env CUDA_VISIBLE_DEVICES=0,1 $TORCHRUN --nproc-per-node 2 tests_multigpu/test_overlap_gpu.py
    step overlap_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp4.json" \
        --out-dir "$R/overlap_tp4"
    step megatron_tp2_tp4 400 env NVFP4_MEGATRON_STEPS=200 python3 -m pytest -q -s tests_multigpu/test_megatron_gpt.py \
        -k "2-False-1 or 4-True-1 or 4-False-0"
    ;;
f)  # the test matrix again, on the symmetric-memory transport (now the default on one host)
    step matrix 360 python3 tests_multigpu/matrix.py --driver --max-world 4 --launcher torchrun --profile b200 \
        --git-commit "$GIT_COMMIT" --out "$R/matrix"
    ;;
g)  # every Megatron training case that fits 2 GPUs (the BF16 reference first, inside the test module)
    step megatron_tp1_tp2 480 env NVFP4_MEGATRON_STEPS=200 python3 -m pytest -q -s tests_multigpu/test_megatron_gpt.py \
        -k "trains_like_bf16 or tp_invariant"
    ;;
h)  # in priority order
    step gemm_hopper 120 python3 -m pytest -q tests_multigpu/test_gemm_hopper.py tests_multigpu/test_finite_check_gpu.py
    step overlap_tp2 120 $TORCHRUN --nproc-per-node 2 tests_multigpu/test_overlap_gpu.py
    step overlap_bench_tp2 200 $TORCHRUN --nproc-per-node 2 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp2.json" \
        --out-dir "$R/overlap_tp2" --shapes "8192,4096,14336;16384,8192,28672"
    step megatron_bench_tp2 200 $TORCHRUN --nproc-per-node 2 benchmarks/megatron_gpt.py --layers 2 \
        --out "$R/megatron_gpt_${GPU}x2.json"
    ;;
i)  # in priority order: the Hopper GEMM, the collectives and layers on 2 GPUs, then the benchmarks
    step gemm_hopper 150 python3 -m pytest -q tests_multigpu/test_gemm_hopper.py
    step symmetric_tp2 90 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_symmetric_gpu.py
    step overlap_tp2 120 $TORCHRUN --nproc-per-node 2 tests_multigpu/test_overlap_gpu.py
    step overlap_bench_tp2 200 $TORCHRUN --nproc-per-node 2 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp2.json" \
        --out-dir "$R/overlap_tp2" --shapes "8192,4096,14336;16384,8192,28672"
    step megatron_bench_tp2 150 $TORCHRUN --nproc-per-node 2 benchmarks/megatron_gpt.py --layers 2 \
        --out "$R/megatron_gpt_${GPU}x2.json"
    step linear_tests 100 python3 -m pytest -q -s tests_multigpu/test_linear_gpu.py
    step parallel_tp2 120 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_parallel_gpu.py
    step gemm_bench 120 python3 benchmarks/gemm.py --out "$R/gemm_$GPU.json"
    step megatron_tp2_sp 240 env NVFP4_MEGATRON_STEPS=200 python3 -m pytest -q -s tests_multigpu/test_megatron_gpt.py \
        -k "2-True-0"
    ;;
j)  # in priority order: what needs 4 GPUs, after the cuBLASLt GEMM path, lean weights and the new quantize kernel
    step overlap_tp4 120 $TORCHRUN --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py
    step overlap_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp4.json" \
        --out-dir "$R/overlap_tp4"
    step megatron_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/megatron_gpt.py --out "$R/megatron_gpt_${GPU}x4.json"
    step symmetric_tp4 90 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_symmetric_gpu.py
    step parallel_tp4 120 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_parallel_gpu.py
    step megatron_tp4 300 env NVFP4_MEGATRON_STEPS=200 python3 -m pytest -q -s tests_multigpu/test_megatron_gpt.py \
        -k "4-True-1 or 4-False-0"
    ;;
k)  # two 2-GPU lanes, then the whole machine
    lane_01() {
        step megatron_tp1_tp2 300 env NVFP4_MEGATRON_STEPS=200 python3 -m pytest -q -s \
            tests_multigpu/test_megatron_gpt.py -k "1-False-0 or 1-False-1 or 2-False-1"
    }
    lane_23() {
        step overlap_tp2 120 $TORCHRUN --nproc-per-node 2 tests_multigpu/test_overlap_gpu.py
        step overlap_bench_tp2 200 $TORCHRUN --nproc-per-node 2 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp2.json" \
            --out-dir "$R/overlap_tp2"
        step megatron_checkpoint 200 env NVFP4_MEGATRON_STEPS=50 python3 -m pytest -q -s \
            tests_multigpu/test_megatron_gpt.py -k checkpoint
    }
    lane 0,1 lane_01; lane 2,3 lane_23; wait
    step overlap_tp4 120 $TORCHRUN --nproc-per-node 4 tests_multigpu/test_overlap_gpu.py
    step overlap_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp4.json" \
        --out-dir "$R/overlap_tp4"
    step megatron_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/megatron_gpt.py --out "$R/megatron_gpt_${GPU}x4.json"
    step matrix 240 python3 tests_multigpu/matrix.py --driver --max-world 4 --launcher torchrun --profile b200 \
        --git-commit "$GIT_COMMIT" --out "$R/matrix"
    ;;
*) echo "usage: $0 a|b|c|d|e|f|g|h|i|j|k OUTDIR"; exit 2 ;;
esac
cat "$SUMMARY"
! grep -qE "FAIL|TIMEOUT" "$SUMMARY"
