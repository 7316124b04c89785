"""Does programmatic dependent launch (PDL) recover the fixed cost of each launch in a chain of one-token
reads? (GPU probe, bench only.) 38 launches of y = x W^T in one CUDA graph, each reading the x the launch
before it wrote (fp32, the first K of its N outputs), so each depends on its predecessor as the decode
step's kernels do; W [N, 2048] bf16, one per launch (N = 5632, the 2b gate; 2048, its o_proj), one program
per B rows, the whole row in one load. Three forms of the same kernel:

    plain               no PDL: each launch starts once the one before has finished
    pdl_weights_first   launched with PDL; lets the next launch start at once, loads its weight rows
                        (never written) before griddepcontrol.wait, x after
    pdl_all_after       launched with PDL; every load after griddepcontrol.wait (launch overlap only)

    python benchmarks/probes/gemv_chain_pdl.py OUT_CSV
"""

import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gemv_designs import _graph_us
from sparseffn.bench.common import write_csv
from sparseffn.bench.timing import run_metadata

K, LAYERS = 2048, 38


@triton.jit
def _chain(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, B: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    rows = tl.program_id(0) * B + tl.arange(0, B)
    k = tl.arange(0, K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    if PDL:
        gdc_launch_dependents()
    if EARLY:
        w = tl.load(w_ptrs, mask=(rows < N)[:, None], other=0.0)
    if PDL:
        gdc_wait()
    if not EARLY:
        w = tl.load(w_ptrs, mask=(rows < N)[:, None], other=0.0)
    x = tl.load(x_ptr + k)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)


def main(out_csv: str) -> None:
    dev = torch.device("cuda")
    meta = run_metadata(dev)
    rows = []
    for n in (5632, 2048):
        ws = [torch.randn(n, K, device=dev, dtype=torch.bfloat16) / 45 for _ in range(LAYERS)]
        bufs = [torch.randn(max(n, K), device=dev) for _ in range(LAYERS + 1)]
        for b in (2, 4):
            for form, pdl, early in (("plain", False, False), ("pdl_weights_first", True, True),
                                     ("pdl_all_after", True, False)):
                opts = {"launch_pdl": True} if pdl else {}
                fns = [lambda i=i, pdl=pdl, early=early, opts=opts: _chain[(triton.cdiv(n, b),)](
                    bufs[i], ws[i], bufs[i + 1], n, K=K, B=b, PDL=pdl, EARLY=early, num_warps=4, **opts)
                    for i in range(LAYERS)]
                us = _graph_us(fns)
                ref = bufs[0][:K] @ ws[0].float().T
                fns[0]()
                torch.cuda.synchronize()
                err = (bufs[1][:n] - ref).abs().max().item()
                rows.append(dict(meta, n=n, k=K, rows_per_program=b, form=form, us=round(us, 2),
                                 tb_per_s=round(n * K * 2 / us / 1e6, 2), max_err=f"{err:.1e}"))
                print(f"N={n} B={b} {form:18s} {us:7.2f} us a launch  {n * K * 2 / us / 1e6:5.2f} TB/s  err {err:.1e}",
                      flush=True)
        del ws, bufs
        torch.cuda.empty_cache()
    write_csv(rows, out_csv, tuple(rows[0]))


if __name__ == "__main__":
    main(*sys.argv[1:])
