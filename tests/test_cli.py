import os
import subprocess
import sys

import pytest

from sparseffn.cli import env_report, main


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
    with pytest.raises(FileNotFoundError, match="no benchmark CSV"):
        main(["bench", "report", "--results-dir", str(tmp_path / "nothing"), "--readme", str(readme)])


def test_bench_e2e_runs_through_the_cli(tmp_path, capsys):
    pytest.importorskip("transformers")
    args = ["bench", "e2e", "--model", "tiny", "--target-nnz", "12", "--batches", "2", "--train-batches", "2",
            "--seq-len", "32", "--vocab-size", "256", "--dtype", "float32", "--warmup", "1", "--reps", "1",
            "--non-mlp", "hf", "--calibration-batch-size", "1", "--out-dir", str(tmp_path), "--git-sha", "e1"]
    assert main(args) == 0
    assert "| forward | hf | 2×32 |" in capsys.readouterr().out
    assert (tmp_path / "cpu" / "e2e.csv").is_file() and (tmp_path / "cpu" / "e2e.png").stat().st_size > 0
