#!/usr/bin/env bash
# Two nodes on one host: two torchrun agents (--nnodes 2; c10d rendezvous on 127.0.0.1, which numbers the nodes in
# the order they join), each with half of the GPUs (CUDA_VISIBLE_DEVICES) and its own NCCL host id, with NCCL
# without peer-to-peer or shared memory on its socket transport over loopback (the environment of
# `benchmarks/torchrun_setup.py --links two-node`): traffic between the halves takes the cross-node path.
#
#   tests_multigpu/two_node_local.sh [--gpus N] SCRIPT [ARGS...]
#   tests_multigpu/two_node_local.sh tests_multigpu/test_overlap_gpu.py
#   tests_multigpu/two_node_local.sh benchmarks/overlap.py --links two-node
#
# N: GPUs in all, an even number >= 2 (default: every visible GPU). SCRIPT is relative to the repository root.
# TWO_NODE_TIMEOUT_S (default 1200) bounds each agent; PYTHON (default python3) runs torchrun. Output lines are
# prefixed [node0] / [node1]. Exit status: the first failing agent's (the other one is then stopped), else 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIMIT=${TWO_NODE_TIMEOUT_S:-1200}
GPUS=""
if [[ ${1:-} == --gpus ]]; then
    GPUS=${2:-}
    shift 2 || { echo "--gpus needs a number" >&2; exit 2; }
fi
if [[ $# -lt 1 ]]; then
    echo "usage: $0 [--gpus N] SCRIPT [ARGS...]" >&2
    exit 2
fi

if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -ra DEVICES <<< "$CUDA_VISIBLE_DEVICES"
else
    DEVICES=()
    count=$($PYTHON -c "import torch; print(torch.cuda.device_count())")
    for ((i = 0; i < count; i++)); do DEVICES+=("$i"); done
fi
GPUS=${GPUS:-${#DEVICES[@]}}
if ! [[ $GPUS =~ ^[0-9]+$ ]] || ((GPUS < 2 || GPUS % 2 || GPUS > ${#DEVICES[@]})); then
    echo "--gpus ${GPUS}: two nodes need an even number of GPUs, at least 2 and at most the ${#DEVICES[@]} visible" >&2
    exit 2
fi
HALF=$((GPUS / 2))

exports=$($PYTHON benchmarks/torchrun_setup.py --links two-node)
eval "$exports"
PORT=$($PYTHON -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

PIDS=()
stop_agents() {
    for pid in "${PIDS[@]}"; do
        [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null || true
    done
}
trap stop_agents EXIT INT TERM

for node in 0 1; do
    devices=$(IFS=,; echo "${DEVICES[*]:$((node * HALF)):HALF}")
    CUDA_VISIBLE_DEVICES=$devices NCCL_HOSTID=nvfp4-local-node$node \
        timeout -k 30 "$LIMIT" "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc-per-node "$HALF" \
        --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" \
        --rdzv-id "two-node-local-$PORT" --rdzv-conf "is_host=$((node == 0 ? 1 : 0))" "$@" \
        > >(sed -u "s/^/[node$node] /") 2>&1 &
    PIDS+=("$!")
done

status=0
running=2
while ((running)); do
    for index in 0 1; do
        pid=${PIDS[$index]}
        [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null || continue
        code=0
        wait "$pid" || code=$?
        PIDS[$index]=""
        running=$((running - 1))
        if ((code != 0 && status == 0)); then
            status=$code
            echo "two_node_local.sh: node$index exited with status $code; stopping the other agent" >&2
            stop_agents
        fi
    done
    ((running)) && sleep 1
done
exit "$status"
