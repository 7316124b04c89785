"""Sparsify a pretrained dense model: load it, relufy_ it, fine-tune it with L1 (and distillation).

    model, tokenizer = load_dense(DIR)                  a dense Hugging Face directory (+ tokenizer.json)
    student, teacher = relufy_start(model, cfg)         teacher: frozen copy of the dense model, if distilling
    train(cfg, initial=InitialModel(student, tokenizer, teacher))

`RELUFY_CONFIG` is the fine-tuning preset (`sparseffn train --preset relufy`, docs/sparsify.md says why
each value). `relufy_quality` is `sparseffn bench quality --init-from DIR`: the dense original's
held-out CE, then the relufied model's before and along the fine-tuning run, as files that
`sparseffn.bench.quality` turns into a CSV and a plot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sparseffn.models import SparsityConfig, relufied_from, relufy_
from sparseffn.models.hf_config import CONFIG_KEY
from sparseffn.train.config import TrainConfig
from sparseffn.train.data import TextTokenizer
from sparseffn.train.distill import frozen_copy

# Fine-tuning preset for a model pretrained with `sparseffn train --dense` (1500 steps × 4096 tokens at
# lr 1e-3 → 1e-4), measured on the H200 (docs/sparsify.md): 300 steps = 20% of the pretraining tokens at
# the pretraining's own lr schedule (1e-3 → 1e-4; at 3e-4 → 3e-5 sparsity stalled at 91-97% once the lr
# decayed), distillation from the frozen dense original (weight 1, T 2: it held CE at every λ tried),
# and λ = 3e-2 (`100m`: 99.78% zeros at -0.10% CE; `20m` needed 2e-1), ramped with ProSparse's sine
# over the first half.
RELUFY_CONFIG = TrainConfig(
    steps=300,
    lr=1e-3,
    min_lr=1e-4,
    warmup_steps=20,
    eval_interval=50,
    out_dir="runs/relufy",
    distill_weight=1.0,
    distill_temperature=2.0,
    sparsity=SparsityConfig(l1_coeff=3e-2, l1_warmup_steps=150, l1_schedule="sine"),
)
PRESETS = {"pretrain": TrainConfig(), "relufy": RELUFY_CONFIG}
RECORD = "relufy.json"  # written into a fine-tuning run by relufy_quality


@dataclass(frozen=True)
class InitialModel:
    """What `train(cfg, initial=...)` starts from instead of building cfg.model."""

    model: nn.Module  # with sparse layers (relufy_ / sparsify_ done)
    tokenizer: TextTokenizer  # the tokenizer the model was trained with
    teacher: nn.Module | None = None  # frozen dense original, for cfg.distill_weight > 0


def dense_model_dir(path: str | Path) -> Path:
    """The save_pretrained folder of `path`: a `sparseffn train` run directory (its model/) or the folder."""
    path = Path(path)
    folder = path / "model" if (path / "model").is_dir() else path
    if not (folder / "config.json").is_file() or not (folder / TextTokenizer.FILE).is_file():
        raise FileNotFoundError(f"--init-from {path}: expected a saved model directory (config.json + "
                                f"{TextTokenizer.FILE}) or a training run directory with model/")
    return folder


def check_dense(path: str | Path) -> Path:
    """The model folder of `path` (dense_model_dir) after checking that its config is not a sparse one."""
    from transformers import AutoConfig

    folder = dense_model_dir(path)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if getattr(config, CONFIG_KEY, None) is not None:
        raise ValueError(f"--init-from {path}: this checkpoint is already sparse (config.json has "
                         f"{CONFIG_KEY!r}); relufy_ starts from a dense model")
    return folder


def load_dense(path: str | Path, device: torch.device | str | None = None) -> tuple[nn.Module, TextTokenizer]:
    """(model, tokenizer) of a dense Hugging Face directory, from local files only, in fp32. A sparse
    checkpoint (saved from a sparsified model) is refused: it loads with sparseffn.load_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = check_dense(path)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    if device is not None:
        model.to(device)
    return model, TextTokenizer.load(folder)


def relufy_start(model: nn.Module, cfg: TrainConfig, filter_fn=None) -> tuple[nn.Module, nn.Module | None]:
    """(student, teacher) for fine-tuning the dense `model` with `cfg`: the teacher is a frozen copy of the
    dense model taken first (only when cfg.distill_weight > 0, else None); then relufy_(model,
    cfg.sparsity) in place (shift = cfg.sparsity.threshold) gives the student."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    if cfg.dense:
        raise ValueError("cfg.dense is set: a relufied model is trained sparse (leave out --dense)")
    teacher = frozen_copy(model) if cfg.distill_weight > 0 else None
    relufy_(model, cfg.sparsity, filter_fn=filter_fn)
    return model, teacher


def pretraining_tokens(dense_dir: Path) -> int | None:
    """Tokens the dense model was trained on, if it comes from a `sparseffn train` run (else None)."""
    run = dense_dir.parent if dense_dir.name == "model" else dense_dir
    if not ((run / "run.json").is_file() and (run / "config.json").is_file()):
        return None
    steps = json.loads((run / "config.json").read_text()).get("steps")
    per_step = json.loads((run / "run.json").read_text()).get("tokens_per_step")
    return int(steps) * int(per_step) if steps and per_step else None


def relufy_quality(dense_path: str | Path, cfg: TrainConfig, name: str, *, progress: bool = True,
                   echo=print) -> Path:
    """`sparseffn bench quality --init-from`: evaluate the dense model, relufy_ it, evaluate again, fine-tune
    it with cfg into cfg.out_dir/runs/<name> (replacing an earlier run of that name) and write that
    run's RECORD (the dense and relufied evaluations, the pretraining tokens). Returns the run folder."""
    from sparseffn.train.eval import evaluate, held_out_windows
    from sparseffn.train.loop import resolve_amp, resolve_device, train
    from sparseffn.train.distributed import dist_from_env

    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--name must be a plain folder name, got {name!r}")
    dense_dir = dense_model_dir(dense_path)
    device = resolve_device(cfg.device, dist_from_env())
    model, tokenizer = load_dense(dense_dir, device)
    windows = held_out_windows(tokenizer, cfg.data, cfg.eval_fraction, cfg.seq_len, cfg.eval_batches * cfg.batch_size)
    amp = resolve_amp(cfg.dtype, device)
    dense = evaluate(model, windows, batch_size=cfg.batch_size, device=device, autocast_dtype=amp)
    student, teacher = relufy_start(model, cfg)
    relufied = evaluate(student, windows, batch_size=cfg.batch_size, device=device, autocast_dtype=amp)
    if echo is not None:
        echo(f"dense original: held-out CE {dense.ce:.4f}; relufied, before fine-tuning: CE {relufied.ce:.4f}, "
             f"{relufied.stats.zeros_pct:.2f}% zeros")
    run = Path(cfg.out_dir) / "runs" / name
    run_cfg = cfg.replace(out_dir=str(run))
    result = train(run_cfg, overwrite=True, progress=progress, echo=echo,
                   initial=InitialModel(student, tokenizer, teacher))
    record = {
        "dense_dir": str(dense_dir), "relufied_from": relufied_from(student),
        "pretraining_tokens": pretraining_tokens(dense_dir),
        "dense": dense.as_row(), "relufied": relufied.as_row(),
        "final": result.final_eval.as_row() if result.final_eval is not None else None,
    }
    (run / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return run
