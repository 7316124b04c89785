"""Can one persistent launch per layer (or per step) with grid barriers between its phases beat a launch
per phase at one token? (GPU probe, bench only.) A chain shaped as the 2b decode step's reads: per layer
five dependent phases y = x W^T over W [N, 2048] bf16 with N = 6144 (q/k/v), 1200 (the KV cache at
position ~600, 4.9 MB), 2048 (o_proj), 5632 (gate), 64 (the active units' up/down rows); each phase reads
the x the phase before wrote (fp32), 38 layers, every layer's weights distinct (2.35 GB a step).

    launches          a launch per phase, one program per R rows (190 launches a step, one CUDA graph)
    launches_pdl      the same with programmatic dependent launch, weight rows loaded before the wait
    persistent_layer  one launch per layer, P programs (SMs x per_sm), phases separated by a grid barrier
                      (every program adds one to a counter, release, then polls it with acquire loads)
    persistent_step   one launch for all 38 layers
    ..._prefetch      each program loads its first tile of the next phase before the barrier
    barriers          the persistent_step launch with no rows: 190 barriers alone, per barrier

    python benchmarks/probes/persistent_chain.py OUT_CSV
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
PHASES = (6144, 1200, 2048, 5632, 64)
XMAX = 8192


@triton.jit
def grid_sync(count_ptr, target):
    tl.debug_barrier()  # the program's writes are issued before the release
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def grid_exit(count_ptr, exit_ptr, programs):
    """The last program out resets both counters for the next launch (all have passed the last barrier)."""
    if tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(exit_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _phase_launch(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    k = tl.arange(0, K)
    if PDL:
        gdc_launch_dependents()
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], mask=(rows < N)[:, None], other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + k)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)


@triton.jit
def _tile(w_ptr, t, n, K: tl.constexpr, R: tl.constexpr):
    rows = t * R + tl.arange(0, R)
    k = tl.arange(0, K)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], mask=(rows < n)[:, None], other=0.0)


@triton.jit
def _persistent(w_ptr, x_ptr, count_ptr, exit_ptr, sizes_ptr, offs_ptr, step0, steps, n_phases, layer_elems,
                K: tl.constexpr, R: tl.constexpr, XMAX: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    k = tl.arange(0, K)
    n = tl.load(sizes_ptr)
    base = w_ptr
    w = _tile(base, pid, n, K, R)
    for step in range(steps):
        ph = step % n_phases
        n = tl.load(sizes_ptr + ph)
        base = w_ptr + (step // n_phases).to(tl.int64) * layer_elems + tl.load(offs_ptr + ph).to(tl.int64) * K
        if not PREFETCH:
            w = _tile(base, pid, n, K, R)
        x = tl.load(x_ptr + ((step0 + step) % 2) * XMAX + k, cache_modifier=".cg")
        dst = x_ptr + ((step0 + step + 1) % 2) * XMAX
        for t in range(pid, tl.cdiv(n, R), nprog):
            w_next = _tile(base, t + nprog, n, K, R)  # past the phase's rows: masked, no traffic
            rows = t * R + tl.arange(0, R)
            tl.store(dst + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < n)
            w = w_next
        if PREFETCH and step + 1 < steps:
            nph = (step + 1) % n_phases
            nn = tl.load(sizes_ptr + nph)
            nbase = w_ptr + ((step + 1) // n_phases).to(tl.int64) * layer_elems + \
                tl.load(offs_ptr + nph).to(tl.int64) * K
            w = _tile(nbase, pid, nn, K, R)
        grid_sync(count_ptr, (step + 1) * nprog)
    grid_exit(count_ptr, exit_ptr, nprog)


def main(out_csv: str) -> None:
    dev = torch.device("cuda")
    meta = run_metadata(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows_per_layer = sum(PHASES)
    w = torch.randn(LAYERS, rows_per_layer, K, device=dev, dtype=torch.bfloat16) / 45
    offs = [sum(PHASES[:i]) for i in range(len(PHASES))]
    sizes_t = torch.tensor(PHASES, device=dev, dtype=torch.int32)
    offs_t = torch.tensor(offs, device=dev, dtype=torch.int32)
    x = torch.zeros(2 * XMAX, device=dev)
    x[:K] = torch.randn(K, device=dev)
    x0 = x.clone()
    counters = torch.zeros(2, device=dev, dtype=torch.int32)
    bytes_step = LAYERS * rows_per_layer * K * 2
    steps = LAYERS * len(PHASES)

    def reference() -> torch.Tensor:  # rows past a phase's N keep what an earlier phase wrote there
        buf = x0.clone()
        for s in range(steps):
            layer, ph = divmod(s, len(PHASES))
            n, o = PHASES[ph], offs[ph]
            src, dst = buf[(s % 2) * XMAX:], buf[((s + 1) % 2) * XMAX:]
            dst[:n] = w[layer, o:o + n].float() @ src[:K]
        return buf[(steps % 2) * XMAX:][:K].clone()

    ref = reference()
    results = []

    def record(form, r, per_sm, us, got):
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        results.append(dict(meta, form=form, rows_per_tile=r, programs_per_sm=per_sm, us_per_step=round(us, 1),
                            tb_per_s=round(bytes_step / us / 1e6, 2), rel_err=f"{err:.1e}"))
        print(f"{form:28s} R={r} per_sm={per_sm} {us:8.1f} us a step {bytes_step / us / 1e6:5.2f} TB/s err {err:.1e}",
              flush=True)

    # a launch per phase; buffers ping-pong as in the persistent kernel (x[:K] of step s+1 = y of step s)
    for r in (2, 4):
        for pdl in (False, True):
            opts = {"launch_pdl": True} if pdl else {}
            fns = []
            for s in range(steps):
                layer, ph = divmod(s, len(PHASES))
                n, o = PHASES[ph], offs[ph]
                src, dst = x[(s % 2) * XMAX:], x[((s + 1) % 2) * XMAX:]
                fns.append(lambda src=src, dst=dst, ww=w[layer, o:o + n], n=n: _phase_launch[(triton.cdiv(n, r),)](
                    src, ww, dst, n, K=K, R=r, PDL=pdl, num_warps=4, **opts))
            x.copy_(x0)
            us = _graph_us(fns) * steps
            x.copy_(x0)
            for f in fns:
                f()
            torch.cuda.synchronize()
            record("launches_pdl" if pdl else "launches", r, 0, us, x[(steps % 2) * XMAX:][:K])

    for per_launch in ("layer", "step"):
        for r, warps in ((4, 4), (8, 8), (16, 8)):
            for per_sm in (1, 2):
                for prefetch in (False, True):
                    grid = (sms * per_sm,)
                    n_launch = LAYERS if per_launch == "layer" else 1
                    steps_per = steps // n_launch

                    def fns_for(prefetch=prefetch, r=r, warps=warps, grid=grid, steps_per=steps_per,
                                n_launch=n_launch):
                        out = []
                        for i in range(n_launch):
                            out.append(lambda i=i: _persistent[grid](
                                w[i * LAYERS // n_launch:], x, counters[:1], counters[1:], sizes_t, offs_t,
                                i * steps_per, steps_per,
                                len(PHASES), rows_per_layer * K, K=K, R=r, XMAX=XMAX, PREFETCH=prefetch,
                                num_warps=warps))
                        return out

                    fns = fns_for()
                    # compile and check occupancy before the first real launch (a grid that cannot be
                    # resident at once would hang)
                    kernel = _persistent.warmup(w, x, counters[:1], counters[1:], sizes_t, offs_t, 0, steps_per,
                                                len(PHASES), rows_per_layer * K, K=K, R=r, XMAX=XMAX,
                                                PREFETCH=prefetch, num_warps=warps, grid=grid)
                    kernel._init_handles()
                    regs = kernel.n_regs
                    fit = min(65536 // max(1, regs * 32 * warps), 64 // warps)
                    if fit < per_sm:
                        print(f"skip {per_launch} R={r} per_sm={per_sm}: {regs} registers, {fit} fit", flush=True)
                        continue
                    x.copy_(x0)
                    us = _graph_us(fns) * len(fns)
                    x.copy_(x0)
                    for f in fns:
                        f()
                    torch.cuda.synchronize()
                    form = f"persistent_{per_launch}" + ("_prefetch" if prefetch else "")
                    record(form, r, per_sm, us, x[(steps % 2) * XMAX:][:K])
    empty = torch.zeros(len(PHASES), device=dev, dtype=torch.int32)
    for per_sm in (1, 2, 4):  # _persistent at R=4 fits 4 programs per SM (checked above)
        us = _graph_us([lambda per_sm=per_sm: _persistent[(sms * per_sm,)](
            w, x, counters[:1], counters[1:], empty, empty, 0, steps, len(PHASES), 0, K=K, R=4, XMAX=XMAX,
            PREFETCH=False, num_warps=4)])
        results.append(dict(meta, form="barriers", rows_per_tile=4, programs_per_sm=per_sm,
                            us_per_step=round(us, 1), tb_per_s="", rel_err=""))
        print(f"barriers alone, {sms * per_sm} programs: {us / steps:.2f} us a barrier", flush=True)
    write_csv(results, out_csv, tuple(results[0]))


if __name__ == "__main__":
    main(*sys.argv[1:])
