"""How close can a one-token projection get to the H200's bandwidth? (H200 probe, bench only.) y = x W^T
for x [1, 2048] bf16 and W [N, 2048] (N = 5632, the 2b gate; 6144, its q/k/v), 38 weight copies
(one per layer, 38 x 23 MB, far past the L2) launched back to back in one CUDA graph, timed by the
graph's replays (CUDA events): the time per launch, as the decode step sees it.

    cublas      F.linear
    k1_sparse   the decode MLP's gate kernel (norm fused, 29 active units per token), its default config
    k1_stream   the same with DecodeConfig.stream (the next tile's loads issued before the current is reduced)
    k1_nonorm / k1_noup / k1_bare   ablations: K1 without the fused RMSNorm / without the up pass (non-gated) /
                without both; k1_h2w8, k1_bare_h2w8: K1 and its bare form at rows_2_w8's launch shape
    rows_B      one program per B rows, the whole row in one load (one memory round trip per program)
    pers_P_B    P persistent programs, B rows per block, the next block's load issued before the
                current block is reduced (a register double buffer)
    tma_rR_pP_sS  TMA-fed programs: the weight viewed as [N*K/256, 256] box rows, R rows a block, P
                programs (all: one per block) looping over blocks through an S-deep pipeline of TMA
                loads into shared memory (in-flight bytes bounded by shared memory, not registers)

    python benchmarks/probes/gemv_designs.py OUT_CSV
"""

import dataclasses
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sparseffn.bench.common import write_csv
from sparseffn.bench.timing import run_metadata
from sparseffn.kernels.configs.decode_mlp import default_config
from sparseffn.kernels.decode_mlp import launch_gate_up

K, LAYERS, REPLAYS = 2048, 38, 20


@triton.jit
def _rows(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, B: tl.constexpr):
    rows = tl.program_id(0) * B + tl.arange(0, B)
    k = tl.arange(0, K)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], mask=(rows < N)[:, None], other=0.0)
    x = tl.load(x_ptr + k).to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)


@triton.jit
def _persistent(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, B: tl.constexpr, P: tl.constexpr):
    pid = tl.program_id(0)
    k = tl.arange(0, K)
    x = tl.load(x_ptr + k).to(tl.float32)
    blocks = tl.cdiv(N, B)
    rows = pid * B + tl.arange(0, B)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], mask=(rows < N)[:, None], other=0.0)
    for nxt in range(pid + P, blocks + P, P):
        nrows = nxt * B + tl.arange(0, B)
        w_next = tl.load(w_ptr + nrows.to(tl.int64)[:, None] * K + k[None, :], mask=(nrows < N)[:, None], other=0.0)
        crows = (nxt - P) * B + tl.arange(0, B)
        tl.store(y_ptr + crows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=crows < N)
        w = w_next


@triton.jit
def _tma(x_ptr, w_desc, y_ptr, N, K: tl.constexpr, R: tl.constexpr, BOX: tl.constexpr, P: tl.constexpr,
         STAGES: tl.constexpr):
    SUB: tl.constexpr = K // BOX  # box rows per weight row
    x2 = tl.reshape(tl.load(x_ptr + tl.arange(0, K)).to(tl.float32), (SUB, BOX))
    for blk in tl.range(tl.program_id(0), tl.cdiv(N, R), P, num_stages=STAGES):
        w = tl.reshape(w_desc.load([blk * R * SUB, 0]).to(tl.float32), (R, SUB, BOX))
        rows = blk * R + tl.arange(0, R)
        tl.store(y_ptr + rows, tl.sum(tl.sum(w * x2[None, :, :], axis=2), axis=1), mask=rows < N)


def _graph_us(fns) -> float:
    """µs per call of fns (one per layer), captured in one graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return 1e3 * times[len(times) // 2] / len(fns)


def main(out_csv: str) -> None:
    dev = torch.device("cuda")
    meta = run_metadata(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for n in (5632, 6144):
        ws = [torch.randn(n, K, device=dev, dtype=torch.bfloat16) / 45 for _ in range(LAYERS)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(n, device=dev, dtype=torch.float32)
        ref = F.linear(x.float(), ws[0].float())[0]
        variants = {"cublas": [lambda w=w: F.linear(x, w) for w in ws]}
        if n == 5632:
            up = [torch.randn(n, K, device=dev, dtype=torch.bfloat16) / 45 for _ in range(LAYERS)]
            norm = torch.ones(K, device=dev, dtype=torch.bfloat16)
            g = F.linear(x.float(), ws[0].float())[0]
            theta = torch.full((n,), float(g.sort(descending=True).values[29]), device=dev)
            hidden = torch.empty((n, 1), device=dev, dtype=torch.bfloat16)
            flags = torch.empty(n, device=dev, dtype=torch.int32)
            counts = torch.empty(64, device=dev, dtype=torch.int32)
            base = default_config(1, norm=True)
            rows_like = dataclasses.replace(base, block_h=2, block_k=K, gate_warps=8)
            for name, cfg, nw, gated in (("k1_sparse", base, norm, True),
                                         ("k1_stream", dataclasses.replace(base, stream=True), norm, True),
                                         ("k1_nonorm", base, None, True), ("k1_noup", base, norm, False),
                                         ("k1_bare", base, None, False), ("k1_h2w8", rows_like, norm, True),
                                         ("k1_bare_h2w8", rows_like, None, False)):
                variants[name] = [lambda w=w, u=u, cfg=cfg, nw=nw, gated=gated: launch_gate_up(
                    x, nw, 1e-5, w, u if gated else None, theta, hidden, 1, 1, flags, counts, 32, cfg, "sparse")
                    for w, u in zip(ws, up)]
        for b in (2, 4, 8):
            for warps in (4, 8):
                variants[f"rows_{b}_w{warps}"] = [
                    lambda w=w, b=b, warps=warps: _rows[(triton.cdiv(n, b),)](x, w, y, n, K=K, B=b, num_warps=warps)
                    for w in ws]
        for p_mult in (1, 2, 4, 8):
            for b in (2, 4, 8):
                p = p_mult * sms
                variants[f"pers_{p_mult}x_{b}"] = [
                    lambda w=w, b=b, p=p: _persistent[(p,)](x, w, y, n, K=K, B=b, P=p, num_warps=4) for w in ws]
        box = 256  # a TMA box row: at most 256 elements
        for r in (2, 4):
            descs = [TensorDescriptor.from_tensor(w.view(-1, box), [r * K // box, box]) for w in ws]
            for p_mult, stages in ((0, 1), (1, 4), (2, 4), (4, 3), (4, 4), (2, 6), (1, 8), (8, 2)):
                p = triton.cdiv(n, r) if p_mult == 0 else p_mult * sms
                variants[f"tma_r{r}_p{p_mult or 'all'}_s{stages}"] = [
                    lambda d=d, p=p, r=r, stages=stages: _tma[(p,)](x, d, y, n, K=K, R=r, BOX=box, P=p, STAGES=stages)
                    for d in descs]
        bytes_ = n * K * 2
        for name, fns in variants.items():
            try:
                fns[0]()
                torch.cuda.synchronize()
                err = ""
                if name.startswith(("rows", "pers", "tma")):
                    err = f"{(y - ref).abs().max().item():.1e}"
                us = _graph_us(fns)
                rows.append(dict(meta, n=n, k=K, variant=name, us=round(us, 2), tb_per_s=round(bytes_ / us / 1e6, 2),
                                 max_err=err, error=""))
                print(f"N={n} {name:14s} {us:7.2f} us  {bytes_ / us / 1e6:5.2f} TB/s  {err}", flush=True)
            except Exception as e:  # a variant that fails to compile or run is recorded, the rest go on
                rows.append(dict(meta, n=n, k=K, variant=name, us="", tb_per_s="", max_err="", error=repr(e)[:200]))
                print(f"N={n} {name}: {e!r}"[:300], flush=True)
        del ws
        torch.cuda.empty_cache()
    write_csv(rows, out_csv, tuple(rows[0]))


if __name__ == "__main__":
    main(*sys.argv[1:])
