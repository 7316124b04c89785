#!/usr/bin/env bash
# One call on the H200: where a captured decode step's time goes (benchmarks/probe_decode_step.py, batch 1
# and 4), `bench decode-model` (whole model, HF and fused norms/RoPE, peak memory; BATCHES, default
# 1,4,16,64) and, with `e2e`, the rows of `bench e2e` (8 and 32 sequences of 2048, peak memory).
# Results under $OUT. Usage: bash benchmarks/run_h200_session9.sh GIT_SHA [e2e] [BATCHES]
set -uo pipefail
sha=${1:-unknown}
e2e=${2:-}
batches=${3:-1,4,16,64}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/probe_decode_step.py "$out/results/decode_step_$sha.csv" 1,4 > "$out/probe.log" 2>&1
grep -E "batch|Error|error" "$out/probe.log" | tail -12
timeout 250 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" --eager-tokens 32 \
  --batches "$batches" > "$out/decode_model.log" 2>&1
grep -E "batch|Error|error" "$out/decode_model.log" | tail -10
if [ "$e2e" = e2e ]; then
  timeout 170 bash benchmarks/run_h200_e2e.sh "$sha" batches=8,32 > "$out/e2e.log" 2>&1
  tail -12 "$out/e2e.log"
fi
