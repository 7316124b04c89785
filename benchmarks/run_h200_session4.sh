#!/usr/bin/env bash
# One device call: GPU tests of captured generation, the training kernels with the transposed down
# weight and the portable gate path, then the whole-model decode benchmark. Results under $OUT.
set -uo pipefail
sha=${1:-unknown}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_generate.py tests/ops/test_dispatch.py \
  tests/kernels/test_gate_twell.py -k "gpu or portable or generate or route or op" 2>&1 | tee "$out/pytest1.log" | tail -3
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/ops/test_train_mlp.py -k "not float64" 2>&1 \
  | tee "$out/pytest2.log" | tail -3
timeout 280 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" 2>&1 \
  | tee "$out/decode_model.log" | grep -E "^batch|^\||Error|error" | tail -16
