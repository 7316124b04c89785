#!/usr/bin/env bash
# Two calls on the H200. `probe`: where a captured decode step's time goes (benchmarks/probe_decode_step.py,
# batch 1 and 4) and `bench decode` (MLP level). `model`: `bench decode-model` (whole model, HF and fused
# norms/RoPE, peak memory) and the prefill rows of `bench e2e` (8 and 32 sequences of 2048, peak memory).
# Results under $OUT. Usage: bash benchmarks/run_h200_session9.sh GIT_SHA probe|model
set -uo pipefail
sha=${1:-unknown}
part=${2:-probe}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$part" = probe ]; then
  timeout 200 python3 benchmarks/probe_decode_step.py "$out/results/decode_step_$sha.csv" 1,4 > "$out/probe.log" 2>&1
  grep -E "batch|Error|error" "$out/probe.log" | tail -20
  timeout 250 python3 -m sparseffn bench decode --git-sha "$sha" --out-dir "$out/results" > "$out/decode.log" 2>&1
  grep -E "^D=|Error|error" "$out/decode.log" | tail -22
else
  timeout 300 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" --eager-tokens 32 \
    > "$out/decode_model.log" 2>&1
  grep -E "batch|Error|error" "$out/decode_model.log" | tail -12
  timeout 250 bash benchmarks/run_h200_e2e.sh "$sha" batches=8,32 2>&1 | tail -12
fi
