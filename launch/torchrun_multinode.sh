#!/usr/bin/env bash
# nvfp4-train on several nodes with torchrun's c10d rendezvous. Run the same command on every node:
#
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 bash torchrun_multinode.sh --tp 8 --sp
#
# Arguments go to nvfp4-train. Environment (defaults in brackets):
#   NNODES          nodes in the job [1]
#   NPROC_PER_NODE  processes per node [the GPU count, or 1 without GPUs]
#   RDZV_ENDPOINT   host:port of the rendezvous store, a node every node can reach [127.0.0.1:29400];
#                   the agent on that host serves it
#   RDZV_ID         job id, the same on every node [nvfp4-train]
#   RDZV_TIMEOUT    seconds to wait for all nodes to join [300]
#   PYTHON          the Python that has nvfp4-dist installed [python3]
#   TORCH_CPP_LOG_LEVEL  torch's C++ log level [ERROR: its warnings about a lost peer carry C++ stack traces]
# Any node failing stops the others (--max-restarts 0); nvfp4-train's watchdog names a rank that
# dies or hangs. The agent on RDZV_ENDPOINT's host serves the rendezvous store on every interface of
# that host; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME choose the interface the workers talk over
# (docs/launching.md, "Network exposure").
# Installed with the package: python -c "import nvfp4_dist.launch as l; print(l.__path__[0])"
set -euo pipefail

PYTHON=${PYTHON:-python3}
NNODES=${NNODES:-1}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi
RDZV_ENDPOINT=${RDZV_ENDPOINT:-127.0.0.1:29400}
RDZV_ID=${RDZV_ID:-nvfp4-train}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-300}
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
    --rdzv-conf "join_timeout=$RDZV_TIMEOUT" --max-restarts 0 \
    -m nvfp4_dist.launch.train "$@"
