"""Is the sparse up/down pass bound by L2 capacity, and does prefetching its weight pay? A probe
for tuning runs on the lent H200.

Not part of the package (`python3 benchmarks/probes/up_down_l2.py [--h-sweep] [--train] > $OUT/up_down_l2.txt`). The
interleaved up/down weight of D = 2048, H = 5632 is 46 MB, about the H200's whole L2 (50 MB). Measurements,
do_bench medians (ms, L2 flushed before each), 29 active units per token throughout:
  1. (--h-sweep) the pass over M tokens at H = 1408 .. 11264 (weights 11.5 .. 92 MB). First run (98c0f3f):
     per active unit 0.90 / 0.94 / 1.06 / 3.40 ns at M = 65536; a fit over M = 16384 and 65536
     gives a fixed cost per call of ~0.02 ms up to 23 MB of weights but ~0.12 ms at 46 MB.
     (Splitting the pass into 2 or 4 passes over tile ranges did not help: 2.045 / 2.575 ms
     against 2.007 ms at M = 65536.)
  Also measured (1c28dfa, with a kernel issuing `prefetch.global.L2::evict_last` over the whole
  weight, 0.015 ms, since removed): prefetching before the pass did not make it faster (0.244 /
  0.603 / 2.021 ms against 0.233 / 0.593 / 2.005 ms at M = 4096 / 16384 / 65536), nor before the
  gate kernel. Cold misses are not what the fixed cost is.
  2. the pass with the same rows reordered (longest first / last), and with the rows of over 4x the
     mean count dropped: whether the few long rows, each a serial chain in one program, set the
     time at small M. First run (1c28dfa, before rows were split): 0.234 ms as drawn, 0.143 ms without those
     rows (5% of the units) at M = 4096; 0.593 / 0.480 at 16384; 2.009 / 1.851 at 65536. That
     led to splitting long rows (kernels/twell_up_down.py); the split configs are timed first.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from triton.testing import do_bench

from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.kernels.twell_train import twell_train_backward, twell_train_forward
from sparseffn.kernels.twell_up_down import default_config, twell_up_down
from sparseffn.ops.twell_mlp import SparseMLPWeights

TILE = 256


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=80, return_mode="median")


def packed(m: int, h: int):
    mlp = synthetic_mlp(m, 2048, h, 29, device="cuda", seed=0)
    w = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    values, columns, counts = gate_twell(mlp.x, mlp.gate_weight, tile=TILE)
    active = int(counts.sum())
    return mlp.x, (w.up_weight, w.down_t), values, columns, counts, active


def main() -> int:
    for m in (16384, 65536) if "--h-sweep" in sys.argv else ():
        for h in (1408, 2816, 5632, 11264):
            x, wud, values, columns, counts, active = packed(m, h)
            out = torch.empty_like(x)
            t = ms(lambda: twell_up_down(x, values, columns, counts, *wud, tile=TILE, out=out))
            gbytes = active * 2 * 2048 * 2 / 1e9
            print(f"M={m} H={h} weights {sum(w.numel() for w in wud) * 2 / 1e6:.0f} MB: {t:.3f} ms, "
                  f"{1e6 * t / active:.3f} ns per active unit, {gbytes / t:.1f} TB/s of weight rows", flush=True)
    for m in (4096, 16384, 65536):
        mlp = synthetic_mlp(m, 2048, 5632, 29, device="cuda", seed=0)
        x = mlp.x
        w = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)
        wud = (w.up_weight, w.down_t)
        values, columns, counts = gate_twell(x, mlp.gate_weight, tile=TILE)
        out = torch.empty_like(x)
        total = counts.sum(1)
        rows = {}
        base = default_config(2048)
        for name, config in (("split off", dataclasses.replace(base, split_slots=0)),
                             ("split 64", dataclasses.replace(base, split_slots=64)),
                             ("split 128 (default)", base),
                             ("split 256", dataclasses.replace(base, split_slots=256)),
                             ("split 128 cap 1024", dataclasses.replace(base, split_cap=1024))):
            rows[name] = ms(lambda: twell_up_down(x, values, columns, counts, *wud, tile=TILE, out=out, config=config))
        off = dataclasses.replace(base, split_slots=0)
        for name, order in (("longest rows first", torch.argsort(total, descending=True)),
                            ("longest rows last", torch.argsort(total))):
            xo, vo, co, no = (t[order].contiguous() for t in (x, values, columns, counts))
            rows[name + " (split off)"] = ms(lambda: twell_up_down(xo, vo, co, no, *wud, tile=TILE, out=out, config=off))
        light = counts.clone()
        light[total > 4 * total.float().mean()] = 0
        rows["rows over 4x mean dropped (split off)"] = ms(
            lambda: twell_up_down(x, values, columns, light, *wud, tile=TILE, out=out, config=off))
        share = float(light.sum()) / float(total.sum())
        print(f"M={m} max {int(total.max())} (share of units kept without heavy rows {share:.3f}): "
              + "  ".join(f"{k} {v:.3f}" for k, v in rows.items()), flush=True)
    if "--train" in sys.argv:
        train_rows()
    return 0


def train_rows() -> None:
    """(--train) The token-major training kernels (kernels/twell_train.py, no row splitting) as drawn
    and with the rows of over 4x the mean count dropped, as in 2."""
    for m in (4096, 16384):
        mlp = synthetic_mlp(m, 2048, 5632, 29, device="cuda", seed=0)
        x, gate, up = mlp.x, mlp.gate_weight, mlp.up_weight
        down_t = mlp.down_weight.t().contiguous()
        values, columns, counts = gate_twell(x, gate, tile=TILE)
        total = counts.sum(1)
        light = counts.clone()
        light[total > 4 * total.float().mean()] = 0
        slots_f32 = torch.empty(values.shape, dtype=torch.float32, device="cuda")
        u, du, dg = slots_f32, torch.empty_like(slots_f32), torch.empty_like(slots_f32)
        y, dx, row_l1 = torch.empty_like(x), torch.empty_like(x), torch.empty(m, device="cuda")
        dy = torch.randn_like(x)
        l1_grad = torch.full((1,), 1e-3, device="cuda")
        rows = {}
        for name, cnt in (("as drawn", counts), ("long rows dropped", light)):
            rows[f"forward {name}"] = ms(lambda: twell_train_forward(
                x, values, columns, cnt, up, down_t, tile=TILE, gated=True, out=y, u_out=u, row_l1_out=row_l1))
            rows[f"backward {name}"] = ms(lambda: twell_train_backward(
                dy, values, columns, cnt, u, gate, up, down_t, l1_grad, tile=TILE, gated=True, dx_out=dx,
                du_out=du, dg_out=dg))
        print(f"train M={m}: " + "  ".join(f"{k} {v:.3f}" for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
