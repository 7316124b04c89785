#!/usr/bin/env bash
# One GPU call (<= 10 minutes) for the decode step's tail (the greedy pick in one launch, the final norm with the
# last sparse layer folded into it) and K1's gate tiles at 16 tokens, most needed first (a call cut short still
# returns what ran): the GPU tests of the touched code, `bench decode-model --step --isolate` at batch 1 with the
# user-compiled loop (each timed run in a fresh process), the engine sweep's mlp_sparse_compact group at batch 16,
# then the tail A/B alternated in one process (decode_tail_ab.py, batches 1 and 16, with the deterministic-mode
# step). CSVs and logs under OUT; GIT_SHA names them.
# Usage: bash benchmarks/probes/decode_tail.sh OUT [GIT_SHA]
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/decode_tail.sh OUT [GIT_SHA]}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
sha=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
stamp tests
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_greedy_pick.py tests/ops/test_decode_block.py \
  tests/models/test_generate.py tests/models/test_decode_step.py tests/models/test_gpu_decode_step.py \
  tests/bench/test_decode_model_bench.py > "$out/tests.log" 2>&1
grep -E "^FAILED|^ERROR" "$out/tests.log" | cut -c1-300; tail -1 "$out/tests.log"
stamp "bench decode-model --step --isolate --user-compiled, batch 1"
timeout 220 python3 -m sparseffn bench decode-model --model 2b --batches 1 --prompt 512 --new-tokens 64 --no-eager \
  --non-mlp fused --step --no-captured --isolate --user-compiled --out-dir "$out/model" --git-sha "$sha" \
  > "$out/model.log" 2>&1
echo "exit $?"; python3 benchmarks/probes/decode_model_table.py "$out/model" 2>&1 | tail -8
stamp "engine sweep, K1 at 16 tokens"
timeout 90 python3 benchmarks/probes/decode_engine_sweep.py "$out/decode_engine_sweep_compact_tiles_$sha.csv" 16 \
  mlp_sparse_compact > "$out/engine_sweep.log" 2>&1
echo "exit $?"; grep -E "^batch" "$out/engine_sweep.log" | cut -c1-150
stamp "tail A/B, batches 1 and 16"
timeout 150 python3 benchmarks/probes/decode_tail_ab.py "$out/decode_tail_ab_$sha.csv" 1,16 3 > "$out/tail_ab.log" 2>&1
echo "exit $?"; grep -E "median|equal|deterministic" "$out/tail_ab.log" | cut -c1-160
