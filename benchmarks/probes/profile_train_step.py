"""Where a whole training step's GPU time goes, as `sparseffn train` runs it, auto mode against dense mode.

Usage: python benchmarks/probes/profile_train_step.py [nnz] [model] [batch]. The model (default `2b`) is built
with fp32 weights and trained under bf16 autocast with fused AdamW, fused norms/RoPE, 2048-token sequences (the
training loop's set-up); per-unit thresholds are calibrated to `nnz` active units per token (default 6, the
activity of `bench train-run`'s late sparse phase at 2b). For each mode: wall time per step, GPU kernel time per
step, the kernels grouped (train/profiling.py's groups) and the top kernels. A real run profiles itself with
`--profile-steps` (its activity is skewed across units; this calibrated one's is not).
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparseffn.models import (SparsityConfig, build_model, calibrate_thresholds, collect_l1, fuse_non_mlp_,
                              sparse_mlps)
from sparseffn.train.profiling import kernel_group

nnz = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
name = sys.argv[2] if len(sys.argv) > 2 else "2b"
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 8
model = build_model(name, SparsityConfig(l1_coeff=2e-4), vocab_size=256, device="cuda", dtype=torch.float32,
                    seed=0, max_position_embeddings=2048)
fuse_non_mlp_(model)
ids = torch.randint(0, 256, (batch, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
with torch.autocast("cuda", torch.bfloat16):
    layers = calibrate_thresholds(model, list(ids.split(4)), nnz)
mean = sum(layer["mean_nnz"] for layer in layers) / len(layers)
mlps = sparse_mlps(model)
for mlp in mlps:
    mlp.expected_nnz = mean
optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)


def step():
    with torch.autocast("cuda", torch.bfloat16):
        out = model(ids, labels=ids, use_cache=False)
        loss = out.loss + 2e-4 * collect_l1(model)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


print(f"{name}, batch {batch}x2048, calibrated mean {mean:.2f} active units per token")
for mode in ("auto", "dense"):
    for mlp in mlps:
        mlp.mode = mode
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / 3
    groups: dict[str, float] = {}
    for e in events:
        groups[kernel_group(e.key)] = groups.get(kernel_group(e.key), 0.0) + e.self_device_time_total / 3
    print(f"\n== {mode}: wall {1e3 * wall:.1f} ms/step, GPU kernels {total / 1e3:.1f} ms/step")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:24s} {t / 1e3:8.2f} ms  {100 * t / total:5.1f}%")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / 3e3:8.2f} ms  x{e.count // 3:<4d} {e.key[:100]}")
