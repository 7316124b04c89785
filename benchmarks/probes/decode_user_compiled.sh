#!/usr/bin/env bash
# One H200 call (2-4 minutes, most of it Inductor compiling the 38-layer step four
# times; the bench is cut at 180 s, the CSV written after each batch): the GPU tests
# of the public op under torch.compile and of auto's decode rule, then `bench decode-model` on 2b at
# batch 1 and 16: CapturedDecoder (fused norms/RoPE) and a user's own torch.compile'd loop
# (--user-compiled, bench/user_decoder.py), dense against auto. CSVs and logs under OUT; the table last
# (read back from the CSV, so a run cut short still shows the batches it finished).
# Usage: bash benchmarks/probes/decode_user_compiled.sh OUT
set -uo pipefail
out=${1:?usage: bash benchmarks/probes/decode_user_compiled.sh OUT}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
stamp() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
stamp tests
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/bench/test_user_decoder.py tests/ops/test_compiled_decode.py \
  tests/ops/test_decide.py tests/models/test_generate.py::test_gpu_captured_steps_match_eager_steps \
  tests/models/test_generate.py::test_gpu_capture_in_a_fresh_process_loads_the_decode_kernels_first > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
stamp bench
timeout 180 python3 -m sparseffn bench decode-model --model 2b --batches 1,16 --prompt 512 --new-tokens 64 \
  --no-eager --non-mlp fused --user-compiled --out-dir "$out" --git-sha "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  > "$out/bench.log" 2>&1
echo "bench exit $?"; grep -E "batch [0-9]+:|Error|error" "$out/bench.log" | cut -c1-600
stamp table
python3 benchmarks/probes/decode_model_table.py "$out"
