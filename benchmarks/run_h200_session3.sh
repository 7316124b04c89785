#!/usr/bin/env bash
# One device call: GPU tests of dispatch and decode, the decode MLP benchmark with the swept configs,
# the whole-run training benchmark (dense vs auto from initialization) and the layout probe.
# Needs the corpus carried in .data/corpus. Results under $OUT.
set -uo pipefail
sha=${1:-unknown}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_mlp.py tests/ops/test_decide.py \
  tests/ops/test_twell_mlp.py tests/nn/test_sparse_mlp.py tests/models/test_gpu_sparse_paths.py -k "decode or gpu or decide" \
  2>&1 | tee "$out/pytest.log" | tail -3
timeout 330 python3 -m sparseffn bench train-run --data .data/corpus --steps 500 --git-sha "$sha" \
  --out-dir "$out/results" 2>&1 | tee "$out/train_run.log" | grep -E "^\||in all|Error|error" | tail -12
timeout 100 python3 -m sparseffn bench decode --git-sha "$sha" --out-dir "$out/results" --rep-ms 30 2>&1 | tee "$out/decode.log" | grep "D=" | cut -c1-160
timeout 30 python3 benchmarks/probe_layout.py "$out/results" "$sha" 2>&1 | tail -4
