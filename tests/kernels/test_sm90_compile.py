"""Every Triton kernel compiles for the H200 (sm_90a), checked on a machine without a GPU.

Runs tests/kernels/sm90_compile.py in its own process: the test session has TRITON_INTERPRET set,
which would turn the kernels into interpreted functions that cannot be compiled for a GPU target.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch
import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels are compiled and run by the other tests")
def test_every_kernel_compiles_for_sm90a():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compiled" in result.stdout and ": ok" in result.stdout
    for kernel in ("gate_twell._gate_twell_kernel", "twell_up_down._twell_up_down_kernel"):
        assert kernel in result.stdout, f"{kernel} was not compiled"
