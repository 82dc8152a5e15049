#!/usr/bin/env bash
# nvfp4-train with Megatron-Core on 2 GPUs, under torchrun and under mpirun.
#
#   bash tests_multigpu/run_train_gpu.sh            # in the repo root, on a machine with >= 2 GPUs
#
# Needs megatron-core: importable already, or its wheel in .whl/ (bash tests_multigpu/fetch_wheels.sh on
# the CPU machine; carry ".whl"). Installs this checkout (pip -e, no deps) when nvfp4_dist is not importable.
# Runs, each a GPTModel with the NVFP4 spec at TP=2 and sequence parallelism:
#   1. torchrun --nproc-per-node 2, overlap on, 60 steps with checkpoints, then resumed to 80 steps;
#   2. mpirun -np 2 through python -m nvfp4_dist.launch.mpi, first/last layer in BF16, 40 steps;
#   3. mpirun -np 2 nvfp4-train (MPI detected from the environment), 20 steps;
#   4. two torchrun node agents on this host over loopback (c10d rendezvous, one GPU each), 20 steps.
# Checks per run: exit 0, every loss finite, the loss falls by more than 1.0 (byte-level, from ~5.5),
# the resumed run continues at step 61. Prints a table; exits non-zero on any failure.
# Output under $OUT (default out/train_gpu): each run's train.log, metrics.jsonl, checkpoints.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/train_gpu}
rm -rf "$OUT" && mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if ! python3 -c "import megatron.core" 2>/dev/null; then
    ls .whl/megatron_core-*.whl >/dev/null 2>&1 || { echo "megatron-core missing: run tests_multigpu/fetch_wheels.sh and carry .whl"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import nvfp4_dist.launch.train" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
python3 -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, '| torch', torch.__version__, '|', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"

MODEL=(--model megatron --tp 2 --sp --layers 4 --hidden 512 --heads 8 --seq-length 512 --micro-batch 8
       --lr 1e-3 --min-lr 1e-4 --warmup-steps 10 --log-every 10 --no-progress --watchdog-timeout 300)
failures=0
declare -a rows

check() {  # name, exit code, out dir, expected first step, expected last step
    local name=$1 code=$2 dir=$3 first=$4 last=$5 verdict
    verdict=$(python3 - "$dir/metrics.jsonl" "$first" "$last" <<'EOF'
import json, math, sys
path, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    records = [json.loads(line) for line in open(path)]
except OSError as error:
    print(f"FAIL no metrics ({error})"); sys.exit()
records = [r for r in records if r["step"] >= first]
losses = [r["loss"] for r in records]
problems = []
if [r["step"] for r in records] != list(range(first, last + 1)):
    problems.append(f"steps {records[0]['step'] if records else None}..{records[-1]['step'] if records else None}")
if any(loss is None or not math.isfinite(loss) for loss in losses):
    problems.append("non-finite loss")
elif first == 1 and not losses[-1] < losses[0] - 1.0:
    problems.append(f"loss did not fall enough ({losses[0]:.3f} -> {losses[-1]:.3f})")
tokens = sorted(r["tokens_per_s"] for r in records[1:])
summary = (f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, median {tokens[len(tokens) // 2]:,.0f} tok/s, "
           f"peak {max(r['memory_mb'] for r in records):,.0f} MB") if losses and tokens else ""
print(("FAIL " + "; ".join(problems) + " | " if problems else "ok | ") + summary)
EOF
)
    [[ $code -ne 0 ]] && verdict="FAIL exit code $code | $verdict"
    [[ $verdict == FAIL* ]] && failures=$((failures + 1))
    rows+=("$(printf '%-34s %s' "$name" "$verdict")")
}

echo "== 1. torchrun, overlap on (every layer of this small model pipelined: no minimum ring-step size, links ignored)"
export NVFP4_OVERLAP_MIN_CHUNK_GFLOPS=0 NVFP4_OVERLAP_IGNORE_LINKS=1
torchrun --standalone --nproc-per-node 2 -m nvfp4_dist.launch.train "${MODEL[@]}" --overlap \
    --steps 60 --save-every 30 --out-dir "$OUT/torchrun"
check "torchrun tp2 sp overlap (1-60)" $? "$OUT/torchrun" 1 60
torchrun --standalone --nproc-per-node 2 -m nvfp4_dist.launch.train "${MODEL[@]}" --overlap \
    --steps 80 --save-every 30 --out-dir "$OUT/torchrun" | tee "$OUT/torchrun_resume.txt"
code=${PIPESTATUS[0]}
grep -q "resumed from the step-60 checkpoint" "$OUT/torchrun_resume.txt" || code=9
check "torchrun resumed (61-80)" $code "$OUT/torchrun" 61 80

echo "== 2. mpirun + nvfp4_dist.launch.mpi, first/last layer BF16"
mpirun -np 2 --bind-to none -x PYTHONPATH -x PATH \
    python3 -m nvfp4_dist.launch.mpi -m nvfp4_dist.launch.train "${MODEL[@]}" \
    --bf16-first-layers 1 --bf16-last-layers 1 --steps 40 --save-every 40 --out-dir "$OUT/mpirun"
check "mpirun launch.mpi bf16 first/last" $? "$OUT/mpirun" 1 40

echo "== 3. mpirun nvfp4-train (MPI from the environment)"
mpirun -np 2 --bind-to none -x PYTHONPATH -x PATH \
    python3 -m nvfp4_dist.launch.train "${MODEL[@]}" --steps 20 --save-every 0 --lr 3e-3 --out-dir "$OUT/mpirun_direct"
code=$?
check "mpirun nvfp4-train direct" $code "$OUT/mpirun_direct" 1 20

echo "== 4. two torchrun node agents over loopback (one GPU each), the multi-node recipe"
port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
for node in 0 1; do
    CUDA_VISIBLE_DEVICES=$node NNODES=2 NPROC_PER_NODE=1 RDZV_ENDPOINT=127.0.0.1:$port RDZV_ID=loopback \
        PYTHON=python3 bash launch/torchrun_multinode.sh "${MODEL[@]}" --steps 20 --save-every 20 --lr 3e-3 \
        --out-dir "$OUT/two_agents" > "$OUT/two_agents_node$node.txt" 2>&1 &
    pids[$node]=$!
done
code=0
for node in 0 1; do wait "${pids[$node]}" || code=$?; done
cat "$OUT/two_agents_node0.txt"
grep -q "2 processes on 2 node(s)" "$OUT/two_agents_node0.txt" "$OUT/two_agents_node1.txt" || code=9
check "torchrun 2 agents x 1 GPU" $code "$OUT/two_agents" 1 20

echo
echo "nvfp4-train on $(python3 -c 'import torch; print(torch.cuda.get_device_name(0))') x2, Megatron-Core GPTModel + NVFP4 spec"
printf '%s\n' "${rows[@]}"
[[ $failures -eq 0 ]] && echo "all runs passed" || echo "$failures run(s) failed"
exit $((failures > 0))
