#!/usr/bin/env bash
# Two calls on the H200. `tests`: GPU tests of the decode kernels and captured generation, then
# `bench decode-model` (whole model, HF and fused norms/RoPE). `mlp`: `bench decode` (MLP level) and
# the prefill peak-memory rows of `bench e2e` (8 and 32 sequences of 2048). Results under $OUT.
# Usage: bash benchmarks/run_h200_session8.sh GIT_SHA tests|mlp
set -uo pipefail
sha=${1:-unknown}
part=${2:-tests}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$part" = tests ]; then
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_generate.py tests/kernels/test_decode_mlp.py \
    2>&1 | tail -4
  timeout 330 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" --eager-tokens 32 \
    > "$out/decode_model.log" 2>&1
  grep -E "batch|Error|error" "$out/decode_model.log" | tail -12
else
  timeout 220 python3 -m sparseffn bench decode --git-sha "$sha" --out-dir "$out/results" > "$out/decode.log" 2>&1
  grep -E "^D=|Error|error" "$out/decode.log" | tail -22
  timeout 250 bash benchmarks/run_h200_e2e.sh "$sha" batches=8,32 2>&1 | tail -12
fi
