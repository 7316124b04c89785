"""`sparseffn bench calibrate CKPT`: what post-training thresholds cost a trained model's quality.

`calibrate_thresholds` sparsifies a model without retraining (per-unit thresholds fitted to a target
mean of active units per token, docs/design.md). This harness measures its price. For each target it
reloads the checkpoint, calibrates on windows of the run's *training* split, and evaluates held-out
cross-entropy and sparsity on the run's held-out windows, against the same checkpoint uncalibrated
(target "none"). A model directory without its run (a released checkpoint with its tokenizer) uses the
embedded corpus and TrainConfig's default window sizes. Rows go to a long CSV (`calibrate.csv`) with the device and git sha; `bench report`
turns it into a README table and a PNG (CE increase vs % zeros).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sparseffn.bench import common
from sparseffn.bench.timing import device_slug, run_metadata

CSV_FIELDS = (
    "device", "git_sha", "checkpoint", "model", "hidden", "target_nnz", "nnz_mean", "zeros_pct", "silent_pct",
    "eval_ce", "ce_increase_pct", "calibration_tokens", "eval_tokens", "mix",
)


@dataclass(frozen=True)
class CalibrateBenchConfig:
    checkpoint: str = ""  # a training run directory or a model directory with its tokenizer, as `sparseffn eval` takes
    targets: str = "64,32,16,8"  # mean active units per token per layer, comma separated
    calibration_windows: int = 32  # training-split windows of the run's sequence length
    mix: float = 0.5  # calibrate_thresholds' mix of per-unit quantile and global level
    out_dir: str = "benchmarks/results"
    git_sha: str = ""  # empty: read from git


def _split_windows(run_cfg, tokenizer, train_count: int, held_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training-split windows, held-out windows) [N, seq_len + 1] of a run's corpus, read once."""
    from sparseffn.train.data import eval_windows, read_corpus, split_documents, token_stream

    train_texts, held_texts = split_documents(read_corpus(run_cfg.data), run_cfg.eval_fraction)
    return tuple(eval_windows(token_stream(tokenizer, texts), run_cfg.seq_len, count)
                 for texts, count in ((train_texts, train_count), (held_texts, held_count)))


def run_calibrate_bench(cfg: CalibrateBenchConfig, device: torch.device | None = None,
                        log: Callable[[str], None] = print) -> list[dict]:
    """One row for the uncalibrated checkpoint, then one per target; also written as CSV under cfg.out_dir."""
    from sparseffn.models import calibrate_thresholds
    from sparseffn.train.config import TrainConfig
    from sparseffn.train.eval import evaluate, load_for_eval, resolve_target

    if not cfg.checkpoint:
        raise ValueError("checkpoint: give a training run directory (sparseffn bench calibrate RUN_DIR)")
    try:
        targets = [float(t) for t in cfg.targets.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"targets: comma-separated numbers of active units per token, got {cfg.targets!r}") from None
    if not targets:
        raise ValueError(f"targets: give at least one mean nnz per token, got {cfg.targets!r}")
    if cfg.calibration_windows < 1:
        raise ValueError(f"calibration_windows must be >= 1, got {cfg.calibration_windows}")
    target = resolve_target(cfg.checkpoint)
    if target.run_dir is None and target.model_dir is None:
        raise ValueError(f"checkpoint {cfg.checkpoint}: needs its training run directory (config.json) to rebuild "
                         "the training and held-out splits")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = torch.bfloat16 if device.type == "cuda" else None
    metadata = run_metadata(device)
    meta = {"device": metadata["gpu"], "git_sha": cfg.git_sha or metadata["git_sha"]}

    rows: list[dict] = []
    base_ce = None
    for goal in [None, *targets]:
        model, tokenizer, run_cfg = load_for_eval(target, device)  # a fresh, uncalibrated copy per target
        # a model directory without its run (a released checkpoint): the default corpus and window sizes
        name = run_cfg.model if run_cfg is not None else Path(cfg.checkpoint).name
        run_cfg = run_cfg or TrainConfig()
        if goal is None:
            calibration, held = _split_windows(run_cfg, tokenizer, cfg.calibration_windows,
                                               run_cfg.eval_batches * run_cfg.batch_size)
            calibration = calibration[:, :-1]
        else:
            batches = list(calibration.split(run_cfg.batch_size))
            calibrate_thresholds(model, batches, goal, mix=cfg.mix)
        result = evaluate(model, held, batch_size=run_cfg.batch_size, device=device, autocast_dtype=amp)
        stats = result.stats
        base_ce = result.ce if goal is None else base_ce
        row = dict(
            meta, checkpoint=str(cfg.checkpoint), model=name, hidden=round(sum(stats.hidden) / len(stats.hidden)),
            target_nnz="none" if goal is None else goal, nnz_mean=round(stats.nnz_mean_all, 3),
            zeros_pct=round(stats.zeros_pct, 3), silent_pct=round(100 * sum(stats.silent_frac) / len(stats.silent_frac), 2),
            eval_ce=round(result.ce, 5), ce_increase_pct=round(100 * (result.ce / base_ce - 1), 3),
            calibration_tokens=0 if goal is None else calibration.numel(), eval_tokens=result.tokens, mix=cfg.mix,
        )
        rows.append(row)
        log(f"target {row['target_nnz']}: {row['nnz_mean']} active units per token ({row['zeros_pct']}% zeros), "
            f"held-out CE {row['eval_ce']} ({row['ce_increase_pct']:+.2f}%)")
        del model
    common.write_csv(rows, Path(cfg.out_dir) / device_slug(device) / "calibrate.csv", CSV_FIELDS)
    return rows


def calibrate_table(rows: list[dict]) -> str:
    """One line per (checkpoint, target): the sparsity reached and the held-out CE it cost."""
    if not rows:
        return "(no rows)"
    first = rows[0]
    lines = [
        f"{first['device']}, git {first['git_sha']}. Thresholds fitted on training-split windows "
        f"(`calibrate_thresholds`, mix {first['mix']}), measured on the held-out split; CE increase against "
        "the same checkpoint without thresholds.\n",
        "| checkpoint | model | target nnz | mean nnz / token (of H) | zeros | silent units | held-out CE | CE vs uncalibrated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {Path(r['checkpoint']).name} | {r['model']} | {r['target_nnz']} | {float(r['nnz_mean']):.1f} "
            f"(of {r['hidden']}) | {float(r['zeros_pct']):.2f}% | {float(r['silent_pct']):.1f}% "
            f"| {float(r['eval_ce']):.4f} | {float(r['ce_increase_pct']):+.2f}% |"
        )
    return "\n".join(lines)


def plot_calibrate(rows: list[dict], path: Path) -> Path:
    """CE increase vs % zeros, one line per checkpoint."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, checkpoint in enumerate(dict.fromkeys(r["checkpoint"] for r in rows)):
        points = sorted((float(r["zeros_pct"]), float(r["ce_increase_pct"])) for r in rows if r["checkpoint"] == checkpoint)
        ax.plot(*zip(*points), "-o", color=f"C{i}", label=Path(checkpoint).name)
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xlabel("% zeros of the MLP activations (held-out)")
    ax.set_ylabel("held-out CE increase (%)")
    ax.set_title("post-training thresholds: sparsity vs quality")
    ax.legend(fontsize=8)
    return common.save_figure(fig, path)
