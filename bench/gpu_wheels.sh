#!/usr/bin/env bash
# The wheels the GPU machine lacks, downloaded into .whl/ (ignored by git) for its Python 3.12 on
# x86-64, then their total size. The lent GPU machine has torch, triton, nvcc, transformers (too old),
# pytest with xdist and most common packages, and no registry; a device call carries at most 64 MiB
# of working tree, so this fails when the wheels pass WHEEL_BUDGET_MIB (the rest is the checkout).
# bench/gpu_acceptance.py installs them there. Versions are the ones the CPU venv runs.
#
# Last, FlashInfer's kernels for sm_90a, built here (bench/flashinfer_aot.py: minutes per module the
# first time, seconds once .cache/flashinfer_aot holds them), packed as the flashinfer_jit_cache wheel.
#
#   bash bench/gpu_wheels.sh            # from the repository root, with .venv made (make install)
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.whl
WHEEL_BUDGET_MIB=${WHEEL_BUDGET_MIB:-48}
PYTHON=${PYTHON:-.venv/bin/python}

# vlmrun itself on the machine's torch: transformers >= 5.20 (and the regex it asks for), xgrammar,
# qwen-vl-utils (its `av` is for videos only and too large to carry: the video tests fail there)
ENGINE=(transformers==5.24.0 regex==2026.11.19 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
        qwen-vl-utils==0.0.14 typing_extensions==4.16.0)
# the server and its tests: fastapi 0.165 imports opentelemetry-api; openai 3.x runs on httpx2
SERVER=(fastapi==0.165.0 starlette==1.10.0 annotated-doc pydantic==2.14.4 pydantic_core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 opentelemetry-api==1.45.2
        openai==3.57.0 jiter==0.19.0 anyio==4.16.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20
        jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)
# the CUDA fast path (the `gpu` extra): FlashInfer imports requests at import time (fused_moe ->
# artifacts); its cudnn-frontend and cutlass-dsl (CuTe kernels) are optional at import and unused
# by the paged prefill/decode kernels, and cutlass-dsl alone is larger than the whole budget
FAST_PATH=(flashinfer-python==0.6.4 fla-core==0.6.0 flash-linear-attention==0.6.0 requests==2.34.2)

rm -rf "$DEST" && mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" \
  "${ENGINE[@]}" "${SERVER[@]}" "${FAST_PATH[@]}"

# FlashInfer imported from a folder of its own, not the venv: the CPU test suite sees no flashinfer
AOT_SITE=.cache/flashinfer_aot/site
"$PYTHON" -m pip install -q --no-deps --no-compile --upgrade --target "$AOT_SITE" "$DEST"/flashinfer_python-*.whl \
  nvidia-ml-py==13.615.71 tabulate==0.10.0
PYTHONPATH="$AOT_SITE:$PWD" nice -n 19 "$PYTHON" -m bench.flashinfer_aot --wheel-dir "$DEST"

total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
count=$(ls "$DEST"/*.whl | wc -l)
printf '%d wheels in %s: %.1f MiB (budget %d MiB)\n' "$count" "$DEST" "$(echo "$total / 1048576" | bc -l)" \
  "$WHEEL_BUDGET_MIB"
if [ "$total" -gt $((WHEEL_BUDGET_MIB * 1048576)) ]; then
  echo "over the budget: a device call carries 64 MiB with the checkout" >&2
  exit 1
fi
