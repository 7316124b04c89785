#!/usr/bin/env bash
# One call on the H200: `bench train-run`, the `0.5b` model trained twice from the same seed (every MLP
# dense, then auto mode) on the Shakespeare plays, carried in .data/corpus; writes train_run.csv (+ PNG).
# Usage: bash benchmarks/train_run.sh GIT_SHA [extra `bench train-run` flags]; results under $OUT/results.
set -uo pipefail
sha=${1:-unknown}
shift || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
timeout 330 python3 -m sparseffn bench train-run --data .data/corpus --steps 500 --git-sha "$sha" \
  --out-dir "$out/results" "$@" 2>&1 | tee "$out/train_run.log" | grep -E "^\||in all|Error|error" | tail -12
