"""Shared fixtures of the training tests: a small corpus, a tiny config, finished and stopped runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sparseffn.models import SparsityConfig
from sparseffn.train.config import TrainConfig
from sparseffn.train.data import default_corpus_dir


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """Three ~40 kB text files cut from the embedded corpus (the Makefile installs it)."""
    folder = tmp_path_factory.mktemp("corpus")
    for name in ("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt"):
        text = (default_corpus_dir() / name).read_text(encoding="utf-8")
        (folder / name).write_text(text[:40_000], encoding="utf-8")
    return folder


def tiny_config(corpus: Path, out_dir: Path, **changes) -> TrainConfig:
    """A 2-layer tiny model on the small corpus: a step takes milliseconds on a CPU."""
    base = TrainConfig(
        model="tiny", model_overrides={"num_hidden_layers": 2}, data=str(corpus), tokenizer="byte", seq_len=32,
        batch_size=4, steps=8, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_interval=4, eval_batches=2, log_interval=1,
        checkpoint_interval=4, out_dir=str(out_dir), sparsity=SparsityConfig(l1_coeff=1e-3, l1_warmup_steps=3),
    )
    return base.replace(**changes)


@pytest.fixture(scope="session")
def trained_run(small_corpus, tmp_path_factory):
    """One finished 8-step run (model/, metrics.jsonl, checkpoints, plots)."""
    from sparseffn.train.loop import train

    out = tmp_path_factory.mktemp("run") / "tiny"
    return train(tiny_config(small_corpus, out), progress=False, echo=None)


@pytest.fixture(scope="session")
def uninterrupted(small_corpus, tmp_path_factory):
    """(config, result) of a 10-step run with checkpoints at 4, 8 and 10. Dead-unit re-init with a short
    window, so the resumed state includes dead-unit counters, re-drawn gate rows and zeroed AdamW moments."""
    from sparseffn.train.loop import train

    cfg = tiny_config(small_corpus, tmp_path_factory.mktemp("full") / "run", steps=10, reinit_dead=True,
                      reinit_dead_after=2, l1_coeff=3e-2)
    return cfg, train(cfg, progress=False, echo=None)


@pytest.fixture(scope="session")
def stopped_at_9(uninterrupted, tmp_path_factory) -> Path:
    """`uninterrupted`'s run stopped after step 9 as if killed: checkpoints 4 and 8, metrics rows to step 9.
    Tests damage copies of it (copy_run)."""
    from sparseffn.train.loop import train

    cfg, _ = uninterrupted
    out = tmp_path_factory.mktemp("stopped") / "run"
    train(cfg.replace(out_dir=str(out)), progress=False, echo=None, stop_after_step=9)
    return out


def copy_run(run: Path, out: Path) -> Path:
    shutil.copytree(run, out)
    return out
