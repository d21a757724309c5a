#!/usr/bin/env bash
# One run on a lent GPU machine (torch + CUDA + Triton there, no network): install the project from the
# carried wheels (tools/device_wheels.sh), build the benchmark's files on the CPU while the GPU runs the
# CUDA-parametrised tests, then the demo on the GPU and benchmarks/cuda_decode.py; every log under $OUT.
#
#   run(command="bash tools/device_check.sh", carry=[".whl"], timeout_s=580)
#   run(command="TYPES=q8_0 TESTS=tests/test_cuda_graphs.py bash tools/device_check.sh", ...)  # a narrower run
#
# TYPES: the dense 1 B file types to measure (default q8_0,Q4_K_M,bf16); MOE=0 skips the MoE file;
# N: tokens decoded per rate measurement (default 64); TESTS: the test paths (default: every test, -k "cuda or triton"); T_TESTS / T_MATMUL / T_DEMO / T_BENCH: time limits (s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
# the C extensions are optional (install goes on without them) but the benchmark's K-quant conversion wants them
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
python3 -c "import specconv.convert._kquants, specconv.runtime._dequant; print('native extensions built')" 2>&1 | tee -a "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
stamp installed

TYPES=${TYPES:-q8_0,Q4_K_M,bf16}
MOE_FLAG=$([ "${MOE:-1}" = 0 ] && echo --no-moe)
BENCH=(python3 benchmarks/cuda_decode.py --workdir /tmp/bench-cuda --types "$TYPES" -n "${N:-64}" $MOE_FLAG)
"${BENCH[@]}" --build-only >"$OUT/build.log" 2>&1 &
BUILD=$!

stamp "CUDA tests"
timeout "${T_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider -n "${JOBS:-12}" -k "cuda or triton" --tb=short -rfE \
  --durations=15 ${TESTS:-tests} >"$OUT/cuda_tests.log" 2>&1
tail -n 40 "$OUT/cuda_tests.log"

stamp "benchmarks/cuda_matmul.py"
timeout "${T_MATMUL:-60}" python3 benchmarks/cuda_matmul.py --sweep --json "$OUT/cuda_matmul.json" >"$OUT/cuda_matmul.log" 2>&1
tail -n 24 "$OUT/cuda_matmul.log"

stamp "demo on the GPU"
timeout "${T_DEMO:-90}" specconv demo --device cuda >"$OUT/demo.log" 2>&1; echo "demo exit $?"
tail -n 12 "$OUT/demo.log"

stamp "waiting for the benchmark's files"
wait $BUILD; tail -n 6 "$OUT/build.log"
stamp "benchmarks/cuda_decode.py"
timeout "${T_BENCH:-200}" "${BENCH[@]}" --json "$OUT/cuda_decode.json" >"$OUT/cuda_decode.log" 2>&1
tail -n 12 "$OUT/cuda_decode.log"
stamp done
