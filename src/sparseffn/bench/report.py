"""Benchmark CSVs -> markdown tables and PNG plots. Tables are generated, never typed.

`regenerate` (what `sparseffn bench report` runs) rewrites every `<!-- bench:NAME -->` block of the
README and of the docs pages (docs/benchmarks.md; docs/sparsify.md for the ReLUfication runs) from the
CSVs under benchmarks/results/: one block per CSV (`_blocks`) in the docs, and the README's `headline` block, a few rows drawn from several CSVs
(`HEADLINE_ROWS`).
"""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sparseffn.bench.common import pyplot, save_figure


def read_rows(path: Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def _cases(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(d, h, target_nnz, m) -> provider -> row, in the order the benchmark ran."""
    cases: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        key = (int(row["d"]), int(row["h"]), float(row["target_nnz"]), int(row["m"]))
        cases[key][row["provider"]] = row
    return cases


def _graph_ratio(prov: dict[str, dict], graphed: str = "sparse_graph") -> str:
    """Graphed dense time over the `graphed` provider's time of one case, or "–" without both rows."""
    if graphed not in prov or "dense_graph" not in prov:
        return "–"
    return f"{float(prov['dense_graph']['median_ms']) / float(prov[graphed]['median_ms']):.2f}x"


def mlp_table(rows: list[dict]) -> str:
    """One line per (shape, density, M): dense time, sparseffn's speed-ups and errors."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    header = (
        f"{first['gpu']}, {first['dtype']}, torch {first['torch']}, triton {first['triton']}, git {first['git_sha']}. "
        "Speed-up = dense time / time (median of CUDA-event timings, L2 flushed, same run, same inputs). "
        "Error = ‖y − y_fp32‖ / ‖y_fp32‖. "
        "Graphed = one CUDA-graph replay of the call (no host launch work); `graphed sparse` is over eager "
        "dense, `graph / graph` is graphed dense time over graphed sparse time, `auto graphed` is graphed dense "
        "time over auto mode's captured call (under capture auto routes few tokens to the sparse kernels).\n\n"
        "| D×H | mean nnz (max) | M | overflow rows | dense ms | merged | compiled | sparse | auto (mode) "
        "| graphed sparse | graph / graph | auto graphed (mode) | gate: TwELL pack / cuBLAS | sparse err "
        "| dense err |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]

    def ratio(prov: dict, name: str) -> str:
        return f"{float(prov[name]['speedup_vs_dense']):.2f}x" if name in prov else "–"

    for (d, h, _, m), prov in _cases(rows).items():
        any_row = next(iter(prov.values()))
        dense = prov.get("dense")
        gate = "–"
        if "gate_pack" in prov and "gate_cublas" in prov:
            gate = f"{float(prov['gate_pack']['median_ms']) / float(prov['gate_cublas']['median_ms']):.2f}x time"
        auto = ratio(prov, "auto") + (f" ({prov['auto']['mode']})" if "auto" in prov else "")
        auto_graph = _graph_ratio(prov, "auto_graph") + (f" ({prov['auto_graph']['mode']})"
                                                         if "auto_graph" in prov else "")
        lines.append(
            f"| {d}×{h} | {float(any_row['mean_nnz']):.1f} ({any_row['max_nnz']}) | {m} | {any_row['overflow_rows']} "
            f"| {float(dense['median_ms']):.3f} | {ratio(prov, 'dense_merged')} | {ratio(prov, 'dense_compiled')} "
            f"| {ratio(prov, 'sparse')} | {auto} | {ratio(prov, 'sparse_graph')} | {_graph_ratio(prov)} | {auto_graph} "
            f"| {gate} | {prov['sparse']['rel_err'] if 'sparse' in prov else '–'} | {any_row['dense_rel_err']} |"
            if dense else f"| {d}×{h} | – | {m} | – | – | – | – | – | – | – | – | – | – | – | – |"
        )
    return "\n".join(lines)


def plot_mlp(rows: list[dict], path: Path) -> Path:
    """Speed-up vs tokens, one panel per shape, one line per (provider, density)."""
    plt = pyplot()

    shapes = sorted({(int(r["d"]), int(r["h"])) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    styles = {"sparse": "-o", "auto": "--s", "dense_compiled": ":", "sparse_graph": "-.^"}
    for ax, (d, h) in zip(axes[0], shapes):
        series: dict[tuple, list] = defaultdict(list)
        for r in rows:
            if (int(r["d"]), int(r["h"])) == (d, h) and r["provider"] in styles:
                series[(r["provider"], float(r["target_nnz"]))].append((int(r["m"]), float(r["speedup_vs_dense"])))
        for (provider, nnz), points in sorted(series.items()):
            points.sort()
            ax.plot(*zip(*points), styles[provider], label=f"{provider}, nnz {nnz:g}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel("speed-up vs dense torch")
        ax.set_title(f"D={d}, H={h}")
        ax.legend(fontsize=7)
    gpu = rows[0]["gpu"] if rows else ""
    fig.suptitle(f"sparseffn MLP inference, {gpu}, git {rows[0]['git_sha'] if rows else ''}")
    return save_figure(fig, path)


def _times(row: dict | None, key: str) -> str:
    return f"{float(row[key]):.2f}x" if row and row[key] not in ("", None) else "–"


def train_table(rows: list[dict]) -> str:
    """One line per (shape, density, M) of `bench mlp --train`: step time, speed-up, peak memory, errors."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    shas = list(dict.fromkeys(r["git_sha"] for r in rows))  # rows of several runs: each row says its own
    mixed = len(shas) > 1
    header = (
        f"{first['gpu']}, {first['dtype']}, torch {first['torch']}, triton {first['triton']}, "
        f"git {', '.join(shas)}{' (each row: last column)' if mixed else ''}. "
        "One step = forward + backward of the MLP block with the L1 penalty (gradients of x and the three "
        "weights). Speed-up = dense autograd time / time (median of CUDA-event timings, L2 flushed, same run, "
        "same inputs); peak = max memory allocated during the step above what was allocated before it. "
        "Error = max over the four gradients of ‖g − g_fp32‖ / ‖g_fp32‖. Graphed = the step captured in a "
        "CUDA graph and replayed (no host launch work); `graphed sparse` is over eager dense, `graph / graph` "
        "is graphed dense time over graphed sparse time.\n\n"
        "| D×H | mean nnz (max) | M | overflow rows | dense ms | compiled | sparse | graphed sparse | graph / graph "
        f"| dense peak MiB | sparse peak / dense | sparse grad err | dense grad err |{' git |' if mixed else ''}\n"
        f"|---|---|---|---|---|---|---|---|---|---|---|---|---|{'---|' if mixed else ''}"
    )
    lines = [header]
    for (d, h, _, m), prov in _cases(rows).items():
        row = next(iter(prov.values()))
        dense, sparse, compiled = prov.get("dense"), prov.get("sparse"), prov.get("dense_compiled")
        if dense is None:
            continue
        lines.append(
            f"| {d}×{h} | {float(row['mean_nnz']):.1f} ({row['max_nnz']}) | {m} | {row['overflow_rows']} "
            f"| {float(dense['median_ms']):.3f} | {_times(compiled, 'speedup_vs_dense')} "
            f"| {_times(sparse, 'speedup_vs_dense')} | {_times(prov.get('sparse_graph'), 'speedup_vs_dense')} "
            f"| {_graph_ratio(prov)} | {float(dense['peak_mib']):.0f} "
            f"| {_times(sparse, 'peak_vs_dense')} | {sparse['grad_rel_err'] if sparse else '–'} "
            f"| {row['dense_grad_rel_err']} |" + (f" {row['git_sha']} |" if mixed else "")
        )
    return "\n".join(lines)


def plot_train(rows: list[dict], path: Path) -> Path:
    """Step speed-up and peak-memory ratio vs tokens, one panel pair per shape, one line per density."""
    plt = pyplot()

    shapes = sorted({(int(r["d"]), int(r["h"])) for r in rows})
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 7.5), squeeze=False)
    for col, (d, h) in enumerate(shapes):
        series: dict[tuple, list] = defaultdict(list)
        for r in rows:
            if (int(r["d"]), int(r["h"])) == (d, h) and r["provider"] in ("sparse", "sparse_graph"):
                series[(r["provider"], float(r["target_nnz"]))].append(
                    (int(r["m"]), float(r["speedup_vs_dense"]), float(r["peak_vs_dense"] or "nan")))
        for (provider, nnz), points in sorted(series.items()):
            points.sort()
            ms, speed, mem = zip(*points)
            graphed = provider == "sparse_graph"
            axes[0][col].plot(ms, speed, "-.^" if graphed else "-o",
                              label=f"{'graphed, ' if graphed else ''}nnz {nnz:g}")
            if any(v == v for v in mem):  # no memory numbers off the GPU, nor for graph replays
                axes[1][col].plot(ms, mem, "-s", label=f"nnz {nnz:g}")
        for row, label in ((0, "fwd+bwd speed-up vs dense autograd"), (1, "peak memory / dense")):
            ax = axes[row][col]
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens M")
            ax.set_ylabel(label)
            ax.set_title(f"D={d}, H={h}")
            if ax.lines[1:]:
                ax.legend(fontsize=7)
    gpu = rows[0]["gpu"] if rows else ""
    fig.suptitle(f"sparseffn MLP training step, {gpu}, git {', '.join(dict.fromkeys(r['git_sha'] for r in rows))}")
    return save_figure(fig, path)


def _activity(row: dict) -> str:
    if not row.get("mlp_nnz"):
        return "–"
    return f"{float(row['mlp_nnz']):.1f} ({row['mlp_max_nnz']}), {float(row['overflow_pct']):.2f}% of tokens"


def _non_mlp(row: dict) -> str:
    return row.get("non_mlp") or "hf"  # CSVs from before the column existed measured transformers' code


def e2e_table(rows: list[dict]) -> str:
    """Headline table of `bench e2e`: throughput, memory and energy, sparse vs dense, per phase and batch."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    if str(first["target_nnz"]) in ("", "nan"):  # a trained checkpoint: its own sparsity
        weights = "trained checkpoint, its own sparsity: see the MLP nnz column"
    else:
        weights = (f"random weights, per-neuron thresholds calibrated to {first['target_nnz']} non-zeros per "
                   f"token per layer, measured {first['mean_nnz']}")
    header = (
        f"{first['gpu']}, model `{first['model']}` ({weights}), {first['dtype']}, "
        f"sequence {first['seq_len']}, attention {first['attention']}, torch {first['torch']}, "
        f"transformers {first['transformers']}, git {first['git_sha']}. Forward = prefill "
        "(`logits_to_keep=1`, no grad); train = forward + backward + AdamW step with the L1 penalty. Dense = the "
        "same model with its MLPs in `mode=\"dense\"`; median of CUDA-event timings, same run. "
        "Non-MLP = Hugging Face's own RMSNorm/RoPE code (hf) or sparseffn's fused kernels for both providers "
        "(fused, `sparseffn.models.fuse_non_mlp_`).\n\n"
        "| phase | non-MLP | tokens | dense tok/ms | sparse tok/ms | speed-up | MLP share of dense | peak mem sparse/dense "
        "| energy/token sparse/dense | logits rel. err | MLP nnz/token: mean (max), TwELL overflow |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    by_case: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_case[(r["phase"], _non_mlp(r), int(r["batch"]))][r["provider"]] = r
    for (phase, non_mlp, batch), prov in by_case.items():
        dense, sparse = prov.get("dense"), prov.get("sparse")
        if not dense or not sparse:
            continue
        share = f"{float(dense['mlp_share']):.0%}" if dense["mlp_share"] else "–"
        energy = f"{float(sparse['energy_vs_dense']):.2f}x" if sparse["energy_vs_dense"] else "n/a"
        lines.append(
            f"| {phase} | {non_mlp} | {batch}×{dense['seq_len']} | {float(dense['tokens_per_ms']):.1f} "
            f"| {float(sparse['tokens_per_ms']):.1f} | {float(sparse['speedup_vs_dense']):.3f}x | {share} "
            f"| {_times(sparse, 'peak_vs_dense')} | {energy} | {sparse['logits_rel_err'] or '–'} "
            f"| {_activity(sparse)} |"
        )
    return "\n".join(lines)


def plot_e2e(rows: list[dict], path: Path) -> Path:
    """Throughput and peak-memory bars per phase and batch size, dense vs sparse."""
    plt = pyplot()

    cases = list(dict.fromkeys((r["phase"], _non_mlp(r), int(r["batch"])) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(11, 2.4 * len(cases)), 4.2))
    width = 0.38
    for i, provider in enumerate(("dense", "sparse")):
        values = {(r["phase"], _non_mlp(r), int(r["batch"])): r for r in rows if r["provider"] == provider}
        xs = [k + (i - 0.5) * width for k in range(len(cases))]
        axes[0].bar(xs, [float(values[c]["tokens_per_ms"]) if c in values else 0 for c in cases], width,
                    label=provider)
        axes[1].bar(xs, [float(values[c]["peak_mib"]) / 1024 if c in values else 0 for c in cases], width,
                    label=provider)
    labels = [f"{phase}, {non_mlp}\nbatch {batch}" for phase, non_mlp, batch in cases]
    for ax, title in ((axes[0], "throughput, tokens/ms"), (axes[1], "peak memory, GiB")):
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"sparseffn end to end, {rows[0]['model']}, {rows[0]['gpu']}, git {rows[0]['git_sha']}"
                 if rows else "")
    return save_figure(fig, path)


def replace_block(text: str, name: str, body: str) -> str:
    """Replace the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` markers."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} block to replace")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)


# ------------------------------------------------------------------------------------ regeneration
@dataclass(frozen=True)
class Block:
    """A generated block: its CSV (looked up as RESULTS/csv, else RESULTS/device/csv), table and plot."""

    csv: str
    table: Callable[[list[dict]], str]
    plot: Callable[[list[dict], Path], Path] | None = None
    device: str = "h200"


def deterministic_table(rows: list[dict]) -> str:
    """Training-step time of the default and the deterministic kernels, one line per M."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    by_m: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_m[int(r["m"])][r["variant"]] = float(r["median_ms"])
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [
        f"{first['gpu']}, {first['dtype']}, D={first['d']}, H={first['h']}, {first['target_nnz']} non-zeros per "
        f"token, git {first['git_sha']}. One training step (forward + backward with the L1 penalty), "
        f"{first['method']}.\n",
        "| M | " + " | ".join(variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    for m, times in by_m.items():
        base = times.get(variants[0])
        cells = []
        for v in variants:
            t = times.get(v)
            cells.append("–" if t is None else f"{t:.2f} ms" + (f" ({100 * (t / base - 1):+.0f}%)" if base and v != variants[0] else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layout_table(rows: list[dict]) -> str:
    """TwELL inference with up and down^T read as two row-strided tensors vs one interleaved copy."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    lines = [f"{first['gpu']}, git {first['git_sha']}, {first['target_nnz']} active units per token, median of "
             "CUDA-event timings with L2 flushed, dense torch in the same run.\n",
             "| D×H | M | dense ms | separate (one copy) ms | interleaved (second copy) ms | separate / interleaved |",
             "|---|---|---|---|---|---|"]
    by_case: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_case[(int(r["d"]), int(r["h"]), int(r["m"]))][r["layout"]] = float(r["median_ms"])
    for (d, h, m), t in by_case.items():
        lines.append(f"| {d}×{h} | {m} | {t['dense']:.3f} | {t['separate']:.3f} ({t['dense'] / t['separate']:.2f}x) | "
                     f"{t['interleaved']:.3f} ({t['dense'] / t['interleaved']:.2f}x) | "
                     f"{t['separate'] / t['interleaved']:.3f} |")
    return "\n".join(lines)


def multi_gpu_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    first = rows[0]
    lines = [f"{first['gpus_on_host']}× {first['gpu']} over NCCL, torch {first['torch']}, git {first['git_sha']}, "
             f"`{first['model']}`, {first['global_batch_tokens']} tokens per step in all GPUs; {first['steps_note']}.\n",
             "| GPUs | parallel | mode | tokens/s | per GPU | scaling (per GPU vs 1 GPU) | auto / dense | peak MiB per GPU "
             "| layers sparse at the end |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['parallel']} | {r['mode']} | {int(r['tokens_per_s']):,} | "
                     f"{int(r['tokens_per_s_per_gpu']):,} | {float(r['scaling_efficiency']):.2f} | "
                     f"{float(r['auto_vs_dense']):.2f}x | {r['peak_mib_per_gpu']} | {r['sparse_layers_last']} |")
    return "\n".join(lines)


def _blocks() -> dict[str, Block]:
    from sparseffn.bench import calibrate, quality  # calibrate imports torch: only when regenerating
    from sparseffn.bench.decode import decode_table, plot_decode
    from sparseffn.bench.decode_model import decode_model_table, plot_decode_model
    from sparseffn.bench.train_run import plot_train_run, train_run_table

    return {
        "decode": Block("decode_mlp.csv", decode_table, plot_decode),
        "decode_model": Block("decode_model.csv", decode_model_table, plot_decode_model),
        "train_run": Block("train_run.csv", lambda rows: train_run_table(rows, width=50), plot_train_run),
        "train_density": Block("mlp_train_density.csv", train_table),
        "layout": Block("layout.csv", layout_table),
        "multi_gpu": Block("multi_gpu.csv", multi_gpu_table, device="h200x2"),
        "mlp": Block("mlp.csv", mlp_table, plot_mlp),
        "mlp_paper_shape": Block("mlp_paper_shape.csv", mlp_table, plot_mlp),
        "mlp_narrow": Block("mlp_narrow.csv", mlp_table, plot_mlp),
        "train": Block("mlp_train.csv", train_table, plot_train),
        "deterministic": Block("deterministic.csv", deterministic_table),
        "e2e": Block("e2e.csv", e2e_table, plot_e2e),
        "quality": Block("quality.csv", quality.quality_table, quality.plot_quality),
        "calibrate": Block("calibrate.csv", calibrate.calibrate_table, calibrate.plot_calibrate, device="cpu"),
        "relufy_20m": Block("relufy_20m.csv", quality.relufy_table, quality.plot_relufy),
        "relufy_100m": Block("relufy_100m.csv", quality.relufy_table, quality.plot_relufy),
    }


def pages_with_blocks(docs_dir: str | Path) -> list[Path]:
    """The docs pages (docs_dir/*.md) holding at least one generated block, sorted."""
    return sorted(p for p in Path(docs_dir).glob("*.md") if "<!-- bench:" in p.read_text())


def find_csv(results_dir: Path, name: str, device: str = "h200") -> Path | None:
    """RESULTS/NAME (a device folder was given) or RESULTS/DEVICE/NAME (the results root), or None."""
    for path in (Path(results_dir) / name, Path(results_dir) / device / name):
        if path.is_file():
            return path
    return None


# The paper's MLP shape and density: the headline rows are read at these.
PAPER_D, PAPER_H, PAPER_NNZ = 2048, 5632, 29.0
HEADLINE_TOKENS = (4096, 16384, 65536)


def _paper_cases(rows: list[dict]) -> list[dict[str, dict]]:
    cases = _cases(rows)
    return [cases[(PAPER_D, PAPER_H, PAPER_NNZ, m)] for m in HEADLINE_TOKENS if (PAPER_D, PAPER_H, PAPER_NNZ, m) in cases]


def _slash(values: list[str]) -> str:
    return " / ".join(values)


# Each headline row links to the section of docs/benchmarks.md that gives its conditions and command.
DOCS_PAGE = "docs/benchmarks.md"


def _linked(result: str, anchor: str) -> str:
    return f"[{result}]({DOCS_PAGE}#{anchor})"


def _inference_row(results_dir: Path) -> tuple[str, str] | None:
    path = find_csv(results_dir, "mlp_paper_shape.csv") or find_csv(results_dir, "mlp.csv")
    cases = _paper_cases(read_rows(path)) if path else []
    if not cases or any("sparse" not in c or "dense" not in c for c in cases):
        return None
    ms = [str(int(c["sparse"]["m"])) for c in cases]
    sparse_err = max(float(c["sparse"]["rel_err"]) for c in cases)
    dense_err = max(float(c["sparse"]["dense_rel_err"]) for c in cases)
    also = [f"error vs fp32 ≤ {sparse_err:.1e} (dense bf16: {dense_err:.1e})"]
    if all("sparse_graph" in c and "dense_graph" in c for c in cases):
        also.insert(0, f"CUDA graphs on both sides {_slash([_graph_ratio(c) for c in cases])}")
    return (f"| {_linked('MLP inference', 'mlp-inference-at-the-papers-shape')} "
            f"| D={PAPER_D}, H={PAPER_H}, {PAPER_NNZ:g} active units per token, M = {_slash(ms)} "
            f"| **{_slash([_times(c['sparse'], 'speedup_vs_dense') for c in cases])}** | {'; '.join(also)} |",
            f"{path.name} {cases[0]['sparse']['git_sha']}")


def _train_row(results_dir: Path) -> tuple[str, str] | None:
    path = find_csv(results_dir, "mlp_train.csv")
    cases = _paper_cases(read_rows(path)) if path else []
    if not cases or any("sparse" not in c for c in cases):
        return None
    ms = [str(int(c["sparse"]["m"])) for c in cases]
    also = [f"peak memory {_slash([_times(c['sparse'], 'peak_vs_dense') for c in cases])}"]
    if all("sparse_graph" in c and "dense_graph" in c for c in cases):
        also.insert(0, f"CUDA graphs on both sides {_slash([_graph_ratio(c) for c in cases])}")
    what = _linked("MLP training step (forward + backward + L1)", "training-step-of-the-mlp-block")
    return (f"| {what} | the same, M = {_slash(ms)} "
            f"| **{_slash([_times(c['sparse'], 'speedup_vs_dense') for c in cases])}** | {'; '.join(also)} |",
            f"{path.name} {cases[0]['sparse']['git_sha']}")


def _weights(row: dict, where: str = "") -> str:
    """The model's weights in a headline setting: random with calibrated thresholds, or a checkpoint."""
    if row["target_nnz"] in ("", "nan"):
        return "trained checkpoint"
    return f"random weights, thresholds calibrated to {float(row['target_nnz']):g} active units per token{where}"


def _e2e_rows(results_dir: Path, phase: str) -> tuple[str, str] | None:
    path = find_csv(results_dir, "e2e.csv")
    rows = read_rows(path) if path else []
    fused = [r for r in rows if r["provider"] == "sparse" and r["phase"] == phase and _non_mlp(r) == "fused"]
    sparse = fused or [r for r in rows if r["provider"] == "sparse" and r["phase"] == phase]
    if not sparse:
        return None
    first = sparse[0]
    batches = _slash([f"{r['batch']}×{r['seq_len']}" for r in sparse])
    speed = _slash([f"{float(r['speedup_vs_dense']):.2f}x" for r in sparse])
    if phase == "forward":
        what = f"`{first['model']}` model prefill"
        throughput = _slash([f"{float(r['tokens_per_ms']):.0f}" for r in sparse])
        also = f"{throughput} tokens/ms; energy per token {_slash([_times(r, 'energy_vs_dense') for r in sparse])}"
    else:
        what = f"`{first['model']}` model training step"
        also = f"peak memory {_slash([_times(r, 'peak_vs_dense') for r in sparse])}"
    setting = f"{batches} tokens; {_weights(first)}; {'fused RMSNorm/RoPE' if fused else 'Hugging Face non-MLP code'} on both sides"
    return (f"| {_linked(what, 'end-to-end-the-papers-2b-model')} | {setting} | **{speed}** | {also} |",
            f"{path.name} {first['git_sha']}")


def _quality_row(results_dir: Path) -> tuple[str, str] | None:
    from sparseffn.bench.quality import with_ce_increase

    path = find_csv(results_dir, "quality.csv")
    rows = with_ce_increase(read_rows(path)) if path else []
    sparse = [r for r in rows if r["ce_increase_pct"] != "" and float(r["zeros_pct"]) >= 99.0]
    if not sparse:
        return None
    r = min(sparse, key=lambda r: float(r["ce_increase_pct"]))
    ramp = int(r.get("l1_warmup_steps") or 0)
    setting = (f"`{r['model']}`, {r['steps']} steps × {r['tokens_per_step']} tokens, λ = {float(r['l1_coeff']):g}"
               + (f" ramped over {ramp} steps" if ramp else "")
               + (", dead-unit re-init" if str(r["reinit_dead"]) == "True" else ""))
    what = _linked("Quality (L1 training)", "quality-l1-coefficient-vs-held-out-cross-entropy")
    return (f"| {what} | {setting} | **{float(r['zeros_pct']):.2f}% zeros** "
            f"| {float(r['nnz_mean']):.1f} of {float(r['hidden']):.0f} units active per token; held-out CE "
            f"{float(r['ce_increase_pct']):+.2f}% vs λ = 0 |", f"{path.name} {r['git_sha']}")


def _decode_row(results_dir: Path) -> tuple[str, str] | None:
    path = find_csv(results_dir, "decode_mlp.csv")
    rows = read_rows(path) if path else []
    pick = {(int(r["m"]), r["provider"]): r for r in rows if r["l2"] == "cold" and int(r["d"]) == PAPER_D
            and int(r["h"]) == PAPER_H and float(r["target_nnz"]) == PAPER_NNZ}
    ms = [m for m in (1, 4, 16, 64) if (m, "sparse_graph") in pick and (m, "dense_graph") in pick]
    if not ms:
        return None
    ratios = [f"{float(pick[(m, 'dense_graph')]['median_us']) / float(pick[(m, 'sparse_graph')]['median_us']):.2f}x"
              for m in ms]
    auto = [f"{float(pick[(m, 'dense_graph')]['median_us']) / float(pick[(m, 'auto_graph')]['median_us']):.2f}x"
            for m in ms]
    what = _linked("MLP decode (CUDA graphs on both sides, L2 flushed)", "decode-the-mlp-at-1-256-tokens-per-call")
    return (f"| {what} "
            f"| the same, M = {_slash(map(str, ms))} tokens per call "
            f"| **{_slash(ratios)}** | auto mode {_slash(auto)} (it keeps dense where dense is faster) |",
            f"{path.name} {pick[(ms[0], 'sparse_graph')]['git_sha']}")


def _generation_row(results_dir: Path) -> tuple[str, str] | None:
    path = find_csv(results_dir, "decode_model.csv")
    every = [r for r in (read_rows(path) if path else []) if r["mlp"] == "sparse"]
    rows = [r for r in every if r["provider"] == "captured"]
    compiled = [r for r in every if r["provider"] == "compiled"]
    fused = [r for r in rows if _non_mlp(r) == "fused"]
    hf = [r for r in rows if _non_mlp(r) == "hf"]
    sparse = fused or hf
    if not sparse:
        return None
    first = sparse[0]
    batches = _slash([r["batch"] for r in sparse])
    weights = _weights(first, " at the generated positions" if first.get("calibration") == "generated" else "")
    ms = lambda rs: _slash([f"{float(r['ms_per_token_p50']):.2f}" for r in rs])  # noqa: E731
    also = "ms per token " + ms(sparse)
    if fused and hf:
        also += f"; Hugging Face's norms/RoPE: {_slash([_times(r, 'speedup_vs_dense') for r in hf])}"
    if compiled:
        also += (f"; the step's forward through torch.compile ({_non_mlp(compiled[0])} norms/RoPE, batch "
                 f"{_slash([r['batch'] for r in compiled])}): {_slash([_times(r, 'speedup_vs_dense') for r in compiled])}, "
                 f"ms per token {ms(compiled)}")
    what = f"`{first['model']}` model generation (decode step replayed from a CUDA graph)"
    return (f"| {_linked(what, 'whole-model-decode')} | batch {batches}, "
            f"prompt {first['prompt']}, {first['new_tokens']} new tokens; {weights}; "
            f"{'fused RMSNorm/RoPE' if fused else 'Hugging Face non-MLP code'} on both sides "
            f"| **{_slash([_times(r, 'speedup_vs_dense') for r in sparse])}** | {also} |",
            f"{path.name} {first['git_sha']}")


def _train_run_row(results_dir: Path) -> tuple[str, str] | None:
    from sparseffn.bench.train_run import summarize

    path = find_csv(results_dir, "train_run.csv")
    rows = read_rows(path) if path else []
    summary = {r["mode"]: r for r in rows if r["kind"] == "summary"}
    if not {"dense", "auto"} <= set(summary):
        return None
    s = summarize(rows)
    auto = summary["auto"]
    if s["sparse_windows"]:
        nnz = s["sparse_nnz"]
        sparse = (f"{s['sparse_phase']:.2f}x in the sparse phase** (steps {s['sparse_from']}–end, "
                  f"{nnz[0]:.1f} → {nnz[1]:.1f} active units per token)")
    else:
        sparse = "no sparse phase**"
    own = auto.get("process") == "own"
    wall = (f"whole run {float(summary['dense']['wall_s']) / float(auto['wall_s']):.2f}x in wall time "
            + ("(each mode in its own process)" if own else "(both modes in one process)")
            + f"; slowest window {s['slowest']:.2f}x")
    what = _linked("Training run from initialization (auto mode)", "training-run-from-initialization-auto-mode")
    return (f"| {what} | `{auto['model']}`, λ {float(auto['l1_coeff']):g}, auto vs dense mode, same seed "
            f"| **{s['dense_phase']:.2f}x in the dense phase, {sparse} (tokens/s) | {wall} |",
            f"{path.name} {auto['git_sha']}")


# The README's headline rows, in order; each returns (table line, "csv sha") or None without its CSV.
HEADLINE_ROWS: tuple[Callable[[Path], tuple[str, str] | None], ...] = (
    _inference_row,
    _decode_row,
    _train_row,
    _train_run_row,
    lambda results_dir: _e2e_rows(results_dir, "forward"),
    _generation_row,
    lambda results_dir: _e2e_rows(results_dir, "train"),
    _quality_row,
)


def headline_table(results_dir: Path) -> str | None:
    """The README's summary: sparseffn against dense torch at the paper's shape, end to end, and quality."""
    built = [row for make in HEADLINE_ROWS if (row := make(Path(results_dir))) is not None]
    if not built:
        return None
    gpu = ""
    if path := find_csv(results_dir, "mlp_paper_shape.csv") or find_csv(results_dir, "mlp_train.csv"):
        first = read_rows(path)[0]
        gpu = f"{first['gpu']}, {first['dtype']}. "
    lines = [
        "| result | setting | sparseffn vs dense | also |",
        "|---|---|---|---|",
        *(line for line, _ in built),
        "",
        f"{gpu}Ratios are dense time over sparseffn time (above 1: faster), memory and energy sparseffn over dense, "
        f"from one run with both side by side. Sources (CSV, git): {', '.join(dict.fromkeys(src for _, src in built))}.",
    ]
    return "\n".join(lines)


def regenerate(results_dir: str | Path, files: list[str | Path], *, plots: bool = True) -> list[str]:
    """Rewrite the generated blocks of `files` from the CSVs under results_dir; return the CSVs used.

    results_dir is benchmarks/results (device folders below it) or one device folder. A block is
    rewritten where its marker is and its CSV exists; a CSV no file has a block for raises, as does
    finding no CSV at all. plots: also redraw each CSV's PNG beside it.
    """
    results_dir = Path(results_dir)
    texts = {Path(f): Path(f).read_text() for f in files}
    used = []
    for name, block in _blocks().items():
        path = find_csv(results_dir, block.csv, block.device)
        if path is None:
            continue
        rows = read_rows(path)
        if plots and block.plot is not None:
            block.plot(rows, path.with_suffix(".png"))
        owners = [f for f, text in texts.items() if f"<!-- bench:{name} -->" in text]
        if not owners:
            raise ValueError(f"no <!-- bench:{name} --> block in {', '.join(map(str, texts))} for {path}")
        for f in owners:
            texts[f] = replace_block(texts[f], name, block.table(rows))
        used.append(str(path))
    for f, text in texts.items():
        if "<!-- bench:headline -->" in text and (table := headline_table(results_dir)) is not None:
            texts[f] = replace_block(text, "headline", table)
    if not used:
        raise FileNotFoundError(f"no benchmark CSV ({', '.join(b.csv for b in _blocks().values())}) in {results_dir}")
    for f, text in texts.items():
        f.write_text(text)
    return used
