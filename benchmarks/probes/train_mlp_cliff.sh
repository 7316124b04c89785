#!/usr/bin/env bash
# The training MLP across 15-160 active units per token (the cliff of issue 37): the GPU tests of the
# training path (overflow rows as GEMMs, the auto rule), then `bench mlp --train` at the 0.5b / 2b
# shape (D=2048, H=5632), 16384 tokens, dense vs sparse vs auto, with the synthetic heavy tail.
# Usage: bash benchmarks/probes/train_mlp_cliff.sh OUT   (~2 min on the H200; CSV under OUT/h200/)
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/train_mlp_cliff.sh OUT}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
sha=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_train_mlp.py tests/ops/test_decide.py \
  "tests/nn/test_sparse_mlp.py::test_gpu_auto_training_starts_dense_and_goes_sparse_as_activity_falls" \
  2>&1 | tee "$out/pytest.log" | tail -3
timeout 240 python3 -m sparseffn bench mlp --train --shapes 2048x5632 --tokens 16384 --nnz 15,29,55,80,110,160 \
  --providers dense,sparse,auto --rep-ms 80 --git-sha "$sha" --out-dir "$out" 2>&1 | tee "$out/bench.log" | grep '^train'
python3 - "$out" <<'PY'
import csv, glob, sys
# predicted sparse speed-ups, written before the run (commit message of the overflow GEMMs)
predicted = {15: "2.3x", 29: "2.0x", 55: "1.17x", 80: "0.87x", 110: "0.68x", 160: "0.49x"}
paths = glob.glob(f"{sys.argv[1]}/*/mlp_train.csv")
if not paths:
    sys.exit("no mlp_train.csv written (see bench.log)")
rows = list(csv.DictReader(open(paths[0])))
by = {}
for r in rows:
    by.setdefault(int(float(r["target_nnz"])), {})[r["provider"]] = r
print("\n| nnz (mean, overflow rows) | dense ms | sparse ms | sparse | predicted | auto ms | auto | grads within bound |")
print("|---|---|---|---|---|---|---|---|")
for nnz, p in sorted(by.items()):
    d, s, a = p.get("dense"), p.get("sparse"), p.get("auto")
    cell = lambda r, k: r[k] if r else "-"
    x = lambda r: f"{float(r['speedup_vs_dense']):.2f}x" if r else "-"
    ok = all(r["within_bound"] == "True" for r in (d, s, a) if r)
    print(f"| {nnz} ({cell(d, 'mean_nnz')}, {cell(d, 'overflow_rows')}) | {cell(d, 'median_ms')} | "
          f"{cell(s, 'median_ms')} | {x(s)} | {predicted.get(nnz, '-')} | {cell(a, 'median_ms')} | {x(a)} | {ok} |")
PY
