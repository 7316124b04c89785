#!/usr/bin/env bash
# One call on the lent H200 (device tool): `bench e2e` (the paper's 2B config, dense vs sparse).
# Needs transformers & co. for Python 3.12 as wheels in .carry/wheels (no network there).
# Usage: bash benchmarks/e2e.sh GIT_SHA [field=value ...] (E2EBenchConfig fields)
set -uo pipefail
sha=${1:-unknown}
shift || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -c "import transformers" 2>/dev/null || \
  pip install --quiet --no-index --find-links .carry/wheels transformers tokenizers safetensors tqdm 2>&1 | tail -2
python3 - "$sha" "$out" "$@" <<'PY' 2>&1 | grep -v Warning
import sys, dataclasses
from sparseffn.bench.e2e import E2EBenchConfig, run_e2e_bench
from sparseffn.bench.report import e2e_table
sha, out, *flags = sys.argv[1:]
types = {f.name: f.type for f in dataclasses.fields(E2EBenchConfig)}
cast = {"int": int, "float": float, "str": str}
kw = {k: cast[types[k]](v) for k, v in (f.split("=", 1) for f in flags)}
rows = run_e2e_bench(E2EBenchConfig(git_sha=sha, out_dir=f"{out}/results", **kw))
print(e2e_table(rows))
PY
