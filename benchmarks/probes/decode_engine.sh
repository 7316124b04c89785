#!/usr/bin/env bash
# One H200 call (<= 5 minutes): the GPU tests of the fused decode engine and its kernels, the dense
# and sparse MLP blocks against a torch F.linear chain (decode_engine_mlp.py), a per-kernel
# profile of one captured engine step (2b, batch 1 and 16, dense vs auto; CSV), then `bench decode-model`
# on 2b at BATCHES (default 1,4,16) with the engine's path ("step") beside CapturedDecoder's ("captured"),
# fused norms/RoPE, dense against auto. CSVs and logs under OUT; the table last (read back from the CSV,
# so a run cut short still shows the batches it finished). GIT_SHA names the rows (the machine's checkout
# may report another HEAD).
# Usage: [BENCH_S=150] bash benchmarks/probes/decode_engine.sh OUT [BATCHES] [GIT_SHA]  (BENCH_S: the bench's limit)
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/decode_engine.sh OUT [BATCHES] [GIT_SHA]}
batches=${2:-1,4,16}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
sha=${3:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
stamp tests
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/ops/test_decode_block.py tests/kernels/test_decode_mlp.py \
  tests/models/test_decode_step.py tests/models/test_gpu_decode_step.py > "$out/tests.log" 2>&1
grep -E "^FAILED|^ERROR" "$out/tests.log" | cut -c1-300; tail -1 "$out/tests.log"
stamp mlp
timeout 25 python3 benchmarks/probes/decode_engine_mlp.py "$out/decode_engine_mlp_$sha.csv" > "$out/mlp.log" 2>&1
echo "mlp exit $?"; grep -E "^M=|Error" "$out/mlp.log" | cut -c1-300
stamp profile
timeout 50 python3 benchmarks/probes/decode_engine_profile.py "$out/decode_engine_profile_$sha.csv" 1,16 \
  > "$out/profile.log" 2>&1
echo "profile exit $?"; grep -vE "Warn|warn" "$out/profile.log" | tail -40 | cut -c1-200
stamp bench
timeout "${BENCH_S:-150}" python3 -m sparseffn bench decode-model --model 2b --batches "$batches" --prompt 512 --new-tokens 64 \
  --no-eager --non-mlp fused --step --out-dir "$out" --git-sha "$sha" > "$out/bench.log" 2>&1
echo "bench exit $?"; grep -E "batch [0-9]+:|Error|error" "$out/bench.log" | cut -c1-600
stamp table
python3 benchmarks/probes/decode_model_table.py "$out"
