"""Up/down weight layout for the TwELL inference kernels: separate [H, D] up and down^T rows (what
`SparseMLP` stores: no second copy) vs one interleaved [H, 2, D] copy (a unit's rows side by side),
side by side on the H200 with dense torch in the same run. Writes layout.csv under the out dir.

    python benchmarks/weight_layout.py OUT_DIR [GIT_SHA]
"""

import sys
from pathlib import Path

import torch

from sparseffn.bench.common import write_csv
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.bench.timing import median_timing, run_metadata, time_fn
from sparseffn.ops.twell_mlp import SparseMLPWeights, dense_mlp, twell_mlp

FIELDS = ("gpu", "torch", "triton", "git_sha", "d", "h", "m", "target_nnz", "layout", "median_ms", "p20_ms",
          "p80_ms", "speedup_vs_dense")


def main(out: str, sha: str = "") -> None:
    device = torch.device("cuda")
    meta = run_metadata(device)
    if sha:
        meta["git_sha"] = sha
    rows = []
    for d, h, m in ((2048, 5632, 4096), (2048, 5632, 16384), (2048, 5632, 65536), (4096, 14336, 16384)):
        mlp = synthetic_mlp(m, d, h, 29, device=device, seed=0)
        down_t = mlp.down_weight.t().contiguous()
        both = torch.stack((mlp.up_weight, down_t), 1)
        layouts = {
            "separate": SparseMLPWeights(mlp.gate_weight, mlp.up_weight, mlp.down_weight, down_t),
            "interleaved": SparseMLPWeights(mlp.gate_weight, both[:, 0], mlp.down_weight, both[:, 1]),
        }
        calls = {"dense": lambda: dense_mlp(mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, None)}
        for name, w in layouts.items():
            calls[name] = lambda w=w: twell_mlp(mlp.x, w)
        a, b = calls["separate"](), calls["interleaved"]()
        scale = a.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= 1e-2 * scale, "the layouts compute different functions"
        timings = {name: [] for name in calls}
        for _ in range(3):
            for name, fn in calls.items():
                timings[name].append(time_fn(fn, device, rep_ms=100))
        base = median_timing(timings["dense"]).median_ms
        for name, ts in timings.items():
            t = median_timing(ts)
            rows.append(dict(meta, d=d, h=h, m=m, target_nnz=29, layout=name, median_ms=round(t.median_ms, 5),
                             p20_ms=round(t.p20_ms, 5), p80_ms=round(t.p80_ms, 5),
                             speedup_vs_dense=round(base / t.median_ms, 4)))
            print(f"D={d} H={h} M={m:>6} {name:>11}: {t.median_ms:.3f} ms ({base / t.median_ms:.2f}x dense)")
        del mlp, both, layouts
        torch.cuda.empty_cache()
    write_csv(rows, Path(out) / "layout.csv", FIELDS)


if __name__ == "__main__":
    main(*sys.argv[1:])
