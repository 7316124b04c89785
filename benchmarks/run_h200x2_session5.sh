#!/usr/bin/env bash
# One call on two H200s: the whole-model decode benchmark (GPU 0), the captured-generation GPU test,
# then multi-GPU training over NCCL (benchmarks/run_multi_gpu.sh). Results under $OUT.
set -uo pipefail
sha=${1:-unknown}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/out}; mkdir -p "$out/results"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_generate.py 2>&1 | tail -2
CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m sparseffn bench decode-model --git-sha "$sha" --out-dir "$out/results" \
  2>&1 | tee "$out/decode_model.log" | grep -E "^batch|^\||Error|error" | tail -14
timeout 280 bash benchmarks/run_multi_gpu.sh "$out/multi" 50 2>&1 | tail -16
cp "$out/multi/multi_gpu.csv" "$out/results/" 2>/dev/null
