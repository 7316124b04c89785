"""Quality experiment: held-out cross-entropy vs activation sparsity over L1 coefficients.

Reads finished `sparseffn train` run folders (their config.json and metrics.jsonl), one per L1
coefficient λ with everything else equal, and summarises each by its last evaluation: held-out CE,
mean and max non-zeros per token per layer, % zeros, dead (never firing) units, TwELL overflow rate.
The relative CE increase is taken against the run with λ = 0 (the dense-trained ReLU model).
Output: a long CSV (one row per run), a README table and a PNG (CE vs sparsity, per-layer nnz).
"""

from __future__ import annotations

import json
from pathlib import Path

from sparseffn.bench import common

CSV_FIELDS = (
    "run", "model", "l1_coeff", "reinit_dead", "steps", "tokens_per_step", "eval_ce", "ce_increase_pct",
    "nnz_mean", "hidden", "nnz_pct_of_h", "zeros_pct", "nnz_max", "dead_pct", "overflow_rate",
    "nnz_per_layer", "dead_per_layer", "git_sha",
)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(run_dir: str | Path, git_sha: str = "") -> dict:
    """One CSV row from a finished run folder."""
    run = Path(run_dir)
    cfg = json.loads((run / "config.json").read_text())
    metrics = _rows(run / "metrics.jsonl")
    evals = [r for r in metrics if r.get("kind") == "eval"]
    trains = [r for r in metrics if r.get("kind") == "train"]
    if not evals or not trains:
        raise ValueError(f"{run}: metrics.jsonl has no eval or train rows (is the run finished?)")
    last, last_train = evals[-1], trains[-1]
    hidden = sum(last["eval_hidden"]) / len(last["eval_hidden"])
    sparsity = cfg.get("sparsity", {})
    return {
        "run": run.name, "model": cfg.get("model"), "l1_coeff": sparsity.get("l1_coeff"),
        "reinit_dead": sparsity.get("reinit_dead"), "steps": last["step"],
        "tokens_per_step": cfg.get("batch_size", 0) * cfg.get("seq_len", 0) * cfg.get("grad_accum", 1),
        "eval_ce": round(last["eval_ce"], 5), "ce_increase_pct": "",
        "nnz_mean": round(last["eval_nnz_mean_all"], 2), "hidden": hidden,
        "nnz_pct_of_h": round(100 * last["eval_nnz_mean_all"] / hidden, 3),
        "zeros_pct": round(last["eval_zeros_pct"], 3), "nnz_max": max(last["eval_nnz_max"]),
        "dead_pct": round(100 * last_train["dead_frac_all"], 2),
        "overflow_rate": round(last["eval_overflow_rate_all"], 5),
        "nnz_per_layer": " ".join(f"{v:.1f}" for v in last["eval_nnz_mean"]),
        "dead_per_layer": " ".join(f"{100 * v:.1f}" for v in last_train["dead_frac"]),
        "git_sha": git_sha,
    }


def summarize_runs(run_dirs: list[str | Path], git_sha: str = "") -> list[dict]:
    """Rows for every run, with the CE increase relative to the λ = 0 run (if present)."""
    rows = sorted((summarize_run(r, git_sha) for r in run_dirs), key=lambda r: (r["l1_coeff"], bool(r["reinit_dead"])))
    base = next((r for r in rows if r["l1_coeff"] == 0), None)
    for r in rows:
        if base is not None:
            r["ce_increase_pct"] = round(100 * (r["eval_ce"] / base["eval_ce"] - 1), 3)
    return rows


def write_csv(rows: list[dict], path: Path) -> Path:
    return common.write_csv(rows, path, CSV_FIELDS)

def quality_table(rows: list[dict], conditions: str = "") -> str:
    head = (f"{conditions}\n\n" if conditions else "") + (
        "| λ (L1) | re-init dead | held-out CE | CE vs λ=0 | mean nnz / token (of H) | zeros | max nnz | dead units "
        "| TwELL overflow rows |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        inc = f"{float(r['ce_increase_pct']):+.2f}%" if r["ce_increase_pct"] != "" else "–"
        lines.append(
            f"| {float(r['l1_coeff']):g} | {'yes' if str(r['reinit_dead']) == 'True' else 'no'} "
            f"| {float(r['eval_ce']):.4f} | {inc} | {float(r['nnz_mean']):.1f} ({float(r['nnz_pct_of_h']):.2f}% of "
            f"{float(r['hidden']):.0f}) | {float(r['zeros_pct']):.2f}% | {r['nnz_max']} | {float(r['dead_pct']):.1f}% "
            f"| {100 * float(r['overflow_rate']):.2f}% |"
        )
    return "\n".join(lines)


def plot_quality(rows: list[dict], path: Path) -> Path:
    """Left: held-out CE vs % zeros over λ. Right: mean nnz per token per layer, one line per run."""
    plt = common.pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        label = f"λ={float(r['l1_coeff']):g}" + (" re-init" if str(r["reinit_dead"]) == "True" else "")
        ax.plot(float(r["zeros_pct"]), float(r["eval_ce"]), "o")
        ax.annotate(label, (float(r["zeros_pct"]), float(r["eval_ce"])), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
        per_layer = [float(v) for v in str(r["nnz_per_layer"]).split()]
        ax2.plot(range(len(per_layer)), per_layer, "-o", label=label)
    ax.set_xlabel("MLP activations that are zero, %")
    ax.set_ylabel("held-out cross-entropy")
    ax.set_title("quality vs sparsity over λ")
    ax2.set_yscale("log")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("mean non-zeros per token")
    ax2.set_title("per-layer activity")
    ax2.legend(fontsize=7)
    return common.save_figure(fig, path)
