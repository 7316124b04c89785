#!/usr/bin/env bash
# One device call: GPU tests of the decode kernels, dispatch and weight layout, then the decode config
# sweep, the decode MLP benchmark, the training-step density sweep and the layout probe. Results under $OUT.
set -uo pipefail
sha=${1:-unknown}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_mlp.py tests/ops/test_decide.py \
  tests/ops/test_dispatch.py tests/ops/test_twell_mlp.py tests/nn/test_sparse_mlp.py \
  "tests/kernels/test_gate_twell.py::test_portable_path_matches_the_native_one" 2>&1 | tee "$out/pytest1.log" | tail -8
timeout 150 python3 -c "
from sparseffn.bench.decode import sweep_configs
from sparseffn.bench.common import write_csv
from pathlib import Path
rows = sweep_configs()
write_csv(rows, Path('$out/results/decode_sweep.csv'), tuple(rows[0]))
" 2>&1 | tee "$out/sweep.log" | grep -v Warn | tail -6
timeout 120 python3 -m sparseffn bench decode --git-sha "$sha" --out-dir "$out/results" --rep-ms 40 2>&1 | tee "$out/decode.log" | grep "D=" 
timeout 90 python3 -m sparseffn bench mlp --train --shapes 2048x5632 --tokens 16384 --nnz 29,55,110,220,450 \
  --providers dense,sparse --git-sha "$sha" --out-dir "$out/results" 2>&1 | tee "$out/train.log" | grep "train D="
timeout 60 python3 benchmarks/probe_layout.py "$out/results" "$sha" 2>&1 | tail -8
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_train_mlp.py \
  "tests/kernels/test_twell_up_down.py::test_matches_float64_reference" 2>&1 | tee "$out/pytest2.log" | tail -4
