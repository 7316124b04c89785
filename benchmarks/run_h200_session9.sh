#!/usr/bin/env bash
# One call on the H200, the parts named in PARTS (comma-separated, default probe,model,e2e): `probe`,
# where a captured decode step's time goes (benchmarks/probe_decode_step.py, batch 1 and 4); `model`,
# `bench decode-model` (whole model, HF and fused norms/RoPE, peak memory); `e2e`, the rows of
# `bench e2e` (8 and 32 sequences of 2048, peak memory). Results under $OUT.
# Usage: bash benchmarks/run_h200_session9.sh GIT_SHA [PARTS]
set -uo pipefail
sha=${1:-unknown}
parts=",${2:-probe,model,e2e},"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
nvidia-smi --query-gpu=name --format=csv,noheader
if [[ $parts == *,probe,* ]]; then
  timeout 150 python3 benchmarks/probe_decode_step.py "$out/results/decode_step_$sha.csv" 1,4 > "$out/probe.log" 2>&1
  grep -E "batch|Error|error" "$out/probe.log" | sed -E 's/decisions .*//' | tail -12
fi
if [[ $parts == *,model,* ]]; then
  timeout 400 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" --eager-tokens 32 \
    > "$out/decode_model.log" 2>&1
  grep -E "batch|Error|error" "$out/decode_model.log" | tail -10
fi
if [[ $parts == *,e2e,* ]]; then
  timeout 170 bash benchmarks/run_h200_e2e.sh "$sha" batches=8,32 > "$out/e2e.log" 2>&1
  tail -12 "$out/e2e.log"
fi
