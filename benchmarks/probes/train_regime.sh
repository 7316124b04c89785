#!/usr/bin/env bash
# The paper's regime on one H200 (about 4 minutes): the GPU tests of the kernel warm-up and of fused norms in
# training (in a Triton cache of their own, so the benchmark starts cold), `bench train-run` at `0.5b`, 300
# steps, the paper-regime λ, auto vs dense each in its own process, then what measuring activity costs
# against auto's sparse-phase step (the sample auto mode takes every 16 steps per layer, and the per-layer
# statistics of a logging step). Prints the per-window table and the summary last.
# Usage: bash benchmarks/probes/train_regime.sh OUT [extra `bench train-run` flags]; CSV + log under OUT.
set -uo pipefail
out=${1:?usage: train_regime.sh OUT}
shift
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
TRITON_CACHE_DIR=$(mktemp -d) timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/nn/test_warm.py \
  tests/train/test_loop.py -k "h200 or on_cuda" 2>&1 | tail -2
data=(); [ -d .data/corpus ] && data=(--data .data/corpus)
timeout 400 python3 -m sparseffn bench train-run --model 0.5b --steps 300 --modes auto,dense "${data[@]}" \
  --out-dir "$out/results" "$@" > "$out/train_run.log" 2>&1
echo "bench train-run exit $? (log: $out/train_run.log)"
timeout 60 python3 - "$out/results" <<'PY' 2>&1 | tee "$out/activity_cost.txt"
import csv, sys
from pathlib import Path
import torch
from sparseffn.nn.sparse_mlp import SparseMLP
from sparseffn.train.tracking import ActivationStats

rows = [r for p in Path(sys.argv[1]).rglob("train_run.csv") for r in csv.DictReader(p.open())]
auto = [r for r in rows if r["mode"] == "auto" and r["kind"] == "step"]
if not auto:
    sys.exit("no auto rows: see the log")
d, h, tokens, layers = 2048, 5632, int(auto[-1]["tokens_per_step"]), int(auto[-1]["layers"])
mlp = SparseMLP(d, h, device="cuda", dtype=torch.bfloat16)
x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
stats = ActivationStats(torch.nn.ModuleList([mlp]))

def ms(fn, n=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record(); fn(); end.record(); torch.cuda.synchronize(); times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]

sample = ms(lambda: mlp.activation_mask(x).sum())
track = ms(lambda: stats._accumulate(0, mlp.activation_mask(x).reshape(-1, h)))
step = 1000 * tokens / float(auto[-1]["tokens_per_s"])
print(f"measuring activity: a sample {sample:.2f} ms per layer every {mlp.activity.period} steps = "
      f"{100 * layers * sample / mlp.activity.period / step:.2f}% of auto's last step ({step:.0f} ms); logging-step "
      f"statistics {track:.2f} ms per layer every 10 steps = {100 * layers * track / 10 / step:.2f}%")
PY
grep -E "warmed the sparse kernels|Error|error" "$out/train_run.log" | cut -c1-240 | tail -4
sed -n '/^NVIDIA\|^| \|^auto \/\|^Whole\|^Final/p' "$out/train_run.log" | tail -30
