"""Benchmark CSV -> markdown table (README) and PNG plot. Tables are generated, never typed."""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path


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


def mlp_table(rows: list[dict]) -> str:
    """One line per (shape, density, M): dense time, sparseffn's speed-ups and errors."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    header = (
        f"{first['gpu']}, {first['dtype']}, torch {first['torch']}, triton {first['triton']}, git {first['git_sha']}. "
        "Speed-up = dense time / time (median of CUDA-event timings, L2 flushed, same run, same inputs). "
        "Error = ‖y − y_fp32‖ / ‖y_fp32‖.\n\n"
        "| D×H | mean nnz (max) | M | overflow rows | dense ms | merged | compiled | sparse | auto (mode) "
        "| gate: TwELL pack / cuBLAS | sparse err | dense err |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
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
        lines.append(
            f"| {d}×{h} | {float(any_row['mean_nnz']):.1f} ({any_row['max_nnz']}) | {m} | {any_row['overflow_rows']} "
            f"| {float(dense['median_ms']):.3f} | {ratio(prov, 'dense_merged')} | {ratio(prov, 'dense_compiled')} "
            f"| {ratio(prov, 'sparse')} | {auto} | {gate} "
            f"| {prov['sparse']['rel_err'] if 'sparse' in prov else '–'} | {any_row['dense_rel_err']} |"
            if dense else f"| {d}×{h} | – | {m} | – | – | – | – | – | – | – | – | – |"
        )
    return "\n".join(lines)


def plot_mlp(rows: list[dict], path: Path) -> Path:
    """Speed-up vs tokens, one panel per shape, one line per (provider, density)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(int(r["d"]), int(r["h"])) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    for ax, (d, h) in zip(axes[0], shapes):
        series: dict[tuple, list] = defaultdict(list)
        for r in rows:
            if (int(r["d"]), int(r["h"])) == (d, h) and r["provider"] in ("sparse", "auto", "dense_compiled"):
                series[(r["provider"], float(r["target_nnz"]))].append((int(r["m"]), float(r["speedup_vs_dense"])))
        for (provider, nnz), points in sorted(series.items()):
            points.sort()
            style = {"sparse": "-o", "auto": "--s", "dense_compiled": ":"}[provider]
            ax.plot(*zip(*points), style, label=f"{provider}, nnz {nnz:g}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel("speed-up vs dense torch")
        ax.set_title(f"D={d}, H={h}")
        ax.legend(fontsize=7)
    gpu = rows[0]["gpu"] if rows else ""
    fig.suptitle(f"sparseffn MLP inference, {gpu}, git {rows[0]['git_sha'] if rows else ''}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replace_block(text: str, name: str, body: str) -> str:
    """Replace the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` markers."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} block to replace")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)
