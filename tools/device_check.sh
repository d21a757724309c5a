#!/usr/bin/env bash
# One run on a lent GPU machine (torch + CUDA + Triton there, no network): install the project from the
# carried wheels (tools/device_wheels.sh), build the benchmark's files on the CPU while the GPU runs the
# CUDA-parametrised tests, then benchmarks/cuda_matmul.py, benchmarks/cuda_decode.py, every family on
# the GPU (tools/cuda_families.py) and the demo; logs under $OUT (at most 8 files come back).
#
#   run(command="bash tools/device_check.sh", carry=[".whl"], timeout_s=580)
#   run(command="TYPES=q8_0 TESTS=tests/runtime/test_cuda_graphs.py bash tools/device_check.sh", ...)  # a narrower run
#
# TYPES: the dense 1 B file types to measure (default q8_0,Q4_K_M,bf16); MOE=0 skips the MoE file;
# N: tokens decoded per rate measurement (default 64); TESTS: the test paths (default: every test,
# -k "(cuda or triton) and not triton_compile": compiling without a GPU is the CPU's check); JOBS:
# pytest workers; T_ROWS (benchmarks/rows_first.py, into setup.log) / T_TESTS / T_MATMUL / T_VARIANTS
# (benchmarks/cuda_matmul_variants.py, off unless given) / T_BENCH / T_FAMILIES / T_DEMO: time
# limits in seconds (0 skips that step); NATIVE=0 skips building the C extensions (a faster install:
# the GPU path needs none of them, the K-quant files' conversion does).
#
# Every step at its default limit takes more than one command may; a session's 15 device minutes (a
# start costs about 30 s) hold two runs (measured on an H200, 2026-11-28: the 730 tests take about
# 210 s on 14 workers; building the 1 B q8_0 file about 100 s of the CPU, beside the GPU's work):
#   run(command="NATIVE=0 T_BENCH=0 T_MATMUL=0 T_TESTS=250 T_FAMILIES=90 T_DEMO=60 bash tools/device_check.sh",
#       carry=[".whl"], timeout_s=440)
#   run(command="NATIVE=0 T_TESTS=0 T_FAMILIES=0 T_DEMO=0 TYPES=q8_0 MOE=0 T_MATMUL=90 T_BENCH=180
#       bash tools/device_check.sh", carry=[".whl"], timeout_s=330)
# (the first: the tests, every family, the demo; the second: the product alone and the decode benchmark);
# BENCH_ARGS: more arguments for benchmarks/cuda_decode.py; MATMUL_ARGS: benchmarks/cuda_matmul.py's
# (default --sweep). Failing tests are written to
# $OUT/failures.log as they are reported (SPECCONV_FAILURE_LOG), and the test run is interrupted at its
# limit with SIGINT, so pytest still prints its summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START )) s] $*"; }
SETUP="$OUT/setup.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
# the C extensions are optional (install goes on without them) but the benchmark's K-quant conversion
# wants them; built in parallel
printf '[build_ext]\nparallel = 16\n' >/tmp/build_ext.cfg
# NATIVE=0: CC=false for this install only (Triton compiles its launcher with $CC when it first runs)
NO_CC=$([ "${NATIVE:-1}" = 0 ] && echo "CC=false")
env $NO_CC DIST_EXTRA_CONFIG=/tmp/build_ext.cfg python3 -m pip install -q --no-deps --no-build-isolation -e . \
  >"$SETUP" 2>&1 || { tail "$SETUP"; exit 1; }
python3 -c "import specconv.convert._kquants, specconv.runtime._dequant; print('native extensions built')" 2>&1 | tee -a "$SETUP"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$SETUP"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$SETUP"
stamp installed
# the device-side rows-first rearrangement of Q8_0 at load, against a copy of the same bytes (seconds)
[ "${T_ROWS:-20}" != 0 ] && timeout "${T_ROWS:-20}" python3 benchmarks/rows_first.py --device cuda \
  --shape 16384x4096 2>&1 | tee -a "$SETUP"

TYPES=${TYPES:-q8_0,Q4_K_M,bf16}
MOE_FLAG=$([ "${MOE:-1}" = 0 ] && echo --no-moe)
BENCH=(python3 benchmarks/cuda_decode.py --workdir /tmp/bench-cuda --types "$TYPES" -n "${N:-64}" $MOE_FLAG ${BENCH_ARGS:-})
if [ "${T_BENCH:-200}" != 0 ]; then
  "${BENCH[@]}" --build-only >/tmp/build.log 2>&1 &
  BUILD=$!
fi

if [ "${T_TESTS:-200}" != 0 ]; then
  stamp "CUDA tests"
  SPECCONV_FAILURE_LOG="$OUT/failures.log" timeout -s INT -k 20 "${T_TESTS:-200}" python3 -m pytest -q \
    -p no:cacheprovider -p no:benchmark -n "${JOBS:-12}" -k "(cuda or triton) and not triton_compile" --tb=short \
    -rfE --durations=15 ${TESTS:-tests} >"$OUT/cuda_tests.log" 2>&1
  tail -n 30 "$OUT/cuda_tests.log"
fi

if [ "${T_MATMUL:-60}" != 0 ]; then
  stamp "benchmarks/cuda_matmul.py"
  timeout "${T_MATMUL:-60}" python3 benchmarks/cuda_matmul.py ${MATMUL_ARGS:---sweep} >"$OUT/cuda_matmul.log" 2>&1
  tail -n 36 "$OUT/cuda_matmul.log"
fi

if [ "${T_VARIANTS:-0}" != 0 ]; then
  stamp "benchmarks/cuda_matmul_variants.py"
  timeout "${T_VARIANTS}" python3 benchmarks/cuda_matmul_variants.py --json "$OUT/variants.json" >"$OUT/variants.log" 2>&1
  tail -n 40 "$OUT/variants.log"
fi

if [ "${T_BENCH:-200}" != 0 ]; then
  stamp "waiting for the benchmark's files"
  wait $BUILD; tail -n 6 /tmp/build.log | tee -a "$SETUP"
  stamp "benchmarks/cuda_decode.py"
  timeout "${T_BENCH:-200}" "${BENCH[@]}" --json "$OUT/cuda_decode.json" >"$OUT/cuda_decode.log" 2>&1
  tail -n 8 "$OUT/cuda_decode.log"
fi

if [ "${T_FAMILIES:-90}" != 0 ]; then
  stamp "tools/cuda_families.py"
  timeout "${T_FAMILIES:-90}" python3 tools/cuda_families.py --json "$OUT/cuda_families.json" >"$OUT/cuda_families.log" 2>&1
  grep -v "^\[transformers\]" "$OUT/cuda_families.log" | tail -n 34
fi

if [ "${T_DEMO:-90}" != 0 ]; then
  stamp "demo on the GPU"
  timeout "${T_DEMO:-90}" specconv demo --device cuda >"$OUT/demo.log" 2>&1; echo "demo exit $?"
  tail -n 6 "$OUT/demo.log"
fi
stamp done
