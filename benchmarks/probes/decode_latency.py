"""Where a one-token decode call loses time to latency (H200 probe, bench only). Graph-replayed with
L2 flushed, as `bench decode` times calls; µs, the best median of three rounds:

    floor        one tiny kernel (a graph replay's own cost)
    pair / chain the decode call (gate kernel, down kernel) at 1, 16 and 64 tokens; after a
                 norm-sized kernel that produces x
    cublas_gemv  torch.mv over the gate matrix (23 MB at D=2048/H=5632)
    gemv_bhB_wW  a plain Triton GEMV, B units per program, W warps: the gate kernel without its epilogue
    persist_P_bhB  the same, SMs×P programs looping over the unit blocks, next block loaded before the
                 current one is reduced
    dense        dense torch (three GEMMs)
    *_cleanflush  the same, L2 flushed by reading 256 MB (clean lines) instead of zeroing it
    q_cublas / qkv_cublas / qkv_decode_linear  one token's q, k, v projections (D=2048): one cuBLAS
                 GEMV, three, and one launch of kernels/decode_linear.py over the three matrices (at
                 3b8065c a copy of it in this file, "qkv_triton_bhB_wW": 2 or 4 units per program, 4 or 8
                 warps, 14.1-14.4 µs; the library took 2 and 4)

The probe at ed94851 also launched the down kernel as a programmatic dependent of the gate kernel
(PDL), and let the gate kernel load its rows before waiting for x's producer: no gain, dropped
(CHANGELOG.md, 2026-12-02; benchmarks/results/h200/archive/decode_latency_ed94851.csv).

    python benchmarks/probes/decode_latency.py [OUT_CSV]
"""

import sys

import torch
import triton
import triton.language as tl

from sparseffn.bench.common import write_csv
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.bench.timing import cuda_graphed, run_metadata, time_fn
from sparseffn.kernels import decode_mlp as dm
from sparseffn.kernels._runtime import cdiv, num_sms
from sparseffn.kernels.decode_linear import launch_decode_linear
from sparseffn.ops.twell_mlp import dense_mlp


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, H, D: tl.constexpr, BH: tl.constexpr):
    units = tl.program_id(0) * BH + tl.arange(0, BH)
    k = tl.arange(0, D)
    w = tl.load(w_ptr + units[:, None] * D + k[None, :], mask=(units < H)[:, None], other=0.0)
    xv = tl.load(x_ptr + k).to(tl.float32)
    tl.store(out_ptr + units, tl.sum(w.to(tl.float32) * xv[None, :], axis=1), mask=units < H)


@triton.jit
def _gemv_persistent(x_ptr, w_ptr, out_ptr, H, D: tl.constexpr, BH: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    k = tl.arange(0, D)
    xv = tl.load(x_ptr + k).to(tl.float32)
    units = pid * BH + tl.arange(0, BH)
    w = tl.load(w_ptr + units[:, None] * D + k[None, :], mask=(units < H)[:, None], other=0.0)
    for _ in range(pid, tl.cdiv(H, BH), step):
        nxt = units + step * BH
        w_next = tl.load(w_ptr + nxt[:, None] * D + k[None, :], mask=(nxt < H)[:, None], other=0.0)
        tl.store(out_ptr + units, tl.sum(w.to(tl.float32) * xv[None, :], axis=1), mask=units < H)
        w = w_next
        units = nxt


@triton.jit
def _produce_x(src_ptr, x_ptr, D: tl.constexpr):
    """x = rms_norm(src) for one token: the kernel before a decode MLP."""
    k = tl.arange(0, D)
    v = tl.load(src_ptr + k).to(tl.float32)
    tl.store(x_ptr + k, (v * tl.rsqrt(tl.sum(v * v, axis=0) / D + 1e-6)).to(x_ptr.dtype.element_ty))


def clean_flush_us(fn, dev, reps=200):
    """fn's graph timed after an L2 flush that reads 256 MB (clean lines, as other layers' weights
    leave L2 in a model) instead of do_bench's zeroing (dirty lines written back during fn)."""
    g = cuda_graphed(fn, dev)
    buf = torch.ones(64 * 1024 * 1024, dtype=torch.int32, device=dev)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(10):
        g()
    for start, end in events:
        buf.sum()
        start.record()
        g()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return round(times[len(times) // 2] * 1e3, 2)


def best_us(fn, dev):
    g = cuda_graphed(fn, dev)
    return round(min(time_fn(g, dev, rep_ms=40).median_ms for _ in range(3)) * 1e3, 2)


def calls(m, d=2048, h=5632, nnz=29):
    """{name: fn} of the decode call's variants at m tokens, and checks of the GEMVs against each other."""
    dev = torch.device("cuda")
    mlp = synthetic_mlp(m, d, h, nnz, dtype=torch.bfloat16, device=dev, seed=0)
    gate, up = mlp.gate_weight, mlp.up_weight
    down_t = mlp.down_weight.t().contiguous()
    src = mlp.x.clone()
    x = torch.empty_like(src)

    def produce():
        if m == 1:
            _produce_x[(1,)](src, x, D=d, num_warps=4)
        else:
            x.copy_(src)

    produce()
    out = {"pair": lambda: dm.launch_decode_mlp(x, gate, up, down_t, None),
           "chain": lambda: (produce(), dm.launch_decode_mlp(x, gate, up, down_t, None)),
           "dense": lambda: dense_mlp(x, gate, up, mlp.down_weight, None)}
    checks = {}
    if m == 1:
        out["produce"] = produce
        g32 = torch.empty(h, dtype=torch.float32, device=dev)
        out["cublas_gemv"] = lambda: torch.mv(gate, x[0])
        for bh, w in ((2, 8), (4, 4)):
            out[f"gemv_bh{bh}_w{w}"] = lambda bh=bh, w=w: _gemv[(cdiv(h, bh),)](x, gate, g32, h, D=d, BH=bh, num_warps=w)
        out["persist_4_bh4"] = lambda: _gemv_persistent[(num_sms(dev) * 4,)](x, gate, g32, h, D=d, BH=4, num_warps=4)
        _gemv[(cdiv(h, 4),)](x, gate, g32, h, D=d, BH=4, num_warps=4)
        ref = g32.clone()
        _gemv_persistent[(num_sms(dev) * 4,)](x, gate, g32, h, D=d, BH=4, num_warps=4)
        checks["persist_equal"] = torch.equal(g32, ref)
    return out, checks


def attention_calls(d=2048):
    """q/k/v projections of one token: cuBLAS one by one vs one `kernels/decode_linear.py` launch."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, d, device=dev, generator=gen).bfloat16()
    weights = [torch.randn(d, d, device=dev, generator=gen).div(d ** 0.5).bfloat16() for _ in range(3)]
    want = torch.cat([x @ w.t() for w in weights], 1)
    got = launch_decode_linear(x, weights)
    print("qkv max |diff| vs cuBLAS", (got.float() - want.float()).abs().max().item(), flush=True)
    return {"q_cublas": lambda: torch.mv(weights[0], x[0]),
            "qkv_cublas": lambda: [torch.mv(w, x[0]) for w in weights],
            "qkv_decode_linear": lambda: launch_decode_linear(x, weights)}


if __name__ == "__main__":
    dev = torch.device("cuda")
    meta = run_metadata(dev)
    tiny = torch.zeros(16, device=dev)
    floor = best_us(lambda: tiny.add_(1), dev)
    floor_clean = clean_flush_us(lambda: tiny.add_(1), dev)
    rows = [dict(meta, m=0, name="floor", us=floor), dict(meta, m=0, name="floor_cleanflush", us=floor_clean)]
    print(f"floor {floor} us, clean flush {floor_clean} us", flush=True)
    for m in (1, 16, 64, "attn"):
        fns, checks = (attention_calls(), {}) if m == "attn" else calls(m)
        print(f"M={m} checks {checks}", flush=True)
        for name, fn in list(fns.items()):
            if name != "produce":
                fns[name + "_cleanflush"] = (lambda fn=fn: fn, True)
        for name, fn in fns.items():
            cleanly = isinstance(fn, tuple)
            try:
                us = clean_flush_us(fn[0](), dev) if cleanly else best_us(fn, dev)
            except Exception as err:  # a variant that fails to compile or capture is reported, not fatal
                print(f"M={m} {name}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            rows.append(dict(meta, m=m, name=name, us=us))
            print(f"M={m} {name:<30} {us:7.2f} us", flush=True)
        if len(sys.argv) > 1:
            write_csv(rows, sys.argv[1], tuple(rows[0]))
