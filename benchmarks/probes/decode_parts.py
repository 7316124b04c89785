"""Where the decode call's time goes (H200 probe, bench only): per token count, graph-replayed with
L2 flushed as `bench decode` times them, the floor (one tiny kernel), the gate kernel alone, the down
kernel alone on the gate kernel's output, the whole call, and dense torch.

    python benchmarks/probes/decode_parts.py [OUT_CSV]
"""

import sys

import torch

from sparseffn.bench.common import write_csv
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.bench.timing import cuda_graphed, run_metadata, time_fn
from sparseffn.kernels import decode_mlp as dm
from sparseffn.kernels._runtime import capability
from sparseffn.kernels.configs.decode_mlp import default_config
from sparseffn.ops.twell_mlp import dense_mlp


def parts(m, d=2048, h=5632, nnz=29):
    dev = torch.device("cuda")
    mlp = synthetic_mlp(m, d, h, nnz, dtype=torch.bfloat16, device=dev, seed=0)
    x, gate, up = mlp.x, mlp.gate_weight, mlp.up_weight
    down_t = mlp.down_weight.t().contiguous()
    mp = dm.m_pad(m)
    cfg = dm.fitted(default_config(mp, capability(dev)), d)  # the public op's
    hidden = torch.empty((h, mp), dtype=x.dtype, device=dev)
    scratch, counted = dm.down_scratch(cfg, d, h, dev)
    y = torch.empty((m, d), dtype=x.dtype, device=dev)
    tiny = torch.zeros(16, device=dev)

    def k1():
        dm.launch_gate_up(x, None, 0.0, gate, up, None, hidden, 1, mp, scratch[:h], scratch[2 * h:], counted, cfg,
                          "sparse")

    def k2():
        scratch[2 * h:].zero_()  # K1 zeroes the counters before each K2
        dm.launch_down(hidden, scratch, down_t, y, None, cfg, "sparse")

    k1()
    out = {}
    for name, fn in (("floor", lambda: tiny.add_(1)), ("gate_kernel", k1), ("down_kernel", k2),
                     ("both", lambda: dm.launch_decode_mlp(x, gate, up, down_t, None)),
                     ("dense", lambda: dense_mlp(x, gate, up, mlp.down_weight, None))):
        g = cuda_graphed(fn, dev)
        out[name] = round(min(time_fn(g, dev, rep_ms=40).median_ms for _ in range(3)) * 1e3, 2)
    return dict(m=m, d=d, h=h, nnz=nnz, union=int((x @ gate.t() > 0).any(0).sum()), **out)


if __name__ == "__main__":
    meta = run_metadata(torch.device("cuda"))
    rows = []
    for m in (1, 2, 4, 16, 32, 64):
        rows.append(dict(meta, **parts(m)))
        print(rows[-1], flush=True)
    if len(sys.argv) > 1:
        write_csv(rows, sys.argv[1], tuple(rows[0]))
