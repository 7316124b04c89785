"""Exact resume: a run stopped after a checkpoint and resumed writes the same metrics as an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from sparseffn.train.checkpoint import list_checkpoints, load_checkpoint, manifest_path
from sparseffn.train.loop import train
from sparseffn.train.metrics import read_metrics

from .conftest import tiny_config

TIMING = {"tokens_per_s", "elapsed_s"}


def _rows(path):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(path)]


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_stop_and_resume_gives_the_same_curve(uninterrupted, tmp_path):
    cfg, full = uninterrupted
    rows_full = _rows(full.metrics_path)
    assert any(r.get("reinit") for r in rows_full), "the run should re-initialise some dead units"
    part_cfg = cfg.replace(out_dir=str(tmp_path / "run"))
    stopped = train(part_cfg, progress=False, echo=None, stop_after_step=6)
    assert not stopped.completed and stopped.step == 6 and stopped.model_dir is None
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [4]
    assert max(r["step"] for r in read_metrics(stopped.metrics_path)) == 6  # rows past the checkpoint
    with pytest.raises(FileExistsError, match="--resume"):
        train(part_cfg, progress=False, echo=None)
    resumed = train(part_cfg, resume=True, progress=False, echo=None)
    assert resumed.completed and resumed.step == 10
    assert _rows(resumed.metrics_path) == rows_full  # float-equal losses, stats, lr, λ
    a, b = _params(full.model), _params(resumed.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ckpt = load_checkpoint(list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1])
    assert ckpt["step"] == 10 and set(ckpt) >= {"model", "optimizer", "scheduler", "rng", "sampler", "dead_units"}


def test_resume_refuses_changed_settings(uninterrupted, tmp_path):
    cfg, _ = uninterrupted
    part = cfg.replace(out_dir=str(tmp_path / "run"))
    train(part, progress=False, echo=None, stop_after_step=4)
    with pytest.raises(ValueError, match="seq_len"):
        train(part.replace(seq_len=16), resume=True, progress=False, echo=None)
    with pytest.raises(FileNotFoundError, match="cannot resume: .*other does not exist"):
        train(part.replace(out_dir=str(tmp_path / "other")), resume=True, progress=False, echo=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        train(part.replace(out_dir=str(tmp_path / "empty")), resume=True, progress=False, echo=None)


def test_killed_process_resumes_exactly(small_corpus, tmp_path):
    """SIGKILL a `sparseffn train` process once it has written a checkpoint, resume it, compare."""
    cfg = tiny_config(small_corpus, tmp_path / "reference", steps=60, checkpoint_interval=5, eval_interval=20)
    reference = train(cfg, progress=False, echo=None)
    out = tmp_path / "run"
    cfg_path = cfg.replace(out_dir=str(out)).save(tmp_path / "cfg.json")
    proc = subprocess.Popen([sys.executable, "-m", "sparseffn", "train", "--config", str(cfg_path), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    try:
        # a checkpoint counts once its manifest is written (the payload lands first; without the
        # manifest, resume rightly refuses it)
        while not any(manifest_path(path).is_file() for _, path in list_checkpoints(out / "checkpoints")):
            if proc.poll() is not None:
                pytest.fail(f"training exited before its first checkpoint: {proc.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint within 300 s")
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = list_checkpoints(out / "checkpoints")[-1][0]
    assert killed_at < 60 and not (out / "model").exists()
    from sparseffn.cli import main

    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert _rows(out / "metrics.jsonl") == _rows(reference.metrics_path)
    assert json.loads((out / "config.json").read_text())["checkpoint_interval"] == 5
