"""`sparseffn bench mlp --train`: forward + backward of the MLP block, sparse vs dense autograd.

For each shape (D x H), target density and token count M, one realistic synthetic MLP
(bench/synthetic.py) and one upstream gradient dy are built, and every provider runs a training step
of the block on them in the same process:

    dense            three F.linear with the ReLU gate and the L1 penalty, torch autograd
    dense_compiled   torch.compile of the same function
    sparse           sparseffn.sparse_mlp(mode="sparse", return_l1=True): TwELL training kernels
    auto             sparseffn.sparse_mlp(mode="auto", return_l1=True): the path auto mode takes
                     (both given the case's measured mean active units per token, as a layer's activity)
    dense_graph,     the dense / sparse step captured once in a CUDA graph and replayed (CUDA only):
    sparse_graph     its GPU time without the host's launch work, which bounds small token counts

One step is `y, l1 = mlp(x)` then backward of (y, l1) with (dy, L1 coefficient), gradients with
respect to x and the three weights. Each provider's l1 and four gradients are checked against fp32
autograd of `sparse_mlp_reference` first; then the step is timed (median, CUDA events, L2 flushed) and
its peak memory measured: `torch.cuda.max_memory_allocated` during the step minus the memory held
before it (inputs, weights and dy), so it counts what the block saves for backward, its transients and
the gradients it returns. A replayed graph allocates nothing (its memory is the capture's pool): the
graph providers have no peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sparseffn.bench.common import ints, rel_err, shapes, write_csv
from sparseffn.bench.mlp import MLPBenchConfig
from sparseffn.bench.synthetic import synthetic_mlp, with_down_layout
from sparseffn.bench.timing import cuda_graphed, device_slug, run_metadata, time_fn
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.ops.reference import mlp_activation_reference
from sparseffn.ops.sparse_mlp import sparse_mlp
from sparseffn.ops.twell_mlp import dense_mlp

# the training step's graphed providers (inference's auto_graph has no training counterpart: auto mode
# trains densely below 16384 tokens, captured or not)
GRAPH_PROVIDERS = ("dense_graph", "sparse_graph")
TRAIN_PROVIDERS = ("dense", "dense_compiled", "sparse", "auto", *GRAPH_PROVIDERS)
L1_COEFF = 1.0  # weight of l1 in the step's loss; its gradient goes through the same kernels at any value

CSV_FIELDS = (
    "gpu", "torch", "triton", "git_sha", "dtype", "d", "h", "m", "target_nnz", "mean_nnz", "max_nnz",
    "overflow_rows", "provider", "median_ms", "p20_ms", "p80_ms", "speedup_vs_dense", "peak_mib",
    "peak_vs_dense", "l1_rel_err", "grad_rel_err", "dense_grad_rel_err", "within_bound",
)


@dataclass(frozen=True)
class TrainBenchConfig(MLPBenchConfig):
    """`bench mlp`'s fields, with the training step's token counts (providers "": all that run on the
    device, the graph ones on CUDA only)."""

    tokens: str = "4096,16384,65536"


def _reference(params: list[torch.Tensor], gated: bool, dy: torch.Tensor, coeff: float):
    """fp32 autograd truth: (l1, grads) of the step's loss."""
    leaves = [p.detach().float().requires_grad_() for p in params]
    x, rest = leaves[0], leaves[1:]
    gate, up, down = (rest if gated else [None, *rest])
    _, h = mlp_activation_reference(x, gate, up)
    y = h @ down.t()
    l1 = h.abs().sum(-1).mean()
    grads = torch.autograd.grad([y, l1], leaves, [dy.float(), torch.tensor(coeff, device=dy.device)])
    return l1.detach(), grads


def _steps(params: list[torch.Tensor], gated: bool, dy: torch.Tensor, cfg: TrainBenchConfig,
           compiled_dense: Callable, mean_nnz: float) -> dict[str, Callable]:
    """The providers' steps. sparse and auto get the case's measured mean active units per token, as a
    layer passes its measured activity: auto decides from it, and both choose their overflow-row path."""
    coeff = torch.tensor(L1_COEFF, dtype=torch.float32, device=dy.device)

    def split(ps):
        return (ps[0], ps[1], ps[2], ps[3]) if gated else (ps[0], None, ps[1], ps[2])

    def make(forward):
        def step():
            y, l1 = forward(*split(params))
            grads = torch.autograd.grad([y, l1], params, [dy, coeff])
            return l1, grads
        return step

    return {
        "dense": make(lambda x, g, u, d: dense_mlp(x, g, u, d, None, return_l1=True)),
        "dense_compiled": make(lambda x, g, u, d: compiled_dense(x, g, u, d, None, return_l1=True)),
        "sparse": make(lambda x, g, u, d: sparse_mlp(x, g, u, d, mode="sparse", return_l1=True, tile=cfg.tile,
                                                     slots=cfg.slots, expected_nnz=mean_nnz)),
        "auto": make(lambda x, g, u, d: sparse_mlp(x, g, u, d, mode="auto", return_l1=True, tile=cfg.tile,
                                                   slots=cfg.slots, expected_nnz=mean_nnz)),
    }


def _peak_mib(step: Callable, device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return peak / 2**20


def run_train_bench(cfg: TrainBenchConfig, device: torch.device | None = None,
                    log: Callable[[str], None] = print) -> list[dict]:
    """Run every (shape, nnz, M) case; return the CSV rows (also written under cfg.out_dir)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cfg.dtype)
    wanted = [p.strip() for p in cfg.providers.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(TRAIN_PROVIDERS))
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; choose from {TRAIN_PROVIDERS}")
    if not wanted:
        wanted = [p for p in TRAIN_PROVIDERS if device.type == "cuda" or p not in GRAPH_PROVIDERS]
    graphs = sorted(set(wanted) & set(GRAPH_PROVIDERS))
    if graphs and device.type != "cuda":
        raise ValueError(f"providers: {graphs} capture CUDA graphs and need a CUDA device, not {device}")
    meta = run_metadata(device)
    if cfg.git_sha:
        meta["git_sha"] = cfg.git_sha
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled_dense = torch.compile(dense_mlp, dynamic=False)
    rows: list[dict] = []
    csv_path = Path(cfg.out_dir) / device_slug(device) / "mlp_train.csv"
    for d, h in shapes(cfg.shapes):
        for target in ints(cfg.nnz):
            for m in ints(cfg.tokens):
                mlp = with_down_layout(synthetic_mlp(m, d, h, min(target, h), dtype=dtype, device=device, seed=cfg.seed),
                                       cfg.down_layout)
                rows += _bench_case(cfg, mlp, wanted, meta, device, log, compiled_dense)
                write_csv(rows, csv_path, CSV_FIELDS)
                del mlp
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _bench_case(cfg, mlp, wanted, meta, device, log, compiled_dense) -> list[dict]:
    m, d = mlp.x.shape
    h = mlp.up_weight.shape[0]
    gated = mlp.gate_weight is not None
    params = [t.detach().clone().requires_grad_() for t in (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
              if t is not None]
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    dy = torch.randn(m, d, generator=gen, device=device).to(mlp.x.dtype)
    _, _, counts = gate_twell(mlp.x, mlp.first_weight, tile=cfg.tile, slots=cfg.slots)
    nnz = counts.sum(1, dtype=torch.int64).double()
    stats = {
        "dtype": cfg.dtype, "d": d, "h": h, "m": m, "target_nnz": mlp.target_nnz,
        "mean_nnz": round(float(nnz.mean()), 2), "max_nnz": int(nnz.max()),
        "overflow_rows": int((counts > cfg.slots).any(1).sum()),
    }
    ref_l1, ref_grads = _reference(params, gated, dy, L1_COEFF)
    steps = _steps(params, gated, dy, cfg, compiled_dense, float(nnz.mean()))
    for name in GRAPH_PROVIDERS:
        if name in wanted:  # checked below like the others: the replay's l1 and gradients
            steps[name] = cuda_graphed(steps[name.removesuffix("_graph")], device)
    floor = torch.finfo(mlp.x.dtype).eps / 2
    results = {}
    for name in dict.fromkeys(["dense", *wanted]):
        l1, grads = steps[name]()
        l1_err = rel_err(l1, ref_l1)
        grad_err = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
        del l1, grads
        peak = float("nan") if name in GRAPH_PROVIDERS else _peak_mib(steps[name], device)
        results[name] = (time_fn(steps[name], device, rep_ms=cfg.rep_ms), peak, l1_err, grad_err)
    del ref_grads
    base_ms, base_peak, _, dense_err = results["dense"][0].median_ms, results["dense"][1], 0, results["dense"][3]
    rows = []
    for name in wanted:
        timing, peak, l1_err, grad_err = results[name]
        rows.append(dict(
            meta, **stats, provider=name, median_ms=round(timing.median_ms, 5), p20_ms=round(timing.p20_ms, 5),
            p80_ms=round(timing.p80_ms, 5), speedup_vs_dense=round(base_ms / timing.median_ms, 4),
            peak_mib=round(peak, 1), peak_vs_dense=round(peak / base_peak, 4) if base_peak == base_peak else "",
            l1_rel_err=f"{l1_err:.3e}", grad_rel_err=f"{grad_err:.3e}", dense_grad_rel_err=f"{dense_err:.3e}",
            within_bound=str(grad_err <= 2 * dense_err + floor),
        ))
    line = f"train D={d} H={h} M={m:>6} nnz {stats['mean_nnz']:7.1f} ({stats['overflow_rows']} overflow rows): " \
           f"dense {base_ms:.3f} ms {base_peak:.0f} MiB"
    if "sparse" in results:
        timing, peak, _, grad_err = results["sparse"]
        line += f", sparse {timing.median_ms:.3f} ms ({base_ms / timing.median_ms:.2f}x), {peak:.0f} MiB " \
                f"({peak / base_peak:.2f}x), grad err {grad_err:.1e} vs dense {dense_err:.1e}"
    if "auto" in results:
        line += f", auto {results['auto'][0].median_ms:.3f} ms ({base_ms / results['auto'][0].median_ms:.2f}x)"
    if "sparse_graph" in results and "dense_graph" in results:
        graph_ms, dense_graph_ms = results["sparse_graph"][0].median_ms, results["dense_graph"][0].median_ms
        line += f"; graphed sparse {graph_ms:.3f} ms ({dense_graph_ms / graph_ms:.2f}x graph / graph)"
    log(line)
    return rows
