#!/usr/bin/env bash
# The decode step's attention kernels on one GPU (about 3 minutes on an H200): their tests, GPU-only
# ones included (2b-sized shapes, CUDA-graph replay at new positions), then the 2b probe
# (benchmarks/probes/decode_attention.py: each op against torch from a CUDA graph, batch 1/4/16, and a
# launch-config sweep). Results under OUT_DIR: decode_attention.csv, decode_attention_sweep.csv, logs.
# Usage: bash benchmarks/decode_attention.sh OUT_DIR
set -uo pipefail
out=${1:?usage: bash benchmarks/decode_attention.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attn_proj.py \
  tests/kernels/test_decode_attention.py tests/ops/test_decode_attention.py > "$out/decode_attention_tests.log" 2>&1
echo "tests (rc $?): $(tail -n 1 "$out/decode_attention_tests.log")"
grep -E "^(FAILED|ERROR)" "$out/decode_attention_tests.log" | head -n 20
timeout 200 python3 benchmarks/probes/decode_attention.py "$out" > "$out/decode_attention_probe.log" 2>&1
echo "probe (rc $?):"
tail -n 40 "$out/decode_attention_probe.log"
