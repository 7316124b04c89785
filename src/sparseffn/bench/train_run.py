"""`sparseffn bench train-run`: a training run from initialization, dense vs auto mode, same seed.

What a user of the L1 recipe runs: the model starts with about half of its MLP units active and
sparsifies as the penalty ramps up. Dense mode runs three torch GEMMs throughout; auto mode decides
per layer and per call from the layer's measured activity (nn/activity.py, ops/decide.py), so it
should run dense while activations are dense and take the sparse training kernels once a layer's
activity falls under the break-even. One row per logging step and mode: tokens/s of the window,
zeros %, mean active units per token, how many layers took the sparse path, held-out CE where
evaluated; a summary row per mode: wall time, time to reach 99% zeros, final held-out CE. CSV
`train_run.csv` with the GPU name and git sha, and a PNG of speed and sparsity against step.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sparseffn.bench.common import pyplot, save_figure, write_csv
from sparseffn.bench.timing import device_slug, run_metadata

CSV_FIELDS = (
    "gpu", "torch", "triton", "git_sha", "model", "mode", "kind", "step", "elapsed_s", "tokens_per_s", "zeros_pct",
    "nnz_mean_all", "sparse_layers", "layers", "ce", "eval_ce", "nnz_mean", "path", "wall_s", "steps_to_99",
    "seconds_to_99", "final_eval_ce",
)


@dataclass(frozen=True)
class TrainRunBenchConfig:
    model: str = "0.5b"
    steps: int = 600
    batch_size: int = 8
    seq_len: int = 2048
    l1_coeff: float = 2e-2
    l1_warmup_steps: int = 100
    lr: float = 1e-3
    data: str = ""  # text file or directory; empty = the default corpus
    tokenizer: str = "byte"
    log_interval: int = 10
    eval_interval: int = 200
    modes: str = "dense,auto"
    seed: int = 0
    out_dir: str = "benchmarks/results"
    git_sha: str = ""


def run_train_run_bench(cfg: TrainRunBenchConfig, device: torch.device | None = None,
                        log: Callable[[str], None] = print) -> list[dict]:
    from sparseffn.models.config import SparsityConfig
    from sparseffn.train.config import TrainConfig
    from sparseffn.train.loop import train

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = run_metadata(device)
    if cfg.git_sha:
        meta["git_sha"] = cfg.git_sha
    rows: list[dict] = []
    path = Path(cfg.out_dir) / device_slug(device) / "train_run.csv"
    work = Path(tempfile.mkdtemp(prefix="sparseffn-train-run-"))
    try:
        for mode in [m.strip() for m in cfg.modes.split(",") if m.strip()]:
            train_cfg = TrainConfig(
                model=cfg.model, data=cfg.data or None, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len,
                batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr, log_interval=cfg.log_interval,
                eval_interval=cfg.eval_interval, checkpoint_interval=0, keep_checkpoints=1, seed=cfg.seed,
                device=device.type, out_dir=str(work / mode),
                sparsity=SparsityConfig(l1_coeff=cfg.l1_coeff, l1_warmup_steps=cfg.l1_warmup_steps, mode=mode),
            )
            result = train(train_cfg, progress=False, echo=log)
            rows += _rows(meta, cfg.model, mode, result.metrics_path, result.seconds)
            del result
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_csv(rows, path, CSV_FIELDS)
            summary = rows[-1]
            log(f"{mode}: {summary['wall_s']:.0f} s in all, 99% zeros at step {summary['steps_to_99']} "
                f"({summary['seconds_to_99']} s), final held-out CE {summary['final_eval_ce']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _rows(meta: dict, model: str, mode: str, metrics_path: Path, wall_s: float) -> list[dict]:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    evals = {r["step"]: r for r in records if r.get("kind") == "eval"}
    rows, first_99 = [], None
    for r in records:
        if r.get("kind") != "train":
            continue
        paths = r.get("path") or []
        eval_row = evals.get(r["step"])
        rows.append(dict(
            meta, model=model, mode=mode, kind="step", step=r["step"], elapsed_s=r["elapsed_s"],
            tokens_per_s=r["tokens_per_s"], zeros_pct=r["zeros_pct"], nnz_mean_all=r["nnz_mean_all"],
            sparse_layers=sum(p == "sparse" for p in paths), layers=len(paths), ce=round(r["ce"], 5),
            eval_ce="" if eval_row is None else round(eval_row["eval_ce"], 5),
            nnz_mean=json.dumps(r["nnz_mean"]), path=json.dumps(paths)))
        if first_99 is None and r["zeros_pct"] >= 99.0:
            first_99 = r
    final = evals[max(evals)]["eval_ce"] if evals else float("nan")
    rows.append(dict(meta, model=model, mode=mode, kind="summary", wall_s=round(wall_s, 1),
                     steps_to_99="" if first_99 is None else first_99["step"],
                     seconds_to_99="" if first_99 is None else first_99["elapsed_s"],
                     final_eval_ce=round(final, 5)))
    return rows


def train_run_table(rows: list[dict]) -> str:
    """Markdown: per mode, wall time, when 99% zeros were reached, final held-out CE; auto's tokens/s
    against dense's in each phase (`phase_speeds`)."""
    summaries = {r["mode"]: r for r in rows if r["kind"] == "summary"}
    if not summaries:
        return "(no rows)"
    first = rows[0]
    dense_phase, sparse_phase = phase_speeds(rows)
    lines = [f"{first['gpu']}, git {first['git_sha']}, `{first['model']}`, the same seed and data for both runs.\n",
             "| mode | wall s | 99% zeros at step (s) | final held-out CE |", "|---|---|---|---|"]
    for mode, s in summaries.items():
        reach = f"{s['steps_to_99']} ({s['seconds_to_99']} s)" if s["steps_to_99"] != "" else "not reached"
        lines.append(f"| {mode} | {float(s['wall_s']):.0f} | {reach} | {s['final_eval_ce']} |")
    lines.append("")
    lines.append(f"auto / dense tokens/s: **{dense_phase:.2f}x** while auto runs every layer dense, "
                 f"**{sparse_phase:.2f}x** once it runs every layer sparse (step by step against the dense run; "
                 "each run's first logging window and the window of the switch, where the training kernels "
                 "compile, left out).")
    return "\n".join(lines)


def phase_speeds(rows: list[dict]) -> tuple[float, float]:
    """(auto / dense tokens/s while every auto layer runs dense, the same once every layer runs sparse),
    step by step against the dense run; the first window of each run (compilation, warm-up) and the
    window of the switch (the training kernels compile there) left out."""
    dense = {int(r["step"]): float(r["tokens_per_s"]) for r in rows if r["kind"] == "step" and r["mode"] == "dense"}
    auto = [r for r in rows if r["kind"] == "step" and r["mode"] == "auto"]
    first = min(dense) if dense else None
    phases: dict[str, list[tuple[float, float]]] = {"dense": [], "sparse": []}
    previous = None
    for r in auto:
        step, sparse = int(r["step"]), int(r["sparse_layers"])
        phase = "dense" if sparse == 0 else ("sparse" if sparse == int(r["layers"]) else None)
        if phase and step != first and step in dense and previous == phase:
            phases[phase].append((float(r["tokens_per_s"]), dense[step]))
        previous = phase
    ratio = {k: (sum(a for a, _ in v) / sum(d for _, d in v)) if v else float("nan") for k, v in phases.items()}
    return ratio["dense"], ratio["sparse"]


def plot_train_run(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, (speed, zeros) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["kind"] == "step" and r["mode"] == mode]
        steps = [int(r["step"]) for r in rs]
        speed.plot(steps, [float(r["tokens_per_s"]) for r in rs], label=mode)
        zeros.plot(steps, [float(r["zeros_pct"]) for r in rs], label=mode)
        if mode == "auto":
            layers = max(int(r["layers"]) for r in rs) if rs else 1
            frac = [100.0 * int(r["sparse_layers"]) / max(layers, 1) for r in rs]
            zeros.plot(steps, frac, ls="--", label="auto: % of layers on the sparse path")
    speed.set_xlabel("step")
    speed.set_ylabel("tokens/s")
    speed.legend()
    zeros.set_xlabel("step")
    zeros.set_ylabel("%")
    zeros.set_title("MLP activations that are zero")
    zeros.legend(fontsize=8)
    return save_figure(fig, path)
