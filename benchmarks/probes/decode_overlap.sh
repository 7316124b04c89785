#!/usr/bin/env bash
# One GPU call (<= 6 minutes) for config.prefetch at one token in the decode engine: the GPU tests of the
# engine and of the prefetching kernels (it changes no bit), the engine's step sweep of the `overlap` group
# (sparse step) and `overlap_dense` (dense step) at batch 1 (decode_engine_sweep.py: prefetch off and on,
# alternated), then `bench decode-model --step` at batch 1. CSVs and logs under OUT; GIT_SHA names them.
# Usage: bash benchmarks/probes/decode_overlap.sh OUT [GIT_SHA]
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/decode_overlap.sh OUT [GIT_SHA]}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
sha=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
stamp tests
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/models/test_gpu_decode_step.py \
  tests/kernels/test_decode_mlp.py tests/kernels/test_decode_attn_proj.py \
  > "$out/tests.log" 2>&1
grep -E "^FAILED|^ERROR" "$out/tests.log" | cut -c1-300; tail -1 "$out/tests.log"
stamp "engine sweep, batch 1"
timeout 420 python3 benchmarks/probes/decode_engine_sweep.py "$out/decode_engine_sweep_overlap_$sha.csv" 1 \
  overlap,overlap_dense > "$out/engine_sweep.log" 2>&1
echo "exit $?"; grep -E "^batch" "$out/engine_sweep.log" | cut -c1-120
stamp "bench decode-model --step, batch 1"
timeout 240 python3 -m sparseffn bench decode-model --model 2b --batches 1 --prompt 512 --new-tokens 64 --no-eager \
  --non-mlp fused --step --out-dir "$out/model" --git-sha "$sha" > "$out/model.log" 2>&1
echo "exit $?"; python3 benchmarks/probes/decode_model_table.py "$out/model" 2>&1 | tail -8
