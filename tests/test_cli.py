import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparseffn.cli import env_report, main


def _one_line_error(capsys, command: str) -> str:
    """The error line a user error printed (nothing else on stderr, no traceback)."""
    err = capsys.readouterr().err
    assert err.startswith(f"sparseffn {command}: error: ") and err.count("\n") == 1, err
    assert err.rstrip().endswith(f"(sparseffn --debug {command} ... shows the traceback)")
    return err


def test_env_reports_versions_gpu_and_triton_mode():
    lines = env_report()
    text = "\n".join(lines)
    for key in ("python", "torch", "triton", "transformers", "gpu", "triton mode"):
        assert any(line.startswith(key) for line in lines), key
    import torch

    if not torch.cuda.is_available():
        assert "no GPU" in text
        assert ("interpreted" in text) == (os.environ.get("TRITON_INTERPRET") == "1")


def test_pack_demo_runs_and_verifies(capsys):
    assert main(["pack-demo", "--tokens", "300", "--d-model", "64", "--hidden", "512", "--mean-nnz", "12"]) == 0
    out = capsys.readouterr().out
    assert "round trip bit-exact  True" in out
    assert "overflow rows" in out
    assert "OK: the sparse MLP equals the dense one" in out


def test_console_entry_point_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "sparseffn", "env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "triton mode" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "sparseffn", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "sparseffn", "train", "--resume", "no/such/run"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert missing.stderr.startswith("sparseffn train: error: no training config at no/such/run (")


def test_bench_mlp_train_then_report_regenerates_the_readme_table(tmp_path, capsys):
    args = ["bench", "mlp", "--train", "--shapes", "64x256", "--tokens", "19", "--nnz", "6",
            "--providers", "dense,sparse", "--tile", "64", "--slots", "8", "--out-dir", str(tmp_path), "--git-sha", "t1"]
    assert main(args) == 0
    assert "| 64×256 | " in capsys.readouterr().out
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- bench:train -->\nold\n<!-- /bench:train -->\n")
    assert main(["bench", "report", "--results-dir", str(tmp_path / "cpu"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and "git t1" in text and "| 64×256 | 6." in text
    assert main(["bench", "report", "--results-dir", str(tmp_path / "nothing"), "--readme", str(readme)]) == 2
    assert "no benchmark CSV" in _one_line_error(capsys, "bench")


def test_bench_e2e_runs_through_the_cli(tmp_path, capsys):
    pytest.importorskip("transformers")
    args = ["bench", "e2e", "--model", "tiny", "--target-nnz", "12", "--batches", "2", "--train-batches", "2",
            "--seq-len", "32", "--vocab-size", "256", "--dtype", "float32", "--warmup", "1", "--reps", "1",
            "--non-mlp", "hf", "--calibration-batch-size", "1", "--out-dir", str(tmp_path), "--git-sha", "e1"]
    assert main(args) == 0
    assert "| forward | hf | 2×32 |" in capsys.readouterr().out
    assert (tmp_path / "cpu" / "e2e.csv").is_file() and (tmp_path / "cpu" / "e2e.png").stat().st_size > 0


def test_train_user_errors_print_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    from sparseffn.train.config import TrainConfig
    from sparseffn.train.runlock import RunLock

    run = tmp_path / "run"  # a run that was started but never reached a checkpoint
    TrainConfig(out_dir=str(run)).save(run / "config.json")
    configs = {"syntax": "{steps: 3}", "unknown": '{"stepz": 3}', "value": '{"steps": 0}'}
    for name, text in configs.items():
        (tmp_path / f"{name}.json").write_text(text)
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # root ignores directory permissions, so the OS's refusal is simulated
        if readonly in self.parents:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    cases = [
        (["--resume", str(run)], f"cannot resume: no checkpoint under {run / 'checkpoints'}"),
        (["--resume", str(tmp_path / "missing")], f"no training config at {tmp_path / 'missing'} ("),
        (["--resume", str(run), "--config", str(tmp_path / "value.json")], "--config and --resume exclude each other"),
        (["--config", str(tmp_path / "syntax.json")], f"{tmp_path / 'syntax.json'}: not valid JSON (Expecting property name"),
        (["--config", str(tmp_path / "unknown.json")], f"{tmp_path / 'unknown.json'}: TrainConfig: unknown keys"),
        (["--config", str(tmp_path / "value.json")], "TrainConfig.steps must be a positive int, got 0"),
        (["--out-dir", str(readonly / "run")], f"[Errno 13] Permission denied: '{readonly / 'run'}'"),
    ]
    for flags, message in cases:
        assert main(["train", *flags, "--no-progress"]) == 2, flags
        assert message in _one_line_error(capsys, "train"), flags
    lock = RunLock(run)
    lock.acquire()
    try:
        assert main(["train", "--resume", str(run), "--no-progress"]) == 2
        assert f"{run} is in use by pid {os.getpid()} on host " in _one_line_error(capsys, "train")
    finally:
        lock.release()


def test_debug_shows_user_errors_and_internal_errors_keep_their_traceback(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no training config"):
        main(["--debug", "train", "--resume", str(tmp_path / "missing")])

    def broken(*args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr("sparseffn.train.loop.train", broken)
    with pytest.raises(RuntimeError, match="an internal bug"):
        main(["train", "--out-dir", str(tmp_path / "run"), "--no-progress"])


def test_reference_checkpoint_through_the_cli(tmp_path, capsys):
    """`fixture` writes a *_sparse_relu checkpoint; generate, eval, bench e2e and export take its directory;
    without a tokenizer, text commands say so in one line."""
    import json

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["fixture", str(ckpt), "--no-gated", "--new-intermediate-size", "96", "--shard-mb", "0.05"]) == 0
    assert "llama_sparse_relu checkpoint (non-gated, H=96" in capsys.readouterr().out
    assert main(["generate", str(ckpt), "--prompt", "To be", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    assert main(["eval", str(ckpt), "--seq-len", "16", "--batches", "1", "--batch-size", "2", "--device", "cpu",
                 "--out-dir", str(tmp_path / "eval")]) == 0
    assert "| all | 192 |" in capsys.readouterr().out and (tmp_path / "eval" / "eval.json").is_file()
    assert main(["bench", "e2e", "--model", str(ckpt), "--batches", "1", "--train-batches", "1", "--seq-len", "32",
                 "--reps", "1", "--warmup", "0", "--non-mlp", "hf", "--out-dir", str(tmp_path / "bench")]) == 0
    assert "forward | hf | 1×32" in capsys.readouterr().out
    assert main(["export", str(ckpt), str(out)]) == 0
    assert "with its tokenizer files (tokenizer.json" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text()) == json.loads((ckpt / "config.json").read_text())
    assert main(["fixture", str(ckpt)]) == 2
    assert "already holds a config.json" in _one_line_error(capsys, "fixture")
    (out / "tokenizer.json").unlink()
    assert main(["generate", str(out), "--prompt", "x", "--device", "cpu"]) == 2
    assert "without a tokenizer.json" in _one_line_error(capsys, "generate")


def test_eval_and_generate_errors_name_the_flag_or_path_typed(tmp_path, capsys):
    """Checked before anything loads: each error names what the user typed, not an internal argument."""
    import torch

    missing = tmp_path / "no" / "run"
    gen = ["generate", str(missing), "--prompt", "To be"]
    cases = [
        (gen, "generate", f"{missing} does not exist"),
        (["eval", str(missing)], "eval", f"{missing} does not exist"),
        (["bench", "calibrate", str(missing)], "bench", f"{missing} does not exist"),
        ([*gen, "--max-new-tokens", "-3"], "generate", "--max-new-tokens must be >= 1, got -3"),
        ([*gen, "--max-new-tokens", "0"], "generate", "--max-new-tokens must be >= 1, got 0"),
        ([*gen, "--temperature", "1", "--top-k", "-1"], "generate", "--top-k must be >= 0 (0: all tokens), got -1"),
        ([*gen, "--temperature", "1", "--top-p", "0"], "generate", "--top-p must be in (0, 1] (1: all tokens), got 0.0"),
        (["generate", str(missing), "--prompt", ""], "generate", "--prompt is empty"),
        ([*gen, "--engine", "fused", "--compile"], "generate", "--engine fused replaces the forward that --compile"),
        (["eval", str(missing), "--seq-len", "0"], "eval", "--seq-len must be >= 1, got 0"),
        (["eval", str(missing), "--batches", "-1"], "eval", "--batches must be >= 1, got -1"),
        (["eval", str(missing), "--eval-fraction", "1.5"], "eval", "--eval-fraction must lie in (0, 1), got 1.5"),
    ]
    if not torch.cuda.is_available():
        cases.append(([*gen, "--device", "cuda"], "generate", "--device cuda: torch sees no CUDA device"))
    for argv, command, message in cases:
        assert main(argv) == 2, argv
        assert message in _one_line_error(capsys, command), argv
    assert not missing.parent.exists()


def test_bench_train_run_flags_and_errors(capsys):
    """Optional fields get flags (`--l1-coeff` not given: the size's paper-regime λ; `none` spelled out),
    and a size without a default λ is a one-line error, exit 2."""
    from sparseffn.cli import build_parser, main

    parser = build_parser()
    args = parser.parse_args(["bench", "train-run", "--l1-coeff", "3e-4", "--no-fuse-non-mlp", "--no-processes"])
    assert (args.l1_coeff, args.fuse_non_mlp, args.processes) == (3e-4, False, False)
    args = parser.parse_args(["bench", "train-run", "--l1-coeff", "none"])
    assert (args.l1_coeff, args.fuse_non_mlp, args.model) == (None, None, "0.5b")
    assert main(["bench", "train-run", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--l1-coeff: no paper-regime λ is set for --model 'tiny'" in err[0]
