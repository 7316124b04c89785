"""PNG plots of a training run from its metrics.jsonl: loss curves, per-layer sparsity, dead units."""

from __future__ import annotations

from pathlib import Path

from sparseffn.train.metrics import read_metrics


def _rows(metrics_path: Path) -> tuple[list[dict], list[dict], list[int]]:
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    reinit_steps = [r["step"] for r in rows if r.get("reinit") and any(r["reinit"])]
    if not train:
        raise ValueError(f"{metrics_path} has no training rows to plot")
    return train, evals, reinit_steps


def plot_metrics(metrics_path: str | Path, folder: str | Path) -> list[Path]:
    """Write loss.png, sparsity.png and dead.png (the last two only for sparse runs) into `folder`;
    returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals, reinit_steps = _rows(Path(metrics_path))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in train]
    layers = len(train[0].get("nnz_mean", []))  # 0 for a dense run
    colors = plt.get_cmap("viridis")
    paths = []

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    ax[0].plot(steps, [r["loss"] for r in train], label="loss = CE + λ·L1", lw=1.2)
    ax[0].plot(steps, [r["ce"] for r in train], label="train CE", lw=1.2)
    if evals:
        ax[0].plot([r["step"] for r in evals], [r["eval_ce"] for r in evals], "o-", label="held-out CE")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("nats / token")
    ax[0].legend()
    ax[0].set_title("loss")
    ax[1].plot(steps, [r["l1"] for r in train], color="tab:purple", label="L1 (mean over layers)")
    if any(r["l1"] > 0 for r in train):
        ax[1].set_yscale("log")
    ax[1].set_xlabel("step")
    twin = ax[1].twinx()
    twin.plot(steps, [r["l1_coeff"] for r in train], color="gray", ls="--", label="λ")
    twin.set_ylabel("λ")
    lines = ax[1].get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax[1].legend(lines, [h.get_label() for h in lines], loc="center right")
    ax[1].set_title("L1 penalty and its coefficient")
    fig.tight_layout()
    paths.append(folder / "loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if "nnz_mean" not in train[0]:  # a dense run (TrainConfig.dense): no sparsity to plot
        return paths

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    for i in range(layers):
        c = colors(i / max(layers - 1, 1))
        ax[0].plot(steps, [r["nnz_mean"][i] for r in train], color=c, lw=1.2, label=f"layer {i}")
        ax[1].plot(steps, [100 * r["overflow_rate"][i] for r in train], color=c, lw=1.2, label=f"layer {i}")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("mean active units per token")
    ax[0].set_title(f"sparsity (H = {train[0]['hidden'][0]}; {train[-1]['zeros_pct']:.2f}% zeros at the end)")
    ax[0].legend(fontsize=8, ncol=2)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("% tokens with a 256-tile over 32 active units")
    ax[1].set_title("TwELL overflow rate (tile 256, 32 slots)")
    fig.tight_layout()
    paths.append(folder / "sparsity.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i in range(layers):
        ax.plot(steps, [100 * r["dead_frac"][i] for r in train], color=colors(i / max(layers - 1, 1)), lw=1.2,
                label=f"layer {i}")
    ax.plot(steps, [100 * r["dead_frac_all"] for r in train], color="black", lw=2, label="all")
    if reinit_steps:
        ax.plot(reinit_steps, [0] * len(reinit_steps), "|", color="red", ms=12, label="gate re-init")
    ax.set_xlabel("step")
    ax.set_ylabel("% dead units")
    ax.set_title("dead units (silent on every observed step of the window)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(folder / "dead.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
