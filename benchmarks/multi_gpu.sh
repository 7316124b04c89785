#!/usr/bin/env bash
# Multi-GPU training over NCCL on one host (torchrun, DDP and FSDP2), dense vs auto mode, 1 and N GPUs
# with the same global batch; then benchmarks/summarize_multi_gpu.py writes multi_gpu.csv.
# Usage: bash benchmarks/multi_gpu.sh OUT_DIR [STEPS] ; needs the corpus in .data/corpus.
set -uo pipefail
out=${1:?out dir}; steps=${2:-60}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
global_batch=8
common="--model 0.5b --steps $steps --seq-len 2048 --data .data/corpus --tokenizer byte --l1-coeff 2e-2 \
  --l1-warmup-steps 20 --log-interval 10 --eval-interval 0 --checkpoint-interval 0 --keep-checkpoints 1 --no-progress"
run() {  # n parallel mode
  local dir="$out/runs/n$1_$2_$3"
  if ! timeout 150 torchrun --standalone --nproc-per-node "$1" -m sparseffn train $common --mode "$3" \
      --parallel "$2" --batch-size $((global_batch / $1)) --out-dir "$dir" > "$dir.log" 2>&1; then
    echo "FAILED: $dir"
  fi
  tail -n 2 "$dir.log"
}
mkdir -p "$out/runs"
for mode in dense auto; do run 1 ddp $mode; run "$gpus" ddp $mode; done
run "$gpus" fsdp auto
python3 benchmarks/summarize_multi_gpu.py "$out"
