#!/usr/bin/env bash
# Wheels that a GPU machine without network needs for tools/device_check.sh (it has torch, Triton and an
# older transformers, no gguf): downloaded here into .whl/ (ignored by git), carried with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl gguf==0.19.0 transformers==5.23.0 "setuptools==80.9.0"
ls -la .whl
