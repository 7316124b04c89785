"""Quality experiment: held-out cross-entropy vs activation sparsity over L1 coefficients.

Reads finished `sparseffn train` run folders (their config.json and metrics.jsonl), one per L1
coefficient λ with everything else equal, and summarises each by its last evaluation: held-out CE,
mean and max non-zeros per token per layer, % zeros, dead (never firing) units, TwELL overflow rate.
The relative CE increase is taken against the run with λ = 0 (the dense-trained ReLU model) of the
same sweep (model, steps, tokens per step). Output: a long CSV (one row per run), a README table and a
PNG (CE increase vs sparsity, per-layer nnz, per-layer dead units).
"""

from __future__ import annotations

import json
from pathlib import Path

from sparseffn.bench import common

CSV_FIELDS = (
    "run", "model", "l1_coeff", "l1_warmup_steps", "reinit_dead", "steps", "tokens_per_step", "eval_ce", "ce_increase_pct",
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
        "l1_warmup_steps": sparsity.get("l1_warmup_steps", 0),
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


def _sweep(row: dict) -> tuple:
    """Runs compare only within a sweep: same model, steps, tokens per step and λ ramp."""
    return (row["model"], int(row["steps"]), int(row["tokens_per_step"]), int(row.get("l1_warmup_steps") or 0))


def summarize_runs(run_dirs: list[str | Path], git_sha: str = "") -> list[dict]:
    """Rows for every run, each with its CE increase relative to the λ = 0 run of its sweep (if any)."""
    return with_ce_increase([summarize_run(r, git_sha) for r in run_dirs])


def with_ce_increase(rows: list[dict]) -> list[dict]:
    """Rows sorted by sweep, λ and re-init, with ce_increase_pct against the sweep's λ = 0 run ("" without one)."""
    rows = sorted(rows, key=lambda r: (_sweep(r), float(r["l1_coeff"]), str(r["reinit_dead"]) == "True"))
    for r in rows:
        base = next((b for b in rows if _sweep(b) == _sweep(r) and float(b["l1_coeff"]) == 0), None)
        r["ce_increase_pct"] = "" if base is None else round(100 * (float(r["eval_ce"]) / float(base["eval_ce"]) - 1), 3)
    return rows


def write_csv(rows: list[dict], path: Path) -> Path:
    return common.write_csv(rows, path, CSV_FIELDS)

def quality_table(rows: list[dict], conditions: str = "") -> str:
    head = (f"{conditions}\n\n" if conditions else "") + (
        "| model | steps × tokens | λ ramp (steps) | λ (L1) | re-init dead | held-out CE | CE vs λ=0 "
        "| mean nnz / token (of H) | zeros | max nnz | dead units | TwELL overflow rows |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in with_ce_increase([dict(r) for r in rows]):
        inc = f"{float(r['ce_increase_pct']):+.2f}%" if r["ce_increase_pct"] != "" else "–"
        lines.append(
            f"| {r['model']} | {r['steps']} × {r['tokens_per_step']} | {int(r.get('l1_warmup_steps') or 0)} "
            f"| {float(r['l1_coeff']):g} "
            f"| {'yes' if str(r['reinit_dead']) == 'True' else 'no'} "
            f"| {float(r['eval_ce']):.4f} | {inc} | {float(r['nnz_mean']):.1f} ({float(r['nnz_pct_of_h']):.2f}% of "
            f"{float(r['hidden']):.0f}) | {float(r['zeros_pct']):.2f}% | {r['nnz_max']} | {float(r['dead_pct']):.1f}% "
            f"| {100 * float(r['overflow_rate']):.2f}% |"
        )
    return "\n".join(lines)


def plot_quality(rows: list[dict], path: Path) -> Path:
    """Left: held-out CE increase vs % zeros, one marker per sweep. Middle / right: mean nnz per token and
    dead units per layer, one line per run."""
    plt = common.pyplot()

    rows = with_ce_increase([dict(r) for r in rows])
    sweeps = list(dict.fromkeys(_sweep(r) for r in rows))
    markers = "osD^v<>"
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    for r in rows:
        label = f"{r['model']} {r['steps']}: λ={float(r['l1_coeff']):g}" + (
            " re-init" if str(r["reinit_dead"]) == "True" else "")
        if r["ce_increase_pct"] != "":
            zeros, inc = float(r["zeros_pct"]), float(r["ce_increase_pct"])
            sweep = sweeps.index(_sweep(r))
            ax.plot(zeros, inc, markers[sweep % len(markers)], color=f"C{sweep}")
            ax.annotate(f"{float(r['l1_coeff']):g}" + ("r" if str(r["reinit_dead"]) == "True" else ""),
                        (zeros, inc), fontsize=6, xytext=(3, 3), textcoords="offset points")
        per_layer = [float(v) for v in str(r["nnz_per_layer"]).split()]
        ax2.plot(range(len(per_layer)), per_layer, "-o", ms=2, label=label)
        dead = [float(v) for v in str(r["dead_per_layer"]).split()]
        ax3.plot(range(len(dead)), dead, "-o", ms=2, label=label)
    for sweep, (model, steps, tokens, ramp) in enumerate(sweeps):
        ax.plot([], [], markers[sweep % len(markers)], color=f"C{sweep}",
                label=f"{model}, {steps} steps × {tokens}, λ ramp {ramp}")
    ax.axvline(99, color="gray", lw=0.6, ls="--")
    ax.axhline(3, color="gray", lw=0.6, ls="--")
    ax.set_xlabel("MLP activations that are zero, %  (r = dead-gate re-init)")
    ax.set_ylabel("held-out CE increase vs λ=0 of the sweep, %")
    ax.set_title("quality vs sparsity (target: right of 99%, below 3%)")
    ax.legend(fontsize=7)
    ax2.set_yscale("log")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("mean non-zeros per token")
    ax2.set_title("per-layer activity")
    ax3.set_xlabel("layer")
    ax3.set_ylabel("dead units, % (not fired in the last window)")
    ax3.set_title("per-layer dead units")
    ax3.legend(fontsize=5, ncol=2)
    return common.save_figure(fig, path)


# ------------------------------------------------------------------ ReLUfication of a dense model
# `sparseffn bench quality --init-from DIR` (train/relufy.py: relufy_quality) leaves one fine-tuning run
# per setting under OUT/runs/<name>/ with its config.json, run.json, metrics.jsonl and relufy.json (the
# dense original's and the freshly relufied model's held-out evaluations). These rows follow each run:
# stage "dense" (the original, before relufy_), "relufied" (step 0, before fine-tuning), then one
# "fine-tuning" row per evaluation of the run. ce_gap_pct is against the dense original's held-out CE.

RELUFY_FIELDS = (
    "run", "stage", "step", "tokens", "pretraining_tokens", "tokens_pct_of_pretraining", "eval_ce", "dense_ce",
    "ce_gap_pct", "zeros_pct", "nnz_mean", "hidden", "l1_coeff", "l1_schedule", "l1_warmup_steps", "threshold",
    "reinit_dead", "distill_weight", "distill_temperature", "calibrate_nnz", "lr", "steps", "relufied_from",
    "git_sha",
)


def relufy_rows(run_dir: str | Path, git_sha: str = "") -> list[dict]:
    """The rows of one fine-tuning run folder written by `relufy_quality` (see above)."""
    run = Path(run_dir)
    missing = [n for n in ("config.json", "run.json", "metrics.jsonl", "relufy.json") if not (run / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{run}: not a finished `bench quality --init-from` run (missing {', '.join(missing)})")
    cfg = json.loads((run / "config.json").read_text())
    record = json.loads((run / "relufy.json").read_text())
    per_step = int(json.loads((run / "run.json").read_text())["tokens_per_step"])
    pretraining = record.get("pretraining_tokens")
    dense_ce = float(record["dense"]["eval_ce"])
    sparsity = cfg.get("sparsity", {})
    common_fields = {
        "run": run.name, "pretraining_tokens": pretraining if pretraining else "", "dense_ce": round(dense_ce, 5),
        "l1_coeff": sparsity.get("l1_coeff"), "l1_schedule": sparsity.get("l1_schedule", "linear"),
        "l1_warmup_steps": sparsity.get("l1_warmup_steps"), "threshold": sparsity.get("threshold") or 0.0,
        "reinit_dead": sparsity.get("reinit_dead"), "distill_weight": cfg.get("distill_weight", 0.0),
        "distill_temperature": cfg.get("distill_temperature", 1.0), "calibrate_nnz": cfg.get("calibrate_nnz") or "",
        "lr": cfg.get("lr"), "steps": cfg.get("steps"),
        "relufied_from": " ".join(f"{k}={v}" for k, v in (record.get("relufied_from") or {}).items()),
        "git_sha": git_sha,
    }

    def row(stage: str, step: int, ev: dict) -> dict:
        tokens = step * per_step
        sparse = "eval_zeros_pct" in ev
        hidden = ev["eval_hidden"] if sparse else None
        return {
            **common_fields, "stage": stage, "step": step, "tokens": tokens,
            "tokens_pct_of_pretraining": round(100 * tokens / pretraining, 3) if pretraining else "",
            "eval_ce": round(float(ev["eval_ce"]), 5),
            "ce_gap_pct": round(100 * (float(ev["eval_ce"]) / dense_ce - 1), 3),
            "zeros_pct": round(float(ev["eval_zeros_pct"]), 3) if sparse else "",
            "nnz_mean": round(float(ev["eval_nnz_mean_all"]), 2) if sparse else "",
            "hidden": sum(hidden) / len(hidden) if sparse else "",
        }

    evals = [r for r in _rows(run / "metrics.jsonl") if r.get("kind") == "eval"]
    return ([row("dense", 0, record["dense"]), row("relufied", 0, record["relufied"])]
            + [row("fine-tuning", int(r["step"]), r) for r in evals])


def write_relufy_csv(rows: list[dict], path: Path) -> Path:
    return common.write_csv(rows, path, RELUFY_FIELDS)


def _setting(r: dict) -> str:
    text = f"λ={float(r['l1_coeff']):g} {r['l1_schedule']}/{r['l1_warmup_steps']} lr {float(r['lr']):g}"
    if float(r["distill_weight"] or 0) > 0:
        text += f" KD {float(r['distill_weight']):g}@T{float(r['distill_temperature']):g}"
    if float(r["threshold"] or 0) > 0:
        text += f" shift {float(r['threshold']):g}"
    if r["calibrate_nnz"] != "":
        text += f" calib {float(r['calibrate_nnz']):g}"
    return text


def relufy_table(rows: list[dict]) -> str:
    """One line per run: the dense original, then where its last evaluation stands; a caption first."""
    first = rows[0]
    pretraining = f"{int(first['pretraining_tokens']):,} pretraining tokens" if first["pretraining_tokens"] != "" \
        else "pretraining tokens unknown"
    caption = (f"git {first['git_sha'] or 'unknown'}; the dense original's MLPs had "
               f"{first['relufied_from'] or 'their own activation'}; {pretraining}; held-out CE of the last "
               "evaluation; zeros and mean active units per token over every layer.")
    lines = [caption, "", "| run | setting | dense CE | fine-tuning tokens (% of pretraining) | held-out CE | CE gap | zeros "
             "| mean nnz / token (of H) |", "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["run"] for r in rows):
        last = [r for r in rows if r["run"] == name][-1]
        share = f" ({float(last['tokens_pct_of_pretraining']):.1f}%)" if last["tokens_pct_of_pretraining"] != "" else ""
        zeros, nnz = "–", "–"
        if last["zeros_pct"] != "":
            zeros = f"{float(last['zeros_pct']):.2f}%"
            nnz = f"{float(last['nnz_mean']):.1f} ({float(last['hidden']):.0f})"
        lines.append(
            f"| {name} | {_setting(last)} | {float(last['dense_ce']):.4f} | {int(last['tokens']):,}{share} "
            f"| {float(last['eval_ce']):.4f} | {float(last['ce_gap_pct']):+.2f}% | {zeros} | {nnz} |")
    return "\n".join(lines)


def plot_relufy(rows: list[dict], path: Path) -> Path:
    """Left: CE gap to the dense original vs % zeros along each run (target box: right of 99%, below 2%).
    Middle / right: % zeros and CE gap vs the fine-tuning tokens spent (% of pretraining when known)."""
    plt = common.pyplot()
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    names = list(dict.fromkeys(r["run"] for r in rows))
    share = all(r["tokens_pct_of_pretraining"] != "" for r in rows)
    for i, name in enumerate(names):
        sparse = [r for r in rows if r["run"] == name and r["zeros_pct"] != ""]
        if not sparse:
            continue
        label = f"{name}: {_setting(sparse[-1])}"
        zeros = [float(r["zeros_pct"]) for r in sparse]
        gap = [float(r["ce_gap_pct"]) for r in sparse]
        spent = [float(r["tokens_pct_of_pretraining"] if share else r["tokens"]) for r in sparse]
        ax.plot(zeros, gap, "-o", ms=3, color=f"C{i}", label=label)
        ax.plot(zeros[-1:], gap[-1:], "*", ms=11, color=f"C{i}")
        ax2.plot(spent, zeros, "-o", ms=3, color=f"C{i}", label=label)
        ax3.plot(spent, gap, "-o", ms=3, color=f"C{i}", label=label)
    ax.axvline(99, color="gray", lw=0.6, ls="--")
    ax.axhline(2, color="gray", lw=0.6, ls="--")
    ax.set_xlabel("MLP activations that are zero, %")
    ax.set_ylabel("held-out CE above the dense original, %")
    ax.set_title("ReLUfied + L1 fine-tuned (star: last evaluation)")
    ax.legend(fontsize=7)
    spent_label = "fine-tuning tokens, % of pretraining" if share else "fine-tuning tokens"
    ax2.axhline(99, color="gray", lw=0.6, ls="--")
    ax2.set_xlabel(spent_label)
    ax2.set_ylabel("zeros, %")
    ax2.set_title("sparsity along the run (step 0: right after relufy_)")
    ax3.axhline(2, color="gray", lw=0.6, ls="--")
    ax3.set_xlabel(spent_label)
    ax3.set_ylabel("CE gap, %")
    ax3.set_title("quality along the run")
    return common.save_figure(fig, path)
