"""`TrainConfig.init_from`: a run that starts from a saved model instead of random weights.

`init_from` names anything `sparseffn.load_pretrained` opens: a sparseffn save (a run's model/ folder), a
checkpoint of the reference implementation (`*_sparse_relu`, the released SparseLM models) or the Hub id
of one. The run then

    model       is that model, in fp32 (bf16 autocast on CUDA as usual), with the run's SparsityConfig
                (λ and its ramp, mode, dead-unit re-init; its thresholds are kept unless the run sets one)
    tokenizer   is the checkpoint's tokenizer.json, saved into the run (its vocabulary must fit the model's)
    resumes     by loading init_from again, then the run's checkpoint over it (init_from must stay readable)

`model` and `model_overrides` do not apply. A dense Hugging Face model goes to `init_from_dense`: it is
relufied (train/relufy.py) and, with distillation, teaches the run as its frozen dense original.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparseffn.train.data import TextTokenizer


def model_source(init_from: str) -> str:
    """The model folder init_from names: a training run directory's model/, else init_from as given."""
    run_model = Path(init_from) / "model"
    return str(run_model) if (run_model / "config.json").is_file() else init_from


def init_format(cfg) -> str:
    """checkpoint_format of cfg.init_from's model: "sparseffn", "reference" or "dense"."""
    from sparseffn.models import checkpoint_format

    return checkpoint_format(model_source(cfg.init_from))


def check_init_from(cfg) -> str | None:
    """The format of cfg.init_from ("sparseffn", "reference", "dense"; None without init_from), checked before
    the run touches its directory: readable, with a tokenizer."""
    if cfg.init_from is None:
        return None
    fmt = init_format(cfg)
    if fmt == "dense":
        init_from_dense(cfg, None)
    else:
        tokenizer_file(model_source(cfg.init_from))
    return fmt


def tokenizer_file(init_from: str) -> Path:
    """The checkpoint's tokenizer.json (downloaded through transformers' cache for a Hub id)."""
    path = Path(init_from)
    if path.is_dir():
        found = path / TextTokenizer.FILE
        if not found.is_file():
            raise FileNotFoundError(
                f"init_from {init_from} has no {TextTokenizer.FILE}: training on text needs the model's own tokenizer; "
                f"copy it into {init_from}")
        return found
    from transformers.utils import cached_file

    return Path(cached_file(init_from, TextTokenizer.FILE))


def build_run_model(cfg, vocab_size: int, device: torch.device):
    """The model a run trains: `build_model(cfg.model, ...)` at random weights, or the init_from checkpoint
    (module docstring). vocab_size: the run tokenizer's."""
    from sparseffn.models import build_model, load_pretrained, set_sparsity_config_
    from sparseffn.train.eval import model_overrides

    if cfg.init_from is None:
        return build_model(cfg.model, None if cfg.dense else cfg.sparsity, vocab_size=vocab_size, device=device, seed=cfg.seed,
                           **model_overrides(cfg))
    if init_format(cfg) == "dense":  # the relufied student (a run's loop also takes the teacher)
        return init_from_dense(cfg, device, teacher=False).model
    model = load_pretrained(model_source(cfg.init_from), device=device, dtype=torch.float32)
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"init_from {cfg.init_from}: its tokenizer has {vocab_size} tokens, more than the model's "
                         f"vocabulary ({model.config.vocab_size})")
    return set_sparsity_config_(model, cfg.sparsity).train()


def init_from_dense(cfg, device: torch.device | None, *, teacher: bool = True):
    """A run that starts from a dense Hugging Face model: load it (local files), keep a frozen copy as the
    teacher when cfg distills (and `teacher`), relufy_ it with cfg.sparsity (train/relufy.py). Returns the
    InitialModel; with device None only checks that cfg.init_from is such a model, before the run starts."""
    from sparseffn.train.relufy import InitialModel, check_dense, load_dense, relufy_start

    if device is None:
        check_dense(cfg.init_from)
        return None
    model, tokenizer = load_dense(cfg.init_from, device)
    student, frozen = relufy_start(model, cfg if teacher else cfg.replace(distill_weight=0.0))
    return InitialModel(student, tokenizer, frozen)
