#!/usr/bin/env bash
# One call on the lent H200 (device tool): GPU tests, then `sparseffn bench mlp`.
# Usage: bash benchmarks/mlp.sh GIT_SHA [extra `bench mlp` flags]; results land under $OUT.
set -uo pipefail
sha=${1:-unknown}
shift || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -x -p no:cacheprovider tests 2>&1 | tee "$out/pytest.log" | tail -25
fi
python3 -m sparseffn bench mlp --git-sha "$sha" --out-dir "$out/results" "$@" 2>&1 | tee "$out/bench.log" | grep -v Warning
