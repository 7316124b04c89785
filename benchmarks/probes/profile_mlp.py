"""Where the time of the sparse MLP goes, on the GPU: each stage alone, launch configs, a profile
(host time per call: benchmarks/probes/profile_host.py).

Not part of the package: a measurement script for tuning runs on the lent H200
(`python3 benchmarks/probes/profile_mlp.py > $OUT/profile.txt`). Every stage runs on the same synthetic
inputs as `sparseffn bench mlp`; times are do_bench medians (ms) with L2 flushed.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.kernels.configs.twell_up_down import benchmark_configs, default_config
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.kernels.twell_up_down import twell_up_down
from sparseffn.ops.sparse_mlp import sparse_mlp
from sparseffn.ops.twell_mlp import SparseMLPWeights, dense_mlp


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def stages(m: int, d: int, h: int, nnz: float) -> None:
    mlp = synthetic_mlp(m, d, h, nnz, device="cuda", seed=0)
    x, gate, up, down = mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight
    w = SparseMLPWeights.prepare(gate, up, down)
    values, columns, counts = gate_twell(x, gate)
    out = torch.empty_like(x)
    row = {
        "dense": ms(lambda: dense_mlp(x, gate, up, down, None)),
        "gemm_gate": ms(lambda: F.linear(x, gate)),
        "gate_pack": ms(lambda: gate_twell(x, gate)),
        "gate_counts": ms(lambda: gate_twell(x, gate, mode="counts")),
        "gate_dense": ms(lambda: gate_twell(x, gate, mode="dense")),
        "up_down": ms(lambda: twell_up_down(x, values, columns, counts, w.up_weight, w.down_t, tile=256, out=out)),
        "overflow_ids": ms(lambda: (counts > 32).any(1).nonzero()),
        "sparse": ms(lambda: sparse_mlp(x, gate, up, down, mode="sparse", prepared=w)),
    }
    print(f"M={m} D={d} H={h} nnz={nnz}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    return mlp, w, values, columns, counts


def sweep_up_down(mlp, w, values, columns, counts) -> None:
    x = mlp.x
    out = torch.empty_like(x)
    d = x.shape[1]
    results = []
    for cfg in benchmark_configs(d):
        try:
            t = ms(lambda: twell_up_down(x, values, columns, counts, w.up_weight, w.down_t, tile=256, out=out, config=cfg))
        except Exception as err:  # noqa: BLE001 - report configs that fail to compile, keep sweeping
            print(f"  config {cfg} failed: {type(err).__name__}: {str(err)[:120]}")
            continue
        results.append((t, cfg))
    results.sort(key=lambda r: r[0])
    default = default_config(d)
    print("  up_down configs, best first (default marked *):")
    for t, cfg in results:
        print(f"    {t:.3f} ms {'*' if cfg == default else ' '} {cfg}", flush=True)


def profile(mlp, w) -> None:
    x, gate, up, down = mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight
    for _ in range(3):
        sparse_mlp(x, gate, up, down, mode="sparse", prepared=w)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            sparse_mlp(x, gate, up, down, mode="sparse", prepared=w)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main() -> int:
    torch.manual_seed(0)
    for m, nnz in ((256, 29), (4096, 29), (65536, 29), (65536, 110)):
        case = stages(m, 2048, 5632, nnz)
        if m in (4096, 65536) and nnz == 29:
            sweep_up_down(*case)
        if m == 256:
            profile(case[0], case[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
