"""`sparseffn bench decode` (MLP level): few-token MLP calls, dense torch vs the decode kernels.

For each shape (D x H), target density and token count M, one realistic synthetic MLP
(bench/synthetic.py) and, in the same process, these providers:

    dense          three F.linear with the ReLU gate (eager): the baseline of every ratio
    sparse         sparse_mlp(mode="sparse") with prepared weights: the decode kernels at M <= 64
    auto           sparse_mlp(mode="auto") with the measured density: what a model runs
    dense_graph / sparse_graph / auto_graph   the same, captured in a CUDA graph and replayed

each timed cold (L2 flushed before every call, as in a model whose other layers evicted this one's
weights) and warm (back-to-back replays/calls, weights left in L2). Eager providers also report the
host time of a call (µs the CPU spends issuing it). Each output is checked against the fp32
reference first. Rows go to `decode_mlp.csv` with the GPU name, versions and git sha.

`sweep_configs` times the decode kernels' launch configs one kernel at a time (bench only).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton

from sparseffn.bench.common import ints, rel_err, shapes, write_csv
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.bench.timing import cuda_graphed, device_slug, median_timing, run_metadata, time_fn
from sparseffn.kernels._runtime import capability
from sparseffn.kernels.configs.decode_mlp import fit_shared_memory
from sparseffn.kernels.decode_mlp import DecodeConfig, default_config, launch_decode_mlp, m_pad
from sparseffn.ops.reference import sparse_mlp_reference
from sparseffn.ops.sparse_mlp import choose_mode, sparse_mlp
from sparseffn.ops.twell_mlp import SparseMLPWeights, dense_mlp

PROVIDERS = ("dense", "sparse", "auto", "dense_graph", "sparse_graph", "auto_graph")
CSV_FIELDS = (
    "gpu", "torch", "triton", "git_sha", "dtype", "d", "h", "m", "target_nnz", "mean_nnz", "union_units",
    "provider", "mode", "l2", "median_us", "p20_us", "p80_us", "speedup_vs_dense", "host_us", "rel_err",
    "dense_rel_err", "within_bound",
)


@dataclass(frozen=True)
class DecodeBenchConfig:
    shapes: str = "2048x5632,4096x14336"  # D x H
    tokens: str = "1,4,16,64,256"
    nnz: str = "29,110"
    dtype: str = "bfloat16"
    seed: int = 0
    rep_ms: int = 60
    out_dir: str = "benchmarks/results"
    git_sha: str = ""


def _warm_time(fn: Callable[[], object], rep: int = 200) -> list[float]:
    """µs per call of back-to-back calls (no L2 flush): [median, p20, p80] over 5 batches."""
    for _ in range(5):
        fn()
    per_batch = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rep):
            fn()
        end.record()
        end.synchronize()
        per_batch.append(1e3 * start.elapsed_time(end) / rep)
    per_batch.sort()
    return [per_batch[2], per_batch[1], per_batch[3]]


def _host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """CPU time to issue one call (the GPU never waits on the CPU here: the median over batches)."""
    fn()
    torch.cuda.synchronize()
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append(1e6 * (time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return sorted(batches)[2]


def run_decode_bench(cfg: DecodeBenchConfig, device: torch.device | None = None,
                     log: Callable[[str], None] = print) -> list[dict]:
    device = device or torch.device("cuda")
    if device.type != "cuda":
        raise ValueError("bench decode times CUDA graphs and kernels: it needs a CUDA device")
    dtype = getattr(torch, cfg.dtype)
    meta = run_metadata(device)
    if cfg.git_sha:
        meta["git_sha"] = cfg.git_sha
    rows: list[dict] = []
    path = Path(cfg.out_dir) / device_slug(device) / "decode_mlp.csv"
    for (d, h), target, m in itertools.product(shapes(cfg.shapes), ints(cfg.nnz), ints(cfg.tokens)):
        mlp = synthetic_mlp(m, d, h, min(target, h), dtype=dtype, device=device, seed=cfg.seed)
        rows += _case(cfg, mlp, meta, log)
        write_csv(rows, path, CSV_FIELDS)
        del mlp
        torch.cuda.empty_cache()
    return rows


def _case(cfg, mlp, meta, log) -> list[dict]:
    x, gate, up, down = mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight
    m, d = x.shape
    h = up.shape[0]
    weights = SparseMLPWeights.prepare(gate, up, down)
    ref = sparse_mlp_reference(x.float(), gate.float(), up.float(), down.float())
    active = torch.relu(x @ gate.t()) != 0
    mean_nnz = float(active.sum(1, dtype=torch.float64).mean())
    providers = {
        "dense": lambda: dense_mlp(x, gate, up, down, None),
        "sparse": lambda: sparse_mlp(x, gate, up, down, mode="sparse", prepared=weights),
        "auto": lambda: sparse_mlp(x, gate, up, down, prepared=weights, expected_nnz=mean_nnz),
    }
    for name in ("dense", "sparse", "auto"):
        providers[f"{name}_graph"] = cuda_graphed(providers[name], x.device)
    dense_err = rel_err(providers["dense"](), ref)
    stats = dict(meta, dtype=cfg.dtype, d=d, h=h, m=m, target_nnz=mlp.target_nnz, mean_nnz=round(mean_nnz, 2),
                 union_units=int(active.any(0).sum()), dense_rel_err=f"{dense_err:.3e}")
    floor = torch.finfo(x.dtype).eps / 2
    timed = {}
    for name in PROVIDERS:
        err = rel_err(providers[name](), ref)
        cold = median_timing([time_fn(providers[name], x.device, rep_ms=cfg.rep_ms) for _ in range(3)])
        warm = _warm_time(providers[name])
        host = _host_us(providers[name]) if not name.endswith("_graph") else float("nan")
        timed[name] = (cold, warm, host, err)
    # auto mode's path eagerly, and under capture (where its host work per call is paid once)
    mode = choose_mode(x, up, expected_nnz=mean_nnz, down_t_ready=True).mode
    graph_mode = _decision_under_capture(x, up, mean_nnz)
    rows = []
    for l2, index in (("cold", 0), ("warm", 1)):
        base = timed["dense"][0].median_ms * 1e3 if l2 == "cold" else timed["dense"][1][0]
        for name, (cold, warm, host, err) in timed.items():
            us = [cold.median_ms * 1e3, cold.p20_ms * 1e3, cold.p80_ms * 1e3] if l2 == "cold" else warm
            auto_mode = graph_mode if name == "auto_graph" else mode
            rows.append(dict(stats, provider=name, l2=l2, mode="sparse" if name.startswith("sparse") else (
                             auto_mode if name.startswith("auto") else "dense"),
                             median_us=round(us[0], 2), p20_us=round(us[1], 2), p80_us=round(us[2], 2),
                             speedup_vs_dense=round(base / us[0], 3), host_us=round(host, 1),
                             rel_err=f"{err:.3e}", within_bound=str(err <= 2 * dense_err + floor)))
    dg, sg = timed["dense_graph"][0].median_ms * 1e3, timed["sparse_graph"][0].median_ms * 1e3
    log(f"D={d} H={h} M={m:>4} nnz {mean_nnz:6.1f} (union {stats['union_units']}): graphs cold dense {dg:.1f} µs, "
        f"sparse {sg:.1f} µs ({dg / sg:.2f}x); eager host µs dense {timed['dense'][2]:.0f} sparse "
        f"{timed['sparse'][2]:.0f}; err {timed['sparse'][3]:.1e} vs dense {dense_err:.1e}")
    return rows


def _decision_under_capture(x: torch.Tensor, up: torch.Tensor, expected_nnz: float) -> str:
    """The path auto mode takes for this call inside a CUDA-graph capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        return choose_mode(x, up, expected_nnz=expected_nnz, down_t_ready=True).mode


def _sweep_grids(m: int) -> dict[str, list[dict]]:
    """The parameter changes `sweep_configs` tries at m tokens, per part: the gate kernel's, the down
    kernel's, at one token the streamed K1 loops (stream), from 3 tokens on compact_up (K1's up pass over
    its gathered active units)."""
    if m == 1:
        gate = [dict(block_h=bh, block_k=bk, gate_warps=w, gate_stages=1)
                for bh, bk, w in itertools.product((4, 8), (1024, 2048), (4, 8)) if bh * bk <= 16384]
        down = [dict(split=sp, block_d=bd, block_s=128, down_stages=1)
                for sp, bd in itertools.product((1, 2, 4, 8), (32, 64))]
    elif m == 2:
        gate = [dict(block_h=bh, block_k=bk, gate_warps=w, gate_stages=1)
                for bh, bk, w in itertools.product((2, 4, 8), (1024, 2048), (4, 8)) if bh * bk <= 8192]
        down = [dict(split=sp, block_d=bd, block_s=64, down_stages=st)
                for sp, bd, st in itertools.product((1, 4, 8), (32, 64), (1, 2))]
    else:
        gate = [dict(block_h=bh, block_k=bk, gate_stages=st)
                for bh, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4))]
        down = [dict(split=sp, block_d=bd, block_s=128)
                for sp, bd in itertools.product((1, 2, 4, 8), (32, 64, 128))]
    grids = {"gate": gate, "down": down}
    if m == 1:
        grids["one_token"] = [dict(stream=True, block_h=bh, block_k=bk)
                              for bh, bk in ((4, 2048), (4, 1024), (4, 512), (8, 256))]
    elif m >= 3:
        grids["compact_up"] = [dict(compact_up=True, up_k=k, up_stages=st) for k, st in ((1024, 2), (512, 2), (512, 3),
                                                                                     (256, 4))]
    return grids


def sweep_configs(d: int = 2048, h: int = 5632, tokens: str = "1,2,4,16,32,64", target_nnz: float = 29,
                  device: torch.device | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Each decode config of a grid, graph-replayed with L2 flushed, per token count: the whole call
    (both kernels) with one kernel's parameters varied at a time from the default. Returns rows."""
    device = device or torch.device("cuda")
    rows = []
    for m in ints(tokens):
        mlp = synthetic_mlp(m, d, h, target_nnz, dtype=torch.bfloat16, device=device, seed=0)
        down_t = mlp.down_weight.t().contiguous()
        base = default_config(m_pad(m))
        grids = _sweep_grids(m)
        for part, grid in grids.items():
            for change in grid:
                config = dataclasses.replace(base, **change)
                if part == "compact_up":  # its own loop's stages within the GPU's shared memory
                    config = fit_shared_memory(config, m_pad(m), capability(device))
                try:
                    call = cuda_graphed(lambda c=config: launch_decode_mlp(
                        mlp.x, mlp.gate_weight, mlp.up_weight, down_t, None, config=c), device)
                except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError,
                        RuntimeError) as error:  # a config this GPU or compiler cannot run: listed with its error
                    rows.append(dict(m=m, part=part, us=float("nan"), error=str(error)[:80],
                                     **dataclasses.asdict(config)))
                    continue
                us = time_fn(call, device, rep_ms=30).median_ms * 1e3
                rows.append(dict(m=m, part=part, us=round(us, 2), error="", **dataclasses.asdict(config)))
        best = {part: min((r for r in rows if r["m"] == m and r["part"] == part and not r["error"]),
                          key=lambda r: r["us"])
                for part in grids}
        log(f"M={m}: default {base}; " + "; ".join(f"best {part} {row}" for part, row in best.items()))
        del mlp
    return rows


def decode_table(rows: list[dict]) -> str:
    """Markdown: per shape, density and M, graphed cold-L2 µs of dense and sparse, the ratio, auto's
    path and ratio, and eager host µs."""
    def get(row_key, provider, l2="cold"):
        return next((r for r in rows if (r["d"], r["h"], r["target_nnz"], r["m"]) == row_key
                     and r["provider"] == provider and r["l2"] == l2), None)

    lines = ["| D×H | nnz/token | M | union units | dense graph µs | sparse graph µs | speed-up | auto graph "
             "(path) | warm L2 speed-up | eager host µs dense / sparse |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["d"], r["h"], r["target_nnz"], r["m"]) for r in rows))
    for key in keys:
        dense, sparse, auto = get(key, "dense_graph"), get(key, "sparse_graph"), get(key, "auto_graph")
        warm_d, warm_s = get(key, "dense_graph", "warm"), get(key, "sparse_graph", "warm")
        eager_d, eager_s = get(key, "dense"), get(key, "sparse")
        if not (dense and sparse and auto and warm_d and warm_s and eager_d and eager_s):
            continue
        d, h, nnz, m = key
        lines.append(
            f"| {d}×{h} | {sparse['mean_nnz']} | {m} | {sparse['union_units']} | {float(dense['median_us']):.1f} | "
            f"{float(sparse['median_us']):.1f} | {float(dense['median_us']) / float(sparse['median_us']):.2f}x | "
            f"{float(dense['median_us']) / float(auto['median_us']):.2f}x ({auto['mode']}) | "
            f"{float(warm_d['median_us']) / float(warm_s['median_us']):.2f}x | "
            f"{float(eager_d['host_us']):.0f} / {float(eager_s['host_us']):.0f} |")
    return "\n".join(lines)


def plot_decode(rows: list[dict], path: Path) -> Path:
    """Speed-up of the graphed decode kernels over graphed dense torch (cold L2) against M."""
    from sparseffn.bench.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    series = dict.fromkeys((r["d"], r["h"], r["target_nnz"]) for r in rows)
    for d, h, nnz in series:
        pts = []
        for m in sorted({int(r["m"]) for r in rows}):
            pick = {r["provider"]: float(r["median_us"]) for r in rows if (r["d"], r["h"], r["target_nnz"]) ==
                    (d, h, nnz) and int(r["m"]) == m and r["l2"] == "cold"}
            if "dense_graph" in pick and "sparse_graph" in pick:
                pts.append((m, pick["dense_graph"] / pick["sparse_graph"]))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"D={d} H={h}, {nnz} active/token")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per call (M)")
    ax.set_ylabel("speed-up over dense torch (CUDA graphs, cold L2)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


__all__ = ["DecodeBenchConfig", "DecodeConfig", "decode_table", "plot_decode", "run_decode_bench", "sweep_configs"]
