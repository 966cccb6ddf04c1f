#!/usr/bin/env bash
# The GPU check, run as it is on a machine with a CUDA GPU, from the repository root:
#
#     bash benchmarks/gpu_check.sh
#
# 1. the CUDA tests (the emulator on CUDA computes what it computes on the CPU; host syncs per
#    training call against native torch), then
# 2. benchmarks/gpu.py at the GPU sizes: the MNIST CNN, ResNet-50 at 224x224 and a BERT-base
#    sized encoder, float32 and float16, native torch against the PopTorch program and
#    Loop.fit. It writes benchmarks/gpu_cuda.json and its table, gpu_cuda.md.
#
# Under 8 minutes: the tests get 2, the benchmark starts no new workload after 5 and is
# stopped at 5.5. Environment: PYTHON (default python), GPU_CHECK_DEVICE (cuda),
# GPU_CHECK_PRESET (gpu), GPU_CHECK_OUT (benchmarks/gpu_<device>.json), GPU_CHECK_ARGS (more
# arguments for gpu.py, e.g. "--resnet resnet18-32" where memory is short). CI runs it with
# GPU_CHECK_DEVICE=cpu GPU_CHECK_PRESET=tiny so that it cannot rot while no GPU is at hand.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PRESET=${GPU_CHECK_PRESET:-gpu}
OUT=${GPU_CHECK_OUT:-benchmarks/gpu_${DEVICE}.json}
export IPULOOP_BACKEND=emulator
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no CUDA device')"
fi

echo "== CUDA tests"
tests=0  # a failure is reported at the end: the benchmark still runs
timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/loop/test_cuda.py tests/loop/test_host_syncs.py ||
    tests=$?

echo "== benchmarks/gpu.py ($DEVICE, preset $PRESET)"
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of arguments
timeout 330 "$PYTHON" benchmarks/gpu.py --device "$DEVICE" --preset "$PRESET" \
    --budget-s 300 --out "$OUT" ${GPU_CHECK_ARGS:-}
echo "== done: $OUT"
if [ "$tests" != 0 ]; then
    echo "the CUDA tests failed (status $tests): see above" >&2
    exit "$tests"
fi
