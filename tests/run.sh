#!/usr/bin/env bash
# The project's test command (README command 2). Installs everything the tests need from the
# project's own files, then runs the whole suite with the llama.cpp peer checks made mandatory.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
"$PY" -m pip install -q torch==2.13.0
# llama-cpp-python 0.3.36 has no wheel: pip compiles it once (about 7 minutes on 2 cores) and
# keeps the wheel in its cache for later runs.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
"$PY" -m pip install -q -e ".[test,peers]"

# llama.cpp's own converter (from the same sdist, used as an external tool by the peer tests).
SRC_CACHE="${SPECCONV_CACHE:-$HOME/.cache/specconv}"
if [ -z "${SPECCONV_LLAMA_CPP_SRC:-}" ]; then
  tree="$SRC_CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp"
  if [ ! -f "$tree/convert_hf_to_gguf.py" ]; then
    mkdir -p "$SRC_CACHE"
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$SRC_CACHE" llama-cpp-python==0.3.36
    tar -xzf "$SRC_CACHE/llama_cpp_python-0.3.36.tar.gz" -C "$SRC_CACHE"
  fi
  export SPECCONV_LLAMA_CPP_SRC="$tree"
fi

# The oldest Triton the CUDA kernels are held to (kernels_triton.MIN_TRITON), in a folder of its own
# (cached), for tests/runtime/test_triton_floor.py: the kernels compiled under it as well as under the
# newest release the test extras install.
FLOOR=$("$PY" -c "from specconv.runtime.kernels_triton._common import MIN_TRITON; print('.'.join(map(str, MIN_TRITON)))")
TRITON_FLOOR_DIR="$SRC_CACHE/triton-$FLOOR"
if [ ! -f "$TRITON_FLOOR_DIR/triton/__init__.py" ]; then
  rm -rf "$TRITON_FLOOR_DIR.partial"
  "$PY" -m pip install -q --no-deps --target "$TRITON_FLOOR_DIR.partial" "triton==$FLOOR.*"
  mv "$TRITON_FLOOR_DIR.partial" "$TRITON_FLOOR_DIR"
fi
export SPECCONV_TRITON_FLOOR="$TRITON_FLOOR_DIR" SPECCONV_REQUIRE_TRITON_FLOOR=1

# llama.cpp's quantize and imatrix tools, built from the same sdist on first use (about 8 minutes
# of CPU, cached in $SRC_CACHE) for the --imatrix whole-file tests.
export SPECCONV_BUILD_LLAMA_TOOLS=1
export SPECCONV_REQUIRE_PEERS=1 SPECCONV_REQUIRE_NATIVE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
# Every test runs on one thread, so one pytest-xdist worker per core (SPECCONV_TEST_JOBS sets the
# count, 0 runs in this process); a module's tests stay on one worker and share its fixtures. Each
# test's printed measurements reach the terminal through SPECCONV_ECHO_OUTPUT (xdist hides -s).
export SPECCONV_ECHO_OUTPUT=1
exec "$PY" -m pytest -q -n "${SPECCONV_TEST_JOBS:-auto}" --dist loadfile "$@"
