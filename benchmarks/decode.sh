#!/usr/bin/env bash
# One call on the H200, the parts named in PARTS (comma-separated, default tests,parts,decode):
#   tests     the GPU tests of the decode kernels, captured generation and one-launch q/k/v projections
#   parts     a decode call's kernels timed apart (benchmarks/probes/decode_parts.py)
#   latency   one-token GEMV variants and launching the down kernel as a programmatic dependent
#             (benchmarks/probes/decode_latency.py)
#   sweep     the decode config sweep
#   decode    `bench decode` (MLP level)
#   probe     where a captured decode step's time goes (benchmarks/probes/decode_step.py, batch 1 and 4)
#   model     `bench decode-model` (whole model, HF and fused norms/RoPE, peak memory), with
#             $MODEL_FLAGS (default --eager-tokens 32)
#   e2e       the rows of `bench e2e` (8 and 32 sequences of 2048, peak memory)
#   memory    what a sparse decode run holds beyond the dense one (benchmarks/probes/decode_memory.py)
#   compiled  `bench decode-model` at batch 1 (or $COMPILED_BATCHES), the step's forward also through
#             torch.compile, HF norms/RoPE; results under $OUT/compiled
# Results under $OUT: the CSVs and logs.txt. Usage: bash benchmarks/decode.sh GIT_SHA [PARTS]
set -uo pipefail
sha=${1:-unknown}
parts=",${2:-tests,parts,decode},"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
nvidia-smi --query-gpu=name --format=csv,noheader
stamp() { echo "[$(date +%T)] $*"; }
if [[ $parts == *,tests,* ]]; then
  stamp tests
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_mlp.py tests/models/test_generate.py \
    tests/kernels/test_decode_linear.py tests/ops/test_decode_linear.py tests/models/test_fuse.py \
    > "$out/tests.log" 2>&1
  tail -3 "$out/tests.log"
fi
if [[ $parts == *,parts,* ]]; then
  stamp parts
  timeout 90 python3 benchmarks/probes/decode_parts.py "$out/results/decode_parts_$sha.csv" > "$out/parts.log" 2>&1
  grep -v Warn "$out/parts.log" | python3 -c "import sys, ast; [print({k: v for k, v in ast.literal_eval(l).items() \
    if k not in ('gpu', 'torch', 'triton', 'git_sha')}) for l in sys.stdin if l.startswith('{')]"
fi
if [[ $parts == *,latency,* ]]; then
  stamp latency
  timeout 150 python3 benchmarks/probes/decode_latency.py "$out/results/decode_latency_$sha.csv" > "$out/latency.log" 2>&1
  grep -E "^M=|^floor|^qkv|Error" "$out/latency.log"
fi
if [[ $parts == *,sweep,* ]]; then
  stamp sweep
  timeout 300 python3 - "$sha" "$out" > "$out/sweep.log" 2>&1 <<'PY'
import sys
from pathlib import Path
import torch
from sparseffn.bench.common import write_csv
from sparseffn.bench.decode import sweep_configs
from sparseffn.bench.timing import run_metadata
sha, out = sys.argv[1:]
meta = dict(run_metadata(torch.device("cuda")), git_sha=sha, d=2048, h=5632, target_nnz=29)
rows = []
for m in (1, 2, 4, 8, 16, 32, 64):  # the CSV is rewritten after each M (a cut-short run keeps the rest)
    rows += [dict(meta, **r) for r in sweep_configs(tokens=str(m))]
    fields = list(meta) + [k for k in rows[-1] if k not in meta]
    write_csv(rows, Path(out) / "results" / "decode_sweep.csv", tuple(fields))
PY
  grep -E "^M=|Error" "$out/sweep.log" | cut -c1-400
fi
if [[ $parts == *,decode,* ]]; then
  stamp decode
  timeout 240 python3 -m sparseffn bench decode --git-sha "$sha" --out-dir "$out/results" > "$out/decode.log" 2>&1
  grep -E "^D=|Error|error" "$out/decode.log" | tail -24
fi
if [[ $parts == *,probe,* ]]; then
  stamp probe
  timeout 150 python3 benchmarks/probes/decode_step.py "$out/results/decode_step_$sha.csv" 1,4 > "$out/probe.log" 2>&1
  grep -E "batch|Error|error" "$out/probe.log" | sed -E 's/decisions .*//' | tail -12
fi
if [[ $parts == *,model,* ]]; then
  stamp model
  timeout 400 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" ${MODEL_FLAGS:---eager-tokens 32} \
    > "$out/decode_model.log" 2>&1
  grep -E "batch|Error|error" "$out/decode_model.log" | tail -10
fi
if [[ $parts == *,e2e,* ]]; then
  stamp e2e
  timeout 170 bash benchmarks/e2e.sh "$sha" batches=8,32 > "$out/e2e.log" 2>&1
  tail -12 "$out/e2e.log"
fi
if [[ $parts == *,memory,* ]]; then
  stamp memory
  timeout 150 python3 benchmarks/probes/decode_memory.py 16 > "$out/memory.log" 2>&1
  grep -v Warn "$out/memory.log" | tail -20
fi
if [[ $parts == *,compiled,* ]]; then
  stamp compiled
  timeout 400 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/compiled" --batches "${COMPILED_BATCHES:-1}" \
    --non-mlp hf --compile --no-eager > "$out/compiled.log" 2>&1
  grep -E "batch|Error|error" "$out/compiled.log" | tail -10
fi
# The device returns at most 8 files: one log, the CSVs (PNGs are redrawn here by `bench report`)
for f in "$out"/*.log; do [[ -e $f ]] && { echo "== $(basename "$f")"; cat "$f"; } >> "$out/logs.txt" && rm "$f"; done
find "$out" -name '*.png' -delete
n=$(find "$out" -type f | wc -l); (( n > 8 )) && echo "WARNING: $n files under \$OUT, only 8 come back"
stamp done
