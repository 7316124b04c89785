"""Programmatic dependent launch: which launches use it, and where the decode gate kernel's PTX
waits (the GPU-side equality of PDL on and off is in tests/models/test_gpu_decode_step.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparseffn.kernels._runtime import pdl_options, use_pdl

SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compile_specs import decode_mlp
for fn, sig, cx, opt in decode_mlp.compile_specs(arch=(9, 0), with_options=True):
    if fn.__name__ == "_decode_gate_up_kernel" and cx["M_PAD"] == 1 and cx["NORM"] and cx["PREFETCH"]:
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                             options=opt).asm["ptx"]
        print("".join("W" if "griddepcontrol.wait" in l else "L" if "griddepcontrol.launch" in l else "."
                      for l in ptx.splitlines() if "griddepcontrol" in l or "ld.global" in l))
        sys.exit(0)
sys.exit("no prefetching gate kernel among the specs")
"""


def test_off_where_no_gpu_runs_the_kernels(monkeypatch):
    assert not use_pdl(torch.device("cpu"))  # the interpreter's tensors
    assert pdl_options(False) == {"PDL": False}  # no launch_pdl option: the interpreter takes none
    assert pdl_options(True) == {"PDL": True, "launch_pdl": True}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
def test_gate_kernel_loads_only_weights_before_the_wait():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join((str(root / "src"), str(root / "tests" / "kernels")))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    order = result.stdout.strip()
    # dependents released first; one wait, with weight loads in flight before it and x's after it
    assert order.startswith("L.") and order.count("W") == 1 and order.endswith("."), order
