#!/usr/bin/env bash
# Download the wheels the GPU machines lack into .whl/ (git-ignored; carried to the GPU machine).
#   bash tests_multigpu/fetch_wheels.sh          # run on the CPU machine, in the repo root
# megatron-core 0.19.2 needs only torch, numpy and packaging, which the GPU image already has.
# On the GPU machine (run's carry=[".whl"]), before anything that imports megatron:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl megatron-core==0.19.2
# Keep one version of each wheel: two stop the install on the GPU machine.
ls .whl/megatron_core-*.whl | grep -v 'megatron_core-0.19.2-' | xargs -r rm -f
echo "wheels in .whl/:"; ls -la .whl/
echo "requirements of megatron-core (all present on the GPU image):"
unzip -p .whl/megatron_core-0.19.2-*.whl '*/METADATA' | grep '^Requires-Dist' | grep -v extra || true
