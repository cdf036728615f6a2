#!/usr/bin/env bash
# The one command a session with a GPU machine runs (docs/gpu.md, "Checking it on a GPU"):
# phalanx's dependencies from carried wheels, then the GPU checks, each under a time limit of
# its own so that one that hangs leaves the others their time. Run from the repository root
# there, with build/gpu-wheels carried (`make gpu-wheels` here first; the machine has torch,
# numpy, xxhash, fsspec, uvloop, PyYAML, rich and prometheus-client):
#
#   bash bench/gpu_run.sh                   # every step below, at most 12 minutes (about 7 on an H200)
#   STEPS=node bash bench/gpu_run.sh        # a rerun of some steps
#   PHASES=b STEPS=bench BENCH_ARGS="--generations 4" bash bench/gpu_run.sh
#
# Steps, in order (STEPS, comma-separated):
#   tests  the GPU tests of the runtime (test_gpu.py, device groups, placement)
#   bench  bench/gpu.py's phases (PHASES, default b,a,c,d: NCCL generations first; d, the
#          ported DDP script on NCCL, about a minute on an H200)
#   node   the agent's real NVML (test_nvml.py's GPU test) and bench/gpu_node.py
#   snapshot  (only when named) bench/snapshot.py's rounds on the machine's CPU cores: W's
#          4 CPU ranks on 16 cores, which the 2-core VM's drift cannot resolve (issue 28;
#          about 4 minutes on an H200's 16 cores), with SNAPSHOT_ARGS (default --pin-cpus:
#          unpinned, the H200's step times varied 22 % between runs, 2026-11-28)
#
# Everything it writes is under $OUT (the device tool brings that folder back): device.txt,
# tests.log, bench.log (its last line is the bench's JSON), node-tests.log, gpu_node.log
# and RESULTS.md (with the sections the benches appended).
set -uo pipefail
OUT=${OUT:-/tmp/phalanx-gpu-out}
STEPS=",${STEPS:-tests,bench,node},"
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

{ nvidia-smi -L; nproc; python3 -c 'import torch; print("torch", torch.__version__, "CUDA",
torch.version.cuda, "NCCL", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))'; } \
    > "$OUT/device.txt" 2>&1
df -h /dev/shm /tmp >> "$OUT/device.txt" 2>&1  # agents keep snapshots in /dev/shm
lscpu >> "$OUT/device.txt" 2>&1  # cores, hyperthreads and caches: what pinning works with
cat "$OUT/device.txt"
status=0
# Meant to load only the two plugins the tests use, the image's own (xdist, cov, benchmark
# ...) being built for its pytest, not the carried one. On the H200 (2026-11-27) pytest 9.2
# listed the image's plugins as loaded all the same, and they did no harm.
pytest() {
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -p pytest_asyncio.plugin -p pytest_timeout \
        -p no:cacheprovider -q -rs --timeout 60 "$@"
}

if [[ $STEPS == *,tests,* ]]; then
    echo "== tests"
    timeout 90 pytest tests/unit/runtime/test_gpu.py tests/unit/runtime/test_device_group.py \
        tests/unit/runtime/test_placement.py 2>&1 | tee "$OUT/tests.log" || status=1
fi
if [[ $STEPS == *,bench,* ]]; then
    echo "== bench/gpu.py"
    timeout 570 python3 bench/gpu.py --phases "${PHASES:-b,a,c,d}" ${BENCH_ARGS:-} \
        --phase-timeouts a=150,b=90,c=170,d=150 2>&1 | tee "$OUT/bench.log" || status=1
fi
if [[ $STEPS == *,node,* ]]; then
    echo "== node"
    timeout 30 pytest tests/unit/services/agent/test_nvml.py 2>&1 \
        | tee "$OUT/node-tests.log" || status=1
    timeout 75 python3 bench/gpu_node.py --polls 100 --faults 10 2>&1 \
        | tee "$OUT/gpu_node.log" || status=1
fi
if [[ $STEPS == *,snapshot,* ]]; then
    echo "== bench/snapshot.py (CPU ranks, the GPU hidden)"
    CUDA_VISIBLE_DEVICES= timeout 420 python3 bench/snapshot.py --repeat 3 --no-tiers \
        ${SNAPSHOT_ARGS---pin-cpus} 2>&1 \
        | tee "$OUT/snapshot.log" || status=1
fi
cp bench/RESULTS.md "$OUT/RESULTS.md"
exit $status
