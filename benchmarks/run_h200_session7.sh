#!/usr/bin/env bash
# One call on the H200: GPU tests of the decode kernels and captured generation, where a decode
# call's time goes, `bench decode` (MLP level) and `bench decode-model` (whole model, HF and fused
# norms/RoPE). Results under $OUT. Usage: bash benchmarks/run_h200_session7.sh GIT_SHA
set -uo pipefail
sha=${1:-unknown}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_mlp.py tests/models/test_generate.py \
  2>&1 | tail -3
timeout 60 python3 benchmarks/probe_decode_parts.py "$out/decode_parts.csv" 2>&1 | grep -v Warn | \
  python3 -c "import sys, ast; [print({k: v for k, v in ast.literal_eval(l).items() if k not in ('gpu', 'torch', 'triton', 'git_sha')}) for l in sys.stdin if l.startswith('{')]"
timeout 200 python3 -m sparseffn bench decode --git-sha "$sha" --out-dir "$out/results" 2>&1 | grep -E "^D=|Error|error" | tail -22
timeout 280 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" --eager-tokens 32 \
  2>&1 | grep -E "batch|Error|error" | tail -12
