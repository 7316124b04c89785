"""Can an idle phase fill L2 with the next launch's weights? (one-off GPU probe)
38 layers of [idle kernel ~IDLE us] -> [one-token read of W_i (N x 2048 bf16)], one CUDA graph.
The idle kernel optionally prefetches W_i into L2 (bulk TMA prefetch or per-line prefetch)."""
import sys, os
import torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer
sys.path.insert(0, "benchmarks/probes")
from gemv_designs import _graph_us

K, LAYERS = 2048, 38


@triton.jit
def _bulk_prefetch(ptrs, on, CHUNK: tl.constexpr):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, on, tl.full(on.shape, CHUNK, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch(ptrs, on):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _idle(w_ptr, n_elems, sink_ptr, ns, MODE: tl.constexpr, CHUNK: tl.constexpr, NT: tl.constexpr,
          PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if MODE == 1:  # one bulk prefetch of CHUNK bytes a thread
        offs = (pid * NT + tl.arange(0, NT)).to(tl.int64) * (CHUNK // 2)
        r = _bulk_prefetch(w_ptr + offs, (offs < n_elems).to(tl.int32), CHUNK)
        tl.store(sink_ptr + pid, tl.sum(r))
    if MODE == 2:  # per 128-byte line, CHUNK bytes a thread
        for j in range(0, CHUNK // 128):
            offs = ((pid * NT + tl.arange(0, NT)).to(tl.int64) * (CHUNK // 2)) + j * 64
            r = _line_prefetch(w_ptr + offs, (offs < n_elems).to(tl.int32))
            tl.store(sink_ptr + pid, tl.sum(r))
    t0 = globaltimer()
    t = t0
    while t - t0 < ns:
        t = globaltimer()


@triton.jit
def _read(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, B: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * B + tl.arange(0, B)
    k = tl.arange(0, K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :]
    if PDL:
        gdc_launch_dependents()
        w = tl.load(w_ptrs, mask=(rows < N)[:, None], other=0.0)
        gdc_wait()
    else:
        w = tl.load(w_ptrs, mask=(rows < N)[:, None], other=0.0)
    x = tl.load(x_ptr + k)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    sink = torch.zeros(1 << 16, device=dev, dtype=torch.int32)
    for n in (5632, 6144):
        ws = [torch.randn(n, K, device=dev, dtype=torch.bfloat16) / 45 for _ in range(LAYERS)]
        bufs = [torch.randn(max(n, K), device=dev) for _ in range(LAYERS + 1)]
        nel = n * K
        for idle_ns in (0, 5000, 10000):
            for mode, chunk, nt in ((0, 4096, 32), (1, 4096, 32), (1, 16384, 32), (1, 65536, 4), (2, 4096, 32), (2, 16384, 128)):
                if idle_ns == 0 and mode:
                    continue
                grid_idle = (max(1, triton.cdiv(nel * 2, chunk * nt)),) if mode else (132,)
                for pdl in (False, True):
                    opts = {"launch_pdl": True} if pdl else {}
                    def layer(i, pdl=pdl, opts=opts, mode=mode, chunk=chunk, nt=nt, g=grid_idle, idle_ns=idle_ns):
                        if idle_ns:
                            _idle[g](ws[i], nel, sink, idle_ns, MODE=mode, CHUNK=chunk, NT=nt, PDL=pdl, num_warps=1, **opts)
                        _read[(triton.cdiv(n, 2),)](bufs[i], ws[i], bufs[i + 1], n, K=K, B=2, PDL=pdl, num_warps=4, **opts)
                    fns = [lambda i=i, f=layer: f(i) for i in range(LAYERS)]
                    us = _graph_us(fns)
                    ref = bufs[0][:K] @ ws[0].float().T
                    fns[0]()
                    torch.cuda.synchronize()
                    err = (bufs[1][:n] - ref).abs().max().item()
                    print(f"N={n} idle={idle_ns/1000:.0f}us mode={mode} chunk={chunk} nt={nt} grid={grid_idle[0]} pdl={int(pdl)}  "
                          f"{us:7.2f} us a layer  err {err:.1e}", flush=True)
            # idle alone
            for mode, chunk, nt in ((0, 4096, 32), (1, 16384, 32)):
                if idle_ns == 0:
                    continue
                g = (max(1, triton.cdiv(nel * 2, chunk * nt)),) if mode else (132,)
                fns = [lambda i=i, g=g, mode=mode, chunk=chunk, nt=nt: _idle[g](ws[i], nel, sink, idle_ns, MODE=mode, CHUNK=chunk, NT=nt, PDL=False, num_warps=1) for i in range(LAYERS)]
                print(f"N={n} idle alone mode={mode} {_graph_us(fns):7.2f} us", flush=True)
        del ws, bufs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
