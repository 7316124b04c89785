#!/usr/bin/env bash
# One H200 call (<= 9 minutes) for the one-token config fields (DecodeConfig.stream / fold,
# ProjectionConfig.stream; off by default until this runs): their GPU tests, the one-token read designs against cuBLAS (gemv_designs.py), the public op's config
# sweep at one token with the one_token part (bench decode's sweep_configs), and the engine's step sweep of
# the one-token fields at batch 1 (decode_engine_sweep.py). CSVs and logs under OUT; a summary last. The CSV
# names carry GIT_SHA (the machine's checkout may report another HEAD in the rows' git_sha column).
# Usage: bash benchmarks/probes/one_token.sh OUT [GIT_SHA]
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/one_token.sh OUT [GIT_SHA]}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
sha=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
stamp tests
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_mlp.py tests/ops/test_decode_block.py \
  tests/kernels/test_decode_attn_proj.py > "$out/tests.log" 2>&1
grep -E "^FAILED|^ERROR" "$out/tests.log" | cut -c1-300; tail -1 "$out/tests.log"
stamp gemv
timeout 120 python3 benchmarks/probes/gemv_designs.py "$out/gemv_designs_$sha.csv" > "$out/gemv.log" 2>&1
echo "gemv exit $?"; grep -E "^N=" "$out/gemv.log" | cut -c1-120
stamp public-op sweep
timeout 100 python3 - "$sha" "$out" > "$out/sweep.log" 2>&1 <<'PY'
import sys
from pathlib import Path
import torch
from sparseffn.bench.common import write_csv
from sparseffn.bench.decode import sweep_configs
from sparseffn.bench.timing import run_metadata
sha, out = sys.argv[1:]
meta = dict(run_metadata(torch.device("cuda")), git_sha=sha, d=2048, h=5632, target_nnz=29)
rows = [dict(meta, **r) for r in sweep_configs(tokens="1")]
write_csv(rows, Path(out) / f"decode_sweep_m1_{sha}.csv", tuple(rows[0]))
for part in ("gate", "down", "one_token"):
    for r in sorted((r for r in rows if r["part"] == part and not r["error"]), key=lambda r: r["us"])[:3]:
        keys = ("block_h", "block_k", "gate_warps", "split", "block_d", "stream", "fold", "fold_k", "fold_cols")
        print(f"{part:9s} {r['us']:7.2f} us", {k: r[k] for k in keys})
PY
echo "sweep exit $?"; grep -E "^(gate|down|one_token) |Error" "$out/sweep.log" | cut -c1-300
stamp engine sweep
timeout 200 python3 benchmarks/probes/decode_engine_sweep.py "$out/decode_engine_sweep_one_token_$sha.csv" 1 \
  mlp_sparse_one_token,mlp_dense_one_token,qkv_one_token,out_proj_one_token > "$out/engine_sweep.log" 2>&1
echo "engine sweep exit $?"; grep -E "^batch" "$out/engine_sweep.log" | cut -c1-260
