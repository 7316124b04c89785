#!/usr/bin/env bash
# One device call: GPU tests of the merged tree's new paths, the decode config sweep, the decode
# MLP benchmark, the layout and portability probes. Results under $OUT.
set -uo pipefail
sha=${1:-unknown}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_mlp.py tests/ops/test_decide.py \
  tests/ops/test_dispatch.py tests/ops/test_twell_mlp.py tests/ops/test_sparse_mlp.py tests/nn \
  tests/models/test_gpu_sparse_paths.py -k "not float64" 2>&1 | tee "$out/pytest.log" | tail -4
timeout 170 python3 -c "
from sparseffn.bench.decode import sweep_configs
from sparseffn.bench.common import write_csv
from pathlib import Path
rows = sweep_configs()
write_csv(rows, Path('$out/results/decode_sweep.csv'), tuple(rows[0]))
" 2>&1 | tee "$out/sweep.log" | grep "M=" | cut -c1-600
timeout 120 python3 -m sparseffn bench decode --git-sha "$sha" --out-dir "$out/results" --rep-ms 40 2>&1 | tee "$out/decode.log" | grep "D=" | cut -c1-190
timeout 45 python3 benchmarks/probe_layout.py "$out/results" "$sha" 2>&1 | tail -4
timeout 45 python3 benchmarks/probe_portable.py 2>&1 | tail -3
