#!/usr/bin/env bash
# The one command a session with a GPU machine runs (docs/gpu.md, "Checking it on a GPU"):
# phalanx's dependencies from carried wheels, the GPU tests, then bench/gpu.py. Run from the
# repository root there, with build/gpu-wheels carried (`make gpu-wheels` here first; the
# machine has torch, numpy, xxhash, fsspec, uvloop, PyYAML, rich and prometheus-client):
#
#   bash bench/gpu_run.sh                      # tests, then the three phases (~6 minutes)
#   PHASES=b bash bench/gpu_run.sh             # a rerun of one phase, tests skipped
#   NODE_BENCH=1 bash bench/gpu_run.sh         # bench/gpu_node.py alone (~2 minutes)
#
# Everything it writes is under $OUT (the device tool brings that folder back): device.txt,
# tests.log, bench.log (its last line is the bench's JSON) and RESULTS.md.
set -uo pipefail
OUT=${OUT:-/tmp/phalanx-gpu-out}
mkdir -p "$OUT"
SITE=/tmp/phalanx-site

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" build/gpu-wheels/*.whl || exit 1
# phalanx itself: its folders are the subpackages of the phalanx namespace (pyproject's
# package-dir), linked rather than built, so nothing depends on the machine's setuptools.
mkdir -p "$SITE/phalanx"
for package in schemas bus services runtime bench examples; do
    ln -sfn "$PWD/$package" "$SITE/phalanx/$package"
done
export PYTHONPATH="$SITE" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1

{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "CUDA",
torch.version.cuda, "NCCL", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))'; } \
    > "$OUT/device.txt" 2>&1
df -h /dev/shm /tmp >> "$OUT/device.txt" 2>&1  # agents keep snapshots in /dev/shm
cat "$OUT/device.txt"

if [ -n "${NODE_BENCH:-}" ]; then  # the agent's NVML view, health poll, injected GPU faults
    timeout 60 python3 -m pytest -p no:cacheprovider -q -rs tests/unit/services/agent/test_nvml.py \
        2>&1 | tee "$OUT/tests.log"
    timeout 240 python3 bench/gpu_node.py 2>&1 | tee "$OUT/gpu_node.log"
    cp bench/RESULTS.md "$OUT/RESULTS.md"
    exit 0
fi
if [ -z "${PHASES:-}" ]; then
    timeout 120 python3 -m pytest -p no:cacheprovider -q -x \
        tests/unit/runtime/test_gpu.py tests/unit/runtime/test_device_group.py \
        tests/unit/runtime/test_placement.py 2>&1 | tee "$OUT/tests.log"
fi
timeout 440 python3 bench/gpu.py --phases "${PHASES:-a,b,c}" --phase-timeouts a=180,b=90,c=150 \
    2>&1 | tee "$OUT/bench.log"
cp bench/RESULTS.md "$OUT/RESULTS.md"
