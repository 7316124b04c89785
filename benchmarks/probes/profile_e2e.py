"""Where the time of a dense 2B forward and training step goes on the GPU, kernel by kernel.

Usage: python benchmarks/probes/profile_e2e.py [batch] [model]. Groups CUDA kernels into GEMM / attention /
elementwise-and-norm by name and prints the top kernels, for deciding what to fuse outside the MLP.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sparseffn.models import build_model

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
name = sys.argv[2] if len(sys.argv) > 2 else "2b"
model = build_model(name, None, device="cuda", dtype=torch.bfloat16, seed=0)
ids = torch.randint(0, model.config.vocab_size, (batch, 2048), device="cuda")


def category(kernel: str) -> str:
    k = kernel.lower()
    if "gemm" in k or "sm90_xmma" in k or "cutlass" in k or "nvjet" in k:
        return "gemm"
    if "flash" in k or "fmha" in k or "attention" in k or "cudnn" in k:
        return "attention"
    return "elementwise/norm/other"


for phase in ("forward", "train"):
    def run():
        if phase == "forward":
            with torch.no_grad():
                model(ids, use_cache=False)
        else:
            out = model(ids, labels=ids, use_cache=False)
            out.loss.backward()
            model.zero_grad(set_to_none=True)

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        groups[category(e.key)] = groups.get(category(e.key), 0.0) + e.self_device_time_total
    print(f"\n== {name} {phase} batch {batch}x2048: GPU time {total / 1e3:.1f} ms")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:24s} {t / 1e3:9.1f} ms  {100 * t / total:5.1f}%")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:22]:
        print(f"  {e.self_device_time_total / 1e3:9.2f} ms  x{e.count:<5d} {e.key[:110]}")
