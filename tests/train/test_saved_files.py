"""Every file a run saves and a command reads back, damaged: `eval`, `generate`, `bench calibrate` and
`train --resume` print one line naming the file and exit 2, and change no file of the run."""

import json
from pathlib import Path

import pytest

from sparseffn.cli import main
from sparseffn.models import load_pretrained
from sparseffn.models.saved_files import SavedFileError, check_safetensors

from .conftest import copy_run
from .test_rundir import checksums


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[9:40] = b"#" * 31  # inside the JSON header
    path.write_bytes(bytes(data))


def _text(path: Path) -> None:
    path.write_text("this is not what the name says\n")


def _json_not_tokenizer(path: Path) -> None:
    path.write_text('{"version": "1.0", "model": 3}\n')


DAMAGES = {
    "model/model.safetensors truncated": ("model/model.safetensors", _truncate, "truncated ("),
    "model/model.safetensors header": ("model/model.safetensors", _corrupt_header, "corrupted safetensors header"),
    "model/model.safetensors text": ("model/model.safetensors", _text, "truncated or corrupted (its header length"),
    "model/config.json truncated": ("model/config.json", _truncate, "not valid JSON"),
    "model/generation_config.json text": ("model/generation_config.json", _text, "not valid JSON"),
    "model/tokenizer.json truncated": ("model/tokenizer.json", _truncate, "not valid JSON"),
    "model/tokenizer.json wrong": ("model/tokenizer.json", _json_not_tokenizer, "not a tokenizer file"),
    "config.json truncated": ("config.json", _truncate, "not valid JSON"),
    "config.json a list": ("config.json", lambda p: p.write_text("[1, 2]\n"), "holds a JSON list, not the object"),
}
ARGS = {
    "eval": ["eval", "{run}", "--device", "cpu"],
    "generate": ["generate", "{run}", "--prompt", "To be", "--max-new-tokens", "2", "--device", "cpu"],
    "bench": ["bench", "calibrate", "{run}", "--targets", "10", "--calibration-windows", "2", "--out-dir", "{tmp}"],
}


def _expect_one_line(capsys, command: str, path: Path, fault: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith(f"sparseffn {command}: error: {path}: ") and err.count("\n") == 1, err
    assert fault in err, err


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_saved_file_is_one_line_naming_it(trained_run, tmp_path, capsys, damage):
    name, spoil, fault = DAMAGES[damage]
    run = copy_run(trained_run.out_dir, tmp_path / "run")
    spoil(run / name)
    before = checksums(run)
    for command, args in ARGS.items():
        argv = [a.format(run=run, tmp=tmp_path / "bench") for a in args]
        assert main(argv) == 2, (damage, command)
        _expect_one_line(capsys, command, run / name, fault)
        assert checksums(run) == before, (damage, command)


@pytest.mark.parametrize("name, spoil, fault", [
    ("config.json", _truncate, "not valid JSON"),
    ("tokenizer.json", _truncate, "not valid JSON"),
    ("tokenizer.json", _json_not_tokenizer, "not a tokenizer file"),
], ids=["config", "tokenizer truncated", "tokenizer wrong"])
def test_resume_of_a_run_with_a_damaged_file_is_one_line_naming_it(trained_run, tmp_path, capsys, name, spoil, fault):
    run = copy_run(trained_run.out_dir, tmp_path / "run")
    spoil(run / name)
    before = checksums(run)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    _expect_one_line(capsys, "train", run / name, fault)
    after = checksums(run)
    assert after.pop("run.lock") == before.pop("run.lock") and after == before


def test_a_sharded_model_checks_its_index_and_every_shard(trained_run, tmp_path, capsys):
    run = copy_run(trained_run.out_dir, tmp_path / "run")
    model = load_pretrained(run / "model")
    (run / "model" / "model.safetensors").unlink()
    model.save_pretrained(run / "model", max_shard_size="300KB")
    shards = sorted(p.name for p in (run / "model").glob("model-*.safetensors"))
    index = "model.safetensors.index.json"
    assert len(shards) >= 2 and (run / "model" / index).is_file()
    assert main(["eval", str(run), "--device", "cpu", "--out-dir", str(tmp_path / "eval")]) == 0  # whole: it loads
    capsys.readouterr()
    damages = [(shards[-1], _truncate, "{path}: truncated ("),
               (shards[0], Path.unlink, f"{{index_path}} lists shard(s) that do not exist: {shards[0]}"),
               (index, _truncate, "{path}: not valid JSON")]
    for i, (name, spoil, fault) in enumerate(damages):
        spoiled = copy_run(run, tmp_path / f"spoiled{i}")
        folder = spoiled / "model"
        spoil(folder / name)
        before = checksums(spoiled)
        assert main(["generate", str(spoiled), "--prompt", "To", "--max-new-tokens", "1", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        want = fault.format(path=folder / name, index_path=folder / index)
        assert err.startswith("sparseffn generate: error: ") and err.count("\n") == 1 and want in err, (err, want)
        assert checksums(spoiled) == before


def test_check_safetensors_names_each_fault(tmp_path):
    from safetensors.torch import save_file
    import torch

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, str(path))
    check_safetensors(path)  # whole
    whole = path.read_bytes()
    path.write_bytes(whole + b"\0")
    with pytest.raises(SavedFileError, match=rf"^{path}: longer than its header describes"):
        check_safetensors(path)
    path.write_bytes(whole[:5])
    with pytest.raises(SavedFileError, match="shorter than the 8-byte header length"):
        check_safetensors(path)
    header_len = int.from_bytes(whole[:8], "little")
    header = json.loads(whole[8:8 + header_len])
    header["a"]["data_offsets"] = [0, 20]  # 2x3 F32 needs 24 bytes
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + whole[8 + header_len:])
    with pytest.raises(SavedFileError, match=r"tensor 'a' has offsets \[0, 20\) for 6 x F32"):
        check_safetensors(path)
