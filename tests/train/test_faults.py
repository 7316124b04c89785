"""Faults a training run must survive with nothing lost: damaged checkpoints, a torn metrics line, a full
disk while saving, a kill while metrics.jsonl is rewritten."""

import builtins
import signal
import struct
import subprocess
import sys
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

from .conftest import copy_run
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
