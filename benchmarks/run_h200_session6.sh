#!/usr/bin/env bash
# One call on the H200: the decode kernels' GPU tests, where a decode call's time goes
# (probe_decode_parts.py), and the launch-config sweep over M = 1..64. Results under $OUT.
# Usage: bash benchmarks/run_h200_session6.sh GIT_SHA
set -uo pipefail
sha=${1:-unknown}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_mlp.py 2>&1 | tail -3
timeout 120 python3 benchmarks/probe_decode_parts.py "$out/decode_parts.csv" 2>&1 | grep -v Warn | tail -8
timeout 330 python3 - "$sha" "$out" <<'PY' 2>&1 | grep -v Warn | tail -12
import sys
from pathlib import Path
from sparseffn.bench.common import write_csv
from sparseffn.bench.decode import sweep_configs
from sparseffn.bench.timing import run_metadata
import torch
sha, out = sys.argv[1:]
meta = dict(run_metadata(torch.device("cuda")), git_sha=sha, d=2048, h=5632, target_nnz=29)
rows = []
for m in (1, 2, 4, 8, 16, 32, 64):  # the CSV is rewritten after each M (a cut-short run keeps the rest)
    rows += [dict(meta, **r) for r in sweep_configs(tokens=str(m))]
    fields = list(meta) + [k for k in rows[-1] if k not in meta]
    write_csv(rows, Path(out) / "decode_sweep.csv", tuple(fields))
PY
