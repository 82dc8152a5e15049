#!/usr/bin/env bash
# The GPU suite by group: build once, then run the group's steps, side by side on GPU pairs where they fit.
#   bash tests_multigpu/run_suite.sh tests OUTDIR            # 4 GPUs: every GPU test file (kernels, GEMMs, fused
#                                                           #   producers; layers, collectives and overlap at TP=2 and 4,
#                                                           #   overlap over each link class; agreement checks at TP=2),
#                                                           #   nvfp4-train, GPT convergence
#   bash tests_multigpu/run_suite.sh megatron OUTDIR         # 4 GPUs: Megatron GPT training vs BF16 at TP=1, 2 and 4
#   bash tests_multigpu/run_suite.sh megatron-checkpoint OUTDIR  # 4 GPUs: a TP=2 checkpoint loaded at TP=2, 1 and 4
#   bash tests_multigpu/run_suite.sh matrix OUTDIR           # 4 GPUs: the test matrix (worlds 1, 2, 4; b200 GEMM cells)
#   bash tests_multigpu/run_suite.sh benchmarks OUTDIR       # 4 GPUs: every benchmark (GEMM, linear, all-gather, overlap,
#                                                           #   TP linear, Megatron GPT) at 1, 2 and 4 GPUs
#   bash tests_multigpu/run_suite.sh tests-2gpu OUTDIR       # 2 GPUs: the tests of `tests` that fit two GPUs
#   bash tests_multigpu/run_suite.sh megatron-2gpu OUTDIR    # 2 GPUs: Megatron GPT training vs BF16 at TP=1 and 2
#   bash tests_multigpu/run_suite.sh benchmarks-2gpu OUTDIR  # 2 GPUs: the benchmarks that fit two GPUs
#   bash tests_multigpu/run_suite.sh tests-1gpu OUTDIR       # 1 GPU: the one-GPU tests, and FSDP2 at DP=2 and 4
#                                                           #   with the ranks sharing the GPU over gloo
# Run from anywhere; OUTDIR gets summary.txt (per step: PASS/FAIL, seconds) and results.tar.gz (logs, JSON, PNG),
# refreshed after every step so a cut run still returns what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
GROUP=${1:-}; OUTDIR=$(realpath -m "${2:-out/suite}"); R=$OUTDIR/results
SUITE_GROUPS="tests megatron megatron-checkpoint matrix benchmarks tests-2gpu megatron-2gpu benchmarks-2gpu tests-1gpu"
case " $SUITE_GROUPS " in *" $GROUP "*) ;; *) echo "usage: $0 {${SUITE_GROUPS// /|}} OUTDIR"; exit 2 ;; esac
mkdir -p "$R"
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

# Steps shared by the groups.
one_gpu_tests() {
    step quantize_kernels 150 python3 -m pytest -q tests_multigpu/test_quantize_kernels.py
    step gemm_hopper 150 python3 -m pytest -q tests_multigpu/test_gemm_hopper.py tests_multigpu/test_finite_check_gpu.py
    step linear_tests 120 python3 -m pytest -q -s tests_multigpu/test_linear_gpu.py
    step blackwell_gemm 120 python3 -m pytest -q tests_multigpu/test_blackwell_gemm.py
    step fused_producers 240 python3 -m pytest -q tests_multigpu/test_fused_producers_gpu.py
    step hot_path_graphs 120 python3 -m pytest -q tests_multigpu/test_hot_path_gpu.py tests_multigpu/test_cuda_graphs_gpu.py
    step grouped 120 python3 -m pytest -q tests_multigpu/test_grouped_quantize_gpu.py tests_multigpu/test_grouped_linear_gpu.py
}
two_gpu_tests() {
    step parallel_tp2 150 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_parallel_gpu.py
    step symmetric_tp2 90 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_symmetric_gpu.py
    step overlap_tp2 120 $TORCHRUN --nproc-per-node 2 -m tests_multigpu.test_overlap_gpu
    step group_checks_tp2 120 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_group_checks_gpu.py
    step fused_producers_tp2 150 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_fused_producers_parallel_gpu.py
    step cuda_graphs_tp2 120 $TORCHRUN --nproc-per-node 2 -m pytest -q tests_multigpu/test_cuda_graphs_tp_gpu.py
    fsdp_tests 2
}
fsdp_tests() {  # ranks: FSDP2's NVFP4 gather at DP=ranks (NCCL with a GPU per rank, else gloo), nvfp4-train --fsdp
    step "fsdp_dp$1" 200 $TORCHRUN --nproc-per-node "$1" -m pytest -q tests_multigpu/test_fsdp_gpu.py
    if [ "$1" = 2 ]; then step fsdp_train 300 python3 -m pytest -q tests_multigpu/test_fsdp_train_gpu.py; fi
}
megatron_cases() {  # name, limit, pytest -k expression: Megatron GPT training cases (the BF16 reference first)
    step "$1" "$2" env NVFP4_MEGATRON_STEPS=200 python3 -m pytest -q -s tests_multigpu/test_megatron_gpt.py -k "$3"
}

case $GROUP in
tests)
    lane_01() {
        one_gpu_tests
        step train_gpu_tp2 200 env OUT="$R/train_gpu" bash tests_multigpu/run_train_gpu.sh
    }
    lane_23() {
        two_gpu_tests
        step gpt_convergence 420 python3 -m tests_multigpu.gpt_convergence --out "$R/gpt_convergence_$GPU.json"
    }
    lane 0,1 lane_01; lane 2,3 lane_23; wait
    step parallel_tp4 150 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_parallel_gpu.py
    step symmetric_tp4 120 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_symmetric_gpu.py
    step overlap_tp4_nccl_ring 120 env NVFP4_SYMMETRIC_MEMORY=0 $TORCHRUN --nproc-per-node 4 -m tests_multigpu.test_overlap_gpu
    # TP=4 over NVLink, over slow links and as two torchrun nodes on this host (docs/slow_links.md)
    step overlap_tp4_links 480 python3 -m pytest -q tests_multigpu/test_overlap_gpu.py -k "4-"
    step fused_producers_tp4 150 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_fused_producers_parallel_gpu.py
    step cuda_graphs_tp4 120 $TORCHRUN --nproc-per-node 4 -m pytest -q tests_multigpu/test_cuda_graphs_tp_gpu.py
    fsdp_tests 4
    ;;
megatron)
    lane 0,1 megatron_cases megatron_tp1 300 "1-False-0 or 1-False-1"
    lane 2,3 megatron_cases megatron_tp2 400 "2-True-0 or 2-False-1 or tp_invariant"
    wait
    megatron_cases megatron_tp4 400 "4-True-1 or 4-False-0"
    ;;
megatron-checkpoint)
    step megatron_checkpoint 300 env NVFP4_MEGATRON_STEPS=100 python3 -m pytest -q -s \
        tests_multigpu/test_megatron_gpt.py -k checkpoint
    ;;
matrix)
    step matrix 420 python3 -m tests_multigpu.matrix --driver --max-world 4 --launcher torchrun --profile b200 \
        --git-commit "$GIT_COMMIT" --out "$R/matrix"
    ;;
benchmarks)  # the whole machine first, then the pairs side by side
    step allgather_bench_tp4 90 $TORCHRUN --nproc-per-node 4 benchmarks/allgather.py --out "$R/allgather_${GPU}_x4.json"
    step overlap_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp4.json" \
        --out-dir "$R/overlap_tp4"
    step tp_linear_bench 100 $TORCHRUN --nproc-per-node 4 benchmarks/tp_linear.py --out "$R/tp_linear_${GPU}_tp4.json"
    step megatron_bench_tp4 150 $TORCHRUN --nproc-per-node 4 benchmarks/megatron_gpt.py --out "$R/megatron_gpt_${GPU}x4.json"
    step megatron_bench_tp4_conn1 150 env CUDA_DEVICE_MAX_CONNECTIONS=1 $TORCHRUN --nproc-per-node 4 \
        benchmarks/megatron_gpt.py --out "$R/megatron_gpt_${GPU}x4_max_connections_1.json"
    lane_01() {
        step allgather_bench_tp2 90 $TORCHRUN --nproc-per-node 2 benchmarks/allgather.py --out "$R/allgather_${GPU}_x2.json"
        step overlap_bench_tp2 200 $TORCHRUN --nproc-per-node 2 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp2.json" \
            --out-dir "$R/overlap_tp2"
    }
    lane_23() {
        step gemm_bench 120 python3 benchmarks/gemm.py --out "$R/gemm_$GPU.json"
        step linear_bench 120 python3 benchmarks/linear.py --out "$R/linear_$GPU.json"
        step fused_producers_bench 150 python3 benchmarks/fused_producers.py --out "$R/fused_producers_$GPU.json"
    }
    lane 0,1 lane_01; lane 2,3 lane_23; wait
    ;;
tests-2gpu)
    one_gpu_tests
    two_gpu_tests
    step train_gpu_tp2 200 env OUT="$R/train_gpu" bash tests_multigpu/run_train_gpu.sh
    step gpt_convergence 420 python3 -m tests_multigpu.gpt_convergence --out "$R/gpt_convergence_$GPU.json"
    ;;
megatron-2gpu)
    megatron_cases megatron_tp1_tp2 560 "1-False-0 or 1-False-1 or 2-True-0 or 2-False-1 or tp_invariant"
    ;;
tests-1gpu)
    one_gpu_tests
    fsdp_tests 2
    fsdp_tests 4
    ;;
benchmarks-2gpu)
    step gemm_bench 120 python3 benchmarks/gemm.py --out "$R/gemm_$GPU.json"
    step allgather_bench_tp2 90 $TORCHRUN --nproc-per-node 2 benchmarks/allgather.py --out "$R/allgather_${GPU}_x2.json"
    step overlap_bench_tp2 200 $TORCHRUN --nproc-per-node 2 benchmarks/overlap.py --out "$R/overlap_${GPU}_tp2.json" \
        --out-dir "$R/overlap_tp2" --shapes "8192,4096,14336;16384,8192,28672"
    step megatron_bench_tp2 200 $TORCHRUN --nproc-per-node 2 benchmarks/megatron_gpt.py --layers 2 \
        --out "$R/megatron_gpt_${GPU}x2.json"
    ;;
esac
cat "$SUMMARY"
! grep -qE "FAIL|TIMEOUT" "$SUMMARY"
