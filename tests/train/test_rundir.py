"""A failing `sparseffn train` never destroys or half-makes a run: inputs are checked before the run
directory is touched, a new run is built in <run>/.staging and replaces the old one only at its first
checkpoint, and a kill at any point of that swap is completed or undone at the next start."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from sparseffn.cli import main
from sparseffn.train import rundir
from sparseffn.train.checkpoint import list_checkpoints
from sparseffn.train.loop import train
from sparseffn.train.runlock import LOCK_NAME, RunInUseError, RunLock

from .conftest import copy_run, tiny_config


def checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` ("dir" for folders), by relative path."""
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("sparseffn train: error: ") and err.count("\n") == 1, err
    return err


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(flags, expected message) of commands that must fail their checks."""
    binary, small, empty = tmp_path / "binary.txt", tmp_path / "small.txt", tmp_path / "empty_dir"
    binary.write_bytes(b"text\0with a NUL byte\n")
    small.write_text("too short\n")
    empty.mkdir()
    cases = [
        (["--data", str(tmp_path / "missing.txt")], f"data: {tmp_path / 'missing.txt'} is neither a file nor a directory"),
        (["--data", str(binary)], f"data: {binary} is binary"),
        (["--data", str(small)], "training tokens, the corpus has"),
        (["--data", str(empty)], f"no .txt/.md files under directory {empty}"),
        (["--model-override", "num_hidden_layers=-1"],
         "--model-override num_hidden_layers=-1: num_hidden_layers must be a positive int, got -1"),
        (["--model-override", "hidden_size=wide"], "--model-override num_hidden_layers=2 hidden_size=\"wide\": hidden_size"),
        (["--tokenizer", "bpe", "--vocab-size", "100"], "vocab_size must be >= 257 for BPE"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "device='cuda' but torch sees no CUDA device"))
    return cases


def test_overwrite_that_fails_its_checks_leaves_the_old_run_byte_identical(trained_run, small_corpus, tmp_path, capsys):
    out = copy_run(trained_run.out_dir, tmp_path / "run")
    (out / "eval").mkdir()
    (out / "eval" / "eval.json").write_text("{}\n")
    before = checksums(out)
    cfg = tiny_config(small_corpus, out).save(tmp_path / "cfg.json")
    for flags, message in _bad_inputs(tmp_path):
        assert main(["train", "--config", str(cfg), "--overwrite", "--no-progress", *flags]) == 2, flags
        assert message in _one_line_error(capsys), flags
        assert checksums(out) == before, flags
    # a live run is refused, its files untouched
    lock = RunLock(out)
    lock.acquire()
    try:
        locked = checksums(out)
        assert main(["train", "--config", str(cfg), "--overwrite", "--no-progress"]) == 2
        assert f"{out} is in use by pid {os.getpid()}" in _one_line_error(capsys)
        assert checksums(out) == locked
    finally:
        lock.release()


def test_a_fresh_start_that_fails_leaves_no_directory_and_the_retry_runs(small_corpus, tmp_path, capsys):
    out = tmp_path / "new" / "run"
    cfg = tiny_config(small_corpus, out, steps=2, checkpoint_interval=2, eval_interval=0).save(tmp_path / "cfg.json")
    for flags, message in _bad_inputs(tmp_path):
        assert main(["train", "--config", str(cfg), "--no-progress", *flags]) == 2, flags
        assert message in _one_line_error(capsys), flags
        assert not out.exists(), flags
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0  # no --overwrite needed
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [2] and (out / "model").is_dir()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_a_failure_in_the_first_steps_keeps_the_old_run_and_makes_none(trained_run, small_corpus, tmp_path,
                                                                       monkeypatch):
    """The step itself fails (as a GPU out of memory would) before the first checkpoint: the old run is
    byte-identical and its lock free; a new directory is removed; nothing is left in .staging."""
    calls = []

    def failing_l1(model):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        from sparseffn.models import collect_l1

        return collect_l1(model)

    monkeypatch.setattr("sparseffn.train.loop.collect_l1", failing_l1)
    out = copy_run(trained_run.out_dir, tmp_path / "run")
    before = checksums(out)
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny_config(small_corpus, out), overwrite=True, progress=False, echo=None)
    assert checksums(out) == before and (out / LOCK_NAME).read_text() == ""
    calls.clear()
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="simulated"):
        train(tiny_config(small_corpus, fresh), progress=False, echo=None)
    assert not fresh.exists()
    # stopped (as if killed) before the first checkpoint: nothing to resume, so nothing is kept
    monkeypatch.undo()
    stopped = train(tiny_config(small_corpus, fresh), progress=False, echo=None, stop_after_step=2)
    assert stopped.step == 2 and not fresh.exists()


def test_overwrite_replaces_the_old_run_at_the_new_ones_first_checkpoint(trained_run, small_corpus, tmp_path):
    out = copy_run(trained_run.out_dir, tmp_path / "run")
    (out / "eval").mkdir()
    (out / "notes.txt").write_text("mine\n")  # not a run file: kept
    seen = []

    def echo(line):  # the old run is still whole while the new one trains toward its first checkpoint
        if line.startswith("model:"):
            seen.append(((out / "model").is_dir(), (out / ".staging" / "config.json").is_file()))

    cfg = tiny_config(small_corpus, out, seed=1)
    result = train(cfg, overwrite=True, progress=False, echo=echo)
    assert seen == [(True, True)]
    assert result.completed and not (out / "eval").exists() and (out / "notes.txt").read_text() == "mine\n"
    assert json.loads((out / "config.json").read_text())["seed"] == 1
    assert {p.name for p in out.iterdir()} == {"config.json", "run.json", "tokenizer.json", "metrics.jsonl",
                                               "checkpoints", "model", "plots", "notes.txt", LOCK_NAME}


def _fake_run(folder: Path, tag: str, names: tuple[str, ...]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name in ("checkpoints", "model", "plots"):
            (folder / name).mkdir()
            (folder / name / "a.bin").write_bytes(f"{tag} {name}".encode())
        else:
            (folder / name).write_text(f"{tag} {name}\n")


@pytest.mark.parametrize("old_names", [("config.json", "metrics.jsonl", "checkpoints", "model", "plots"), ()],
                         ids=["overwrite", "fresh"])
def test_a_kill_at_any_rename_of_the_swap_leaves_the_old_run_or_the_new_one(tmp_path, monkeypatch, old_names):
    """Crash `publish` after each of its renames in turn; `recover` then leaves exactly the old run
    (crash before the commit) or exactly the new one (after it), never a mix and never nothing."""
    new_names = ("config.json", "tokenizer.json", "run.json", "metrics.jsonl", "checkpoints")
    real_rename = os.rename

    class Killed(Exception):
        pass

    outcomes = []
    for crash_after in range(len(old_names) + 1 + len(new_names) + 1):
        out = tmp_path / f"k{crash_after}" / "run"
        _fake_run(out, "old", old_names)
        (out / LOCK_NAME).write_text("")
        old = checksums(out)
        staging = rundir.new_staging(out)
        _fake_run(staging, "new", new_names)
        want_new = checksums(staging)
        renames = []

        def rename(src, dst):
            if len(renames) == crash_after:
                raise Killed()
            renames.append(src)
            real_rename(src, dst)

        monkeypatch.setattr(rundir.os, "rename", rename)
        try:
            rundir.publish(out, staging)
            crashed = False
        except Killed:
            crashed = True
        monkeypatch.setattr(rundir.os, "rename", real_rename)
        notes = rundir.recover(out)
        state = checksums(out)
        state.pop(LOCK_NAME)
        if state == {k: v for k, v in old.items() if k != LOCK_NAME}:
            outcomes.append("old")
        else:
            assert state == want_new, (crash_after, state)
            outcomes.append("new")
        assert bool(notes) == crashed, (crash_after, notes)
    commit = len(old_names)  # renames before the commit (the old entries moving aside)
    assert outcomes == ["old"] * (commit + 1) + ["new"] * (len(outcomes) - commit - 1), outcomes


def test_the_lock_refuses_a_file_removed_under_it(tmp_path, monkeypatch):
    """A run that made its directory and failed removes it with its lock file; a process that opened
    the file just before is refused rather than holding a lock nobody else can see."""
    real_open = os.open

    def open_then_removed(path, *args):
        fd = real_open(path, *args)
        if Path(path).name == LOCK_NAME:
            Path(path).unlink()
        return fd

    monkeypatch.setattr("sparseffn.train.runlock.os.open", open_then_removed)
    with pytest.raises(RunInUseError, match="was being removed by another process"):
        RunLock(tmp_path).acquire()
