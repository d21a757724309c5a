#!/usr/bin/env bash
# One run on a lent GPU machine (torch + CUDA + Triton there, no network): install the project from the
# carried wheels (tools/device_wheels.sh), run the CUDA-parametrised tests, the demo on the GPU and
# benchmarks/cuda_decode.py; every log under $OUT. Budget: well under 10 minutes on one H100/H200.
#
#   run(command="bash tools/device_check.sh", carry=[".whl"], timeout_s=580)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
# CC=false: the C extensions (CPU kernels) are optional and not what this run measures
CC=false python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

echo "== CUDA tests"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -k "cuda or triton" \
  tests/test_runtime_dequant.py tests/test_runtime_files.py tests/test_runtime_memory.py \
  tests/test_runtime_parity.py $(ls tests/test_triton_*.py tests/test_cuda_*.py 2>/dev/null) \
  2>&1 | tee "$OUT/cuda_tests.log" | tail -n 25

echo "== demo on the GPU"
timeout 90 specconv demo --device cuda 2>&1 | tee "$OUT/demo.log" | tail -n 15

echo "== benchmarks/cuda_decode.py"
timeout 200 python3 benchmarks/cuda_decode.py --workdir /tmp/bench-cuda --json "$OUT/cuda_decode.json" \
  2>&1 | tee "$OUT/cuda_decode.log" | tail -n 12
