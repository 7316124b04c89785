#!/usr/bin/env bash
# One call on the lent H200 (device tool): GPU tests of the training path, then the training-step
# benchmark (`bench mlp --train`). Usage: bash benchmarks/mlp_train.sh GIT_SHA [extra flags].
set -uo pipefail
sha=${1:-unknown}
shift || true
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests/kernels/test_twell_train.py tests/kernels/test_unit_grads.py tests/kernels/test_dense_rows_mlp_backward.py tests/ops/test_train_mlp.py} 2>&1 | tee "$out/pytest.log" | tail -15
fi
python3 - "$sha" "$out" "$@" <<'PY' 2>&1 | tee "$out/bench.log" | grep -v Warning
import sys, dataclasses
from sparseffn.bench.mlp_train import TrainBenchConfig, run_train_bench
from sparseffn.bench.report import train_table
sha, out, *flags = sys.argv[1:]
kw = dict(f.split("=", 1) for f in flags)
fields = {f.name: f.type for f in dataclasses.fields(TrainBenchConfig)}
kw = {k: (int(v) if fields[k] in ("int", int) else v) for k, v in kw.items()}
rows = run_train_bench(TrainBenchConfig(git_sha=sha, out_dir=f"{out}/results", **kw))
print(train_table(rows))
PY
