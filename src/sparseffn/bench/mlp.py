"""`sparseffn bench mlp`: sparse MLP inference vs dense torch, side by side on the same inputs.

For each shape (D x H), target density and token count M, one realistic synthetic MLP
(bench/synthetic.py) is built and every provider runs on it in the same process:

    dense            three F.linear (gate, up, down) with the ReLU gate: the baseline of every ratio
    dense_merged     one F.linear over [gate; up] concatenated, then down
    dense_compiled   torch.compile of the dense function
    sparse           sparseffn, mode="sparse" (gate GEMM packing TwELL, fused up/down, dense backup)
    auto             sparseffn, mode="auto" with the measured mean nnz as its density hint
    gate_cublas      the gate step alone: F.linear + ReLU (dense output)
    gate_pack        the gate step alone: Triton GEMM + TwELL packing epilogue (what `sparse` runs)
    dense_graph      `dense` captured in a CUDA graph and replayed (CUDA only)
    sparse_graph     `sparse` captured in a CUDA graph and replayed (CUDA only)
    auto_graph       `auto` captured in a CUDA graph and replayed (CUDA only)

The down weight is stored as `down_layout` says ("transposed", as SparseMLP stores it, by default);
every provider reads the same tensors.

The graph providers take the host launch work out of the timing, as serving stacks do with CUDA graphs:
at small M an eager call costs more host time than GPU time and the L2 flush no longer hides it.
Ratios stay over eager `dense`; dense_graph is its own graphed counterpart.

Each output is checked against the fp32 reference before it is timed. Rows go to a long-format CSV
with the GPU name, versions and git sha.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from sparseffn.bench.common import ints, rel_err, shapes, write_csv
from sparseffn.bench.synthetic import synthetic_mlp, with_down_layout
from sparseffn.bench.timing import cuda_graphed, device_slug, median_timing, run_metadata, time_fn
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.ops.reference import sparse_mlp_reference
from sparseffn.ops.sparse_mlp import choose_mode, sparse_mlp
from sparseffn.ops.twell_mlp import SparseMLPWeights, dense_mlp

PROVIDERS = ("dense", "dense_merged", "dense_compiled", "sparse", "auto", "gate_cublas", "gate_pack",
             "dense_graph", "sparse_graph", "auto_graph")
GRAPH_PROVIDERS = ("dense_graph", "sparse_graph", "auto_graph")
TIMING_ROUNDS = 3

CSV_FIELDS = (
    "gpu", "torch", "triton", "git_sha", "dtype", "d", "h", "m", "target_nnz", "mean_nnz", "max_nnz",
    "overflow_rows", "provider", "mode", "median_ms", "p20_ms", "p80_ms", "speedup_vs_dense",
    "rel_err", "dense_rel_err", "within_bound",
)


@dataclass(frozen=True)
class MLPBenchConfig:
    shapes: str = "2048x5632,4096x14336"  # D x H, comma separated
    tokens: str = "1,16,256,4096,16384,65536"
    nnz: str = "29,110,900"  # target mean non-zeros per token
    providers: str = ""  # comma separated; empty = every provider that runs on the device (graphs need CUDA)
    dtype: str = "bfloat16"
    tile: int = 256
    slots: int = 32
    seed: int = 0
    rep_ms: int = 200
    out_dir: str = "benchmarks/results"
    git_sha: str = ""  # empty: read from git (pass it where the tree travels without .git)
    down_layout: str = "transposed"  # how the down weight is stored: "transposed" (as SparseMLP) or "hf"


def _providers(mlp, weights: SparseMLPWeights, expected_nnz: float, tile: int, slots: int,
               compiled_dense: Callable) -> dict[str, Callable]:
    x, gate, up, down = mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight
    merged = torch.cat([gate, up]) if gate is not None else None
    h = up.shape[0]

    def dense_merged():
        if merged is None:
            return dense_mlp(x, None, up, down, None)
        g, u = F.linear(x, merged).split(h, dim=-1)
        return F.linear(torch.relu(g) * u, down)

    return {
        "dense": lambda: dense_mlp(x, gate, up, down, None),
        "dense_merged": dense_merged,
        "dense_compiled": lambda: compiled_dense(x, gate, up, down, None),
        "sparse": lambda: sparse_mlp(x, gate, up, down, mode="sparse", prepared=weights, tile=tile, slots=slots),
        "auto": lambda: sparse_mlp(x, gate, up, down, mode="auto", prepared=weights, expected_nnz=expected_nnz,
                                   tile=tile, slots=slots),
        "gate_cublas": lambda: torch.relu(F.linear(x, mlp.first_weight)),
        "gate_pack": lambda: gate_twell(x, mlp.first_weight, tile=tile, slots=slots),
    }


def run_mlp_bench(cfg: MLPBenchConfig, device: torch.device | None = None, log: Callable[[str], None] = print
                  ) -> list[dict]:
    """Run every (shape, nnz, M) case; return the CSV rows (also written under cfg.out_dir)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cfg.dtype)
    wanted = [p.strip() for p in cfg.providers.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PROVIDERS))
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; choose from {PROVIDERS}")
    if not wanted:
        wanted = [p for p in PROVIDERS if device.type == "cuda" or p not in GRAPH_PROVIDERS]
    graphs = sorted(set(wanted) & set(GRAPH_PROVIDERS))
    if graphs and device.type != "cuda":
        raise ValueError(f"providers: {graphs} capture CUDA graphs and need a CUDA device, not {device}")
    meta = run_metadata(device)
    # One static compilation per (shape, M), reused across densities (dense time is data-independent).
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled_dense = torch.compile(dense_mlp, dynamic=False)
    if cfg.git_sha:
        meta["git_sha"] = cfg.git_sha
    rows: list[dict] = []
    csv_path = Path(cfg.out_dir) / device_slug(device) / "mlp.csv"
    # Once torch.compile has compiled, every later eager call of the process costs more host time
    # (H200 host, M = 4096, D = 2048, nnz 29: eager sparse 1.48x -> 1.16x of dense, same process,
    # the compiled provider measured before), so the compiled provider runs in a second pass after
    # every other provider of every case; its ratio is over dense timed again beside it.
    passes = [[p for p in wanted if p != "dense_compiled"], [p for p in wanted if p == "dense_compiled"]]
    for providers in filter(None, passes):
        for d, h in shapes(cfg.shapes):
            for target in ints(cfg.nnz):
                for m in ints(cfg.tokens):
                    mlp = with_down_layout(synthetic_mlp(m, d, h, min(target, h), dtype=dtype, device=device, seed=cfg.seed),
                                       cfg.down_layout)
                    rows += _bench_case(cfg, mlp, providers, meta, device, log, compiled_dense)
                    write_csv(rows, csv_path, CSV_FIELDS)  # after every case: a run cut short keeps what it measured
                    del mlp
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return rows


def _bench_case(cfg, mlp, wanted, meta, device, log, compiled_dense) -> list[dict]:
    x = mlp.x
    m, d = x.shape
    h = mlp.up_weight.shape[0]
    weights = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    ref = sparse_mlp_reference(x.float(), *(None if w is None else w.float()
                                            for w in (mlp.gate_weight, mlp.up_weight, mlp.down_weight)))
    _, _, counts = gate_twell(x, mlp.first_weight, tile=cfg.tile, slots=cfg.slots)
    nnz = counts.sum(1, dtype=torch.int64).double()
    stats = {
        "dtype": cfg.dtype, "d": d, "h": h, "m": m, "target_nnz": mlp.target_nnz,
        "mean_nnz": round(float(nnz.mean()), 2), "max_nnz": int(nnz.max()),
        "overflow_rows": int((counts > cfg.slots).any(1).sum()),
    }
    providers = _providers(mlp, weights, stats["mean_nnz"], cfg.tile, cfg.slots, compiled_dense)
    dense_out = providers["dense"]()
    dense_err = rel_err(dense_out, ref)
    floor = torch.finfo(x.dtype).eps / 2
    checked = {}
    # graphs are captured after the eager providers ran (PROVIDERS order): auto's capture may take the
    # sparse route that its eager warm-up did not, and its kernels are compiled by then
    for name in sorted(wanted, key=lambda n: n in GRAPH_PROVIDERS):
        if name in GRAPH_PROVIDERS:
            providers[name] = cuda_graphed(providers[name.removesuffix("_graph")], device)
        out = providers[name]()
        mode = ""
        err = float("nan")
        if not name.startswith("gate_"):
            err = rel_err(out, ref)
        if name in ("sparse", "sparse_graph"):
            mode = "sparse"
        elif name in ("auto", "auto_graph"):
            mode = choose_mode(x, mlp.up_weight, mode="auto", expected_nnz=stats["mean_nnz"],
                               down_t_ready=True).mode
        checked[name] = (mode, err)
    # Providers take turns over TIMING_ROUNDS rounds, so a drift of clocks or host load hits them alike.
    timed = list(dict.fromkeys(["dense", *wanted]))
    samples = {name: [] for name in timed}
    for _ in range(TIMING_ROUNDS):
        for name in timed:
            samples[name].append(time_fn(providers[name], device, rep_ms=cfg.rep_ms / TIMING_ROUNDS))
    base = median_timing(samples["dense"]).median_ms
    results = {name: (median_timing(samples[name]), *checked[name]) for name in wanted}
    rows = []
    for name, (timing, mode, err) in results.items():
        row = dict(meta, **stats, provider=name, mode=mode, median_ms=round(timing.median_ms, 5),
                   p20_ms=round(timing.p20_ms, 5), p80_ms=round(timing.p80_ms, 5),
                   speedup_vs_dense=round(base / timing.median_ms, 4), rel_err=f"{err:.3e}",
                   dense_rel_err=f"{dense_err:.3e}",
                   within_bound="" if err != err else str(err <= 2 * dense_err + floor))
        rows.append(row)
    sparse = results.get("sparse")
    summary = f"D={d} H={h} M={m:>6} nnz {stats['mean_nnz']:7.1f} (max {stats['max_nnz']}, " \
              f"{stats['overflow_rows']} overflow rows): dense {base:.3f} ms"
    if sparse:
        summary += f", sparse {sparse[0].median_ms:.3f} ms ({base / sparse[0].median_ms:.2f}x, err {sparse[2]:.1e} " \
                   f"vs dense {dense_err:.1e})"
    log(summary)
    return rows
