"""Faults a training run must survive with nothing lost: a second process on the run, damaged checkpoints,
a torn metrics line, a full disk while saving, a kill while metrics.jsonl is rewritten."""

import builtins
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from sparseffn.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    manifest_path,
    newest_usable_checkpoint,
)
from sparseffn.train.durable import WriteError
from sparseffn.train.loop import train
from sparseffn.train.metrics import read_metrics
from sparseffn.train.runlock import LOCK_NAME, RunInUseError

from .conftest import copy_run, tiny_config
from .faults import disk_full, faulty_open

TIMING = {"tokens_per_s", "elapsed_s"}
REPO = Path(__file__).resolve().parents[2]


def _rows(path):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(path)]


def _resume(cfg, out, **kwargs):
    """Resume the run in `out`; (result, the status lines it printed)."""
    lines = []
    result = train(cfg.replace(out_dir=str(out)), resume=True, progress=False, echo=lines.append, **kwargs)
    return result, lines


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _flip_bits(path: Path) -> None:
    """Flip two bits in the middle of the largest tensor's bytes (torch.load still succeeds)."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda r: r.file_size)
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = record.header_offset + 30 + name_len + extra_len + record.file_size // 2
        f.seek(at)
        a, b = f.read(2)
        f.seek(at)
        f.write(bytes([a ^ 0x40, b ^ 0x01]))


@pytest.mark.parametrize("damage, reason", [(_truncate, "truncated"), (_flip_bits, "corrupted")],
                         ids=["truncated", "bit flips"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(uninterrupted, stopped_at_9, tmp_path, damage, reason):
    cfg, full = uninterrupted
    out = copy_run(stopped_at_9, tmp_path / "run")
    newest = list_checkpoints(out / "checkpoints")[-1][1]
    assert newest.name == "step_00000008.pt"
    damage(newest)
    with pytest.raises(CheckpointError, match=f"step_00000008.pt: {reason}"):
        load_checkpoint(newest)
    resumed, lines = _resume(cfg, out)
    assert any(line.startswith("warning: skipped a checkpoint: ") and f"step_00000008.pt: {reason}" in line
               for line in lines), lines
    assert any("resumed from" in line and "step_00000004.pt (step 4)" in line for line in lines), lines
    assert resumed.completed and _rows(out / "metrics.jsonl") == _rows(full.metrics_path)


def test_checkpoints_without_manifest_or_all_damaged_are_refused(stopped_at_9, tmp_path):
    out = copy_run(stopped_at_9, tmp_path / "run")
    folder = out / "checkpoints"
    old, new = [path for _, path in list_checkpoints(folder)]
    manifest_path(new).unlink()  # a crash between the checkpoint's rename and its manifest's
    path, payload, skipped = newest_usable_checkpoint(folder)
    assert path == old and payload["step"] == 4
    assert [str(e) for e in skipped] == [f"{new}: no manifest {new.name}.json beside it to verify it against"]
    _truncate(old)
    with pytest.raises(CheckpointError) as caught:
        newest_usable_checkpoint(folder)
    message = str(caught.value)
    assert message.startswith(f"cannot resume: no usable checkpoint under {folder}: ") and "\n" not in message
    assert f"{new}: no manifest" in message and f"{old}: truncated" in message


def test_torn_last_metrics_line_is_dropped_with_a_warning(uninterrupted, stopped_at_9, tmp_path):
    cfg, full = uninterrupted
    out = copy_run(stopped_at_9, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 10, "lr": 0.0')  # power loss mid-append
    resumed, lines = _resume(cfg, out)
    assert any(line.startswith(f"warning: dropped the torn last line of {out / 'metrics.jsonl'}") for line in lines)
    assert _rows(out / "metrics.jsonl") == _rows(full.metrics_path)


def test_metrics_reader_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr')
    with pytest.warns(RuntimeWarning, match=r"dropped the torn last line of .*metrics.jsonl \(line 2, 12 bytes"):
        assert read_metrics(path) == [{"kind": "train", "step": 1}]
    path.write_text('{"kind": "train", "step": 1}\n\x00\x00\x00\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a metrics row"):
        read_metrics(path)


def test_disk_full_during_a_save_names_the_file_and_keeps_the_older_checkpoints(uninterrupted, stopped_at_9,
                                                                                tmp_path, monkeypatch):
    cfg, full = uninterrupted
    out = copy_run(stopped_at_9, tmp_path / "run")
    folder = out / "checkpoints"
    full_disk = faulty_open(lambda name, mode: name == "step_00000010.pt.tmp", 100_000, disk_full)
    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(WriteError) as caught:
        _resume(cfg, out)
    monkeypatch.undo()
    assert str(caught.value) == f"could not write {folder / 'step_00000010.pt'}: No space left on device (ENOSPC)"
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000004.pt", "step_00000004.pt.json",
                                                        "step_00000008.pt", "step_00000008.pt.json"]
    assert load_checkpoint(folder / "step_00000008.pt")["step"] == 8
    _resume(cfg, out)  # space freed: resume from step 8 as if nothing happened
    assert _rows(out / "metrics.jsonl") == _rows(full.metrics_path)


KILL_DURING_METRICS_REWRITE = """
import builtins, io, sys
from tests.train.faults import faulty_open, sigkill
from sparseffn.cli import main

# metrics.jsonl written anew (not appended to): SIGKILL after its first 1000 bytes
builtins.open = io.open = faulty_open(lambda name, mode: name.startswith("metrics.jsonl") and "w" in mode, 1000,
                                      sigkill)
sys.exit(main(["train", "--resume", sys.argv[1], "--no-progress"]))
"""


def test_kill_during_the_metrics_rewrite_loses_nothing(uninterrupted, stopped_at_9, tmp_path):
    cfg, full = uninterrupted
    out = copy_run(stopped_at_9, tmp_path / "run")
    before = (out / "metrics.jsonl").read_bytes()
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_METRICS_REWRITE, str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "metrics.jsonl").read_bytes() == before
    (out / "checkpoints" / "step_00000012.pt.tmp").write_bytes(b"left by a process killed mid-save")
    resumed, lines = _resume(cfg, out)
    for orphan in (out / "metrics.jsonl.tmp", out / "checkpoints" / "step_00000012.pt.tmp"):
        assert f"removed {orphan}, left by an interrupted write" in lines and not orphan.exists()
    assert _rows(out / "metrics.jsonl") == _rows(full.metrics_path)


def test_a_live_run_refuses_a_second_process_and_a_dead_ones_lock_is_taken_over(small_corpus, tmp_path):
    """Two processes on one run: the second refuses (resume and overwrite alike) while the first lives;
    after the first is SIGKILLed its lock is taken over and the run continues without duplicate rows."""
    out = tmp_path / "run"
    cfg = tiny_config(small_corpus, out, steps=400, checkpoint_interval=2, eval_interval=0)
    cfg_path = cfg.save(tmp_path / "cfg.json")
    with open(tmp_path / "stderr.txt", "w") as stderr:
        first = subprocess.Popen([sys.executable, "-m", "sparseffn", "train", "--config", str(cfg_path),
                                  "--no-progress"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while not list_checkpoints(out / "checkpoints"):
            assert first.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
        owner = json.loads((out / LOCK_NAME).read_text())
        assert owner["pid"] == first.pid
        for kwargs in (dict(resume=True), dict(overwrite=True)):
            with pytest.raises(RunInUseError, match=rf"^{re.escape(str(out))} is in use by pid {first.pid} on host "):
                train(cfg, progress=False, echo=None, stop_after_step=1, **kwargs)
        assert first.poll() is None, "the first process ended before the second one was refused"
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    assert (out / "metrics.jsonl").is_file()  # overwrite=True deleted nothing of the live run
    last = list_checkpoints(out / "checkpoints")[-1][0]
    resumed, lines = _resume(cfg, out, stop_after_step=last + 2)
    assert any(line.startswith(f"warning: took over the lock of {out} left by pid {first.pid} on host ")
               for line in lines), lines
    keys = [(r["kind"], r["step"]) for r in read_metrics(out / "metrics.jsonl")]
    assert len(keys) == len(set(keys)) and [s for k, s in keys if k == "train"] == list(range(1, resumed.step + 1))
    assert (out / LOCK_NAME).read_text() == ""  # released


def test_run_lock_in_one_process(tmp_path):
    from sparseffn.train.runlock import RunLock

    first, second = RunLock(tmp_path), RunLock(tmp_path)
    assert first.acquire() is None
    with pytest.raises(RunInUseError, match=rf"in use by pid {os.getpid()} on host .* \(since "):
        second.acquire()
    first.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""
    assert second.acquire() is None
    second.release()
    # a file naming an owner but locked by nobody: that owner died holding it
    (tmp_path / LOCK_NAME).write_text('{"pid": 999999, "host": "gone", "started": "2026-01-01 00:00:00"}\n')
    assert first.acquire() == "pid 999999 on host gone (since 2026-01-01 00:00:00)"
    first.release()
