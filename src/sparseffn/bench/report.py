"""Benchmark CSV -> markdown table (README) and PNG plot. Tables are generated, never typed."""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path

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
        "Error = ‖y − y_fp32‖ / ‖y_fp32‖.\n\n"
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
        "same model with its MLPs in `mode=\"dense\"`; median of CUDA-event timings, same run.\n\n"
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
