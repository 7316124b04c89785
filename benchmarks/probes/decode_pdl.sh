#!/usr/bin/env bash
# One GPU call (<= 6 minutes) for programmatic dependent launch in the decode engine (the configs' pdl
# field, off by default until this measures it): the GPU tests that PDL changes no bit, the engine's step
# sweep of the `pdl` group (sparse step) and `pdl_dense` (dense step) at batch 1 and 16
# (decode_engine_sweep.py: defaults, every kernel with pdl, all but one kind, o_proj in one K step), then
# the graphed chain of one-token reads (gemv_chain_pdl.py). CSVs and logs under OUT; GIT_SHA names them.
# Usage: bash benchmarks/probes/decode_pdl.sh OUT [GIT_SHA]
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/decode_pdl.sh OUT [GIT_SHA]}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
sha=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
stamp tests
timeout 90 python3 -m pytest -q -p no:cacheprovider \
  "tests/models/test_gpu_decode_step.py::test_programmatic_dependent_launch_changes_no_bit" \
  tests/kernels/test_decode_mlp.py tests/kernels/test_decode_attn_proj.py > "$out/tests.log" 2>&1
grep -E "^FAILED|^ERROR" "$out/tests.log" | cut -c1-300; tail -1 "$out/tests.log"
for b in 1 16; do
  stamp "engine sweep, batch $b"
  timeout 120 python3 benchmarks/probes/decode_engine_sweep.py "$out/decode_engine_sweep_pdl_b${b}_$sha.csv" "$b" \
    pdl,pdl_dense > "$out/engine_sweep_b$b.log" 2>&1
  echo "exit $?"; grep -E "^batch" "$out/engine_sweep_b$b.log" | cut -c1-150
done
stamp chain
timeout 60 python3 benchmarks/probes/gemv_chain_pdl.py "$out/gemv_chain_pdl_$sha.csv" > "$out/chain.log" 2>&1
echo "exit $?"; grep -E "^N=" "$out/chain.log"
