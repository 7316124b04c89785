import os
import subprocess
import sys

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
