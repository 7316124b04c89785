#!/usr/bin/env bash
# One GPU call (<= 10 minutes) for the decode config options, each against its other form: DecodeConfig.stream
# and ProjectionConfig.stream (one token), DecodeConfig.compact_up (3+ tokens). In order of importance, each
# step under its own limit: their GPU tests; the engine's step sweep of the one-token fields at batch 1 and of
# compact_up at batch 16 (decode_engine_sweep.py); the public op's config sweep at 1 and 16 tokens (bench
# decode's sweep_configs, parts one_token / compact_up); the one-token read designs against cuBLAS
# (gemv_designs.py). CSVs and logs under OUT. The CSV names carry GIT_SHA (the machine's checkout may report
# another HEAD in the rows' git_sha column).
# Usage: bash benchmarks/probes/decode_options.sh OUT [GIT_SHA]
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/decode_options.sh OUT [GIT_SHA]}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
sha=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
stamp tests
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_mlp.py tests/ops/test_decode_block.py \
  tests/kernels/test_decode_attn_proj.py > "$out/tests.log" 2>&1
grep -E "^FAILED|^ERROR" "$out/tests.log" | cut -c1-300; tail -1 "$out/tests.log"
stamp engine sweep, batch 1
timeout 170 python3 benchmarks/probes/decode_engine_sweep.py "$out/decode_engine_sweep_options_b1_$sha.csv" 1 \
  mlp_sparse_one_token,mlp_dense_one_token,qkv_one_token,out_proj_one_token > "$out/engine_sweep_b1.log" 2>&1
echo "exit $?"; grep -E "^batch" "$out/engine_sweep_b1.log" | cut -c1-260
stamp engine sweep, batch 16
timeout 90 python3 benchmarks/probes/decode_engine_sweep.py "$out/decode_engine_sweep_options_b16_$sha.csv" 16 \
  mlp_sparse_compact > "$out/engine_sweep_b16.log" 2>&1
echo "exit $?"; grep -E "^batch" "$out/engine_sweep_b16.log" | cut -c1-260
stamp public-op sweep
timeout 120 python3 - "$sha" "$out" > "$out/sweep.log" 2>&1 <<'PY'
import sys
from pathlib import Path
import torch
from sparseffn.bench.common import write_csv
from sparseffn.bench.decode import sweep_configs
from sparseffn.bench.timing import run_metadata
sha, out = sys.argv[1:]
meta = dict(run_metadata(torch.device("cuda")), git_sha=sha, d=2048, h=5632, target_nnz=29)
rows = []
for m in (1, 16):  # the CSV is rewritten after each M (a cut-short run keeps the rest)
    rows += [dict(meta, **r) for r in sweep_configs(tokens=str(m))]
    write_csv(rows, Path(out) / f"decode_sweep_options_{sha}.csv", tuple(dict.fromkeys(k for r in rows for k in r)))
    keys = ("block_h", "block_k", "split", "block_d", "stream", "compact_up", "up_k", "up_stages")
    for part in ("gate", "down", "one_token", "compact_up"):
        for r in sorted((r for r in rows if r["m"] == m and r["part"] == part and not r["error"]), key=lambda r: r["us"])[:2]:
            print(f"M={m} {part:10s} {r['us']:7.2f} us", {k: r[k] for k in keys})
PY
echo "exit $?"; grep -E "^M=[0-9]+ |Error" "$out/sweep.log" | cut -c1-300
stamp gemv
timeout 100 python3 benchmarks/probes/gemv_designs.py "$out/gemv_designs_$sha.csv" > "$out/gemv.log" 2>&1
echo "exit $?"; grep -E "^N=" "$out/gemv.log" | cut -c1-120
