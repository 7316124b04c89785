"""Every Triton kernel compiles for every supported GPU target, checked on a machine without a GPU.

Runs tests/kernels/gpu_compile.py once per target, each in its own process (the test session has
TRITON_INTERPRET set, which turns the kernels into interpreted functions that cannot be compiled
for a GPU), as many at once as the machine has cores. A Hopper-only instruction on a portable path,
or a config whose shared memory exceeds a target's, fails its target here.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sparseffn.kernels._runtime import COMPILE_TARGETS

SCRIPT = Path(__file__).with_name("gpu_compile.py")
TARGETS = [f"{major}{minor}" for major, minor in COMPILE_TARGETS]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="on a GPU the kernels are compiled and run by the other tests")


def _compile(target: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(SCRIPT), target], capture_output=True, text=True, env=env,
                          timeout=3000)


@pytest.fixture(scope="module")
def runs():
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        yield {target: pool.submit(_compile, target) for target in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles_for(target, runs):
    result = runs[target].result()
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert result.returncode == 0, "\n".join(failures)[-6000:] + result.stdout[-2000:] + result.stderr[-3000:]
    assert ": ok" in result.stdout and "(0 failed)" in result.stdout
    for kernel in ("gate_twell._gate_twell_kernel", "twell_up_down._twell_up_down_kernel",
                   "decode_mlp._decode_down_kernel"):
        assert kernel in result.stdout, f"{kernel} was not compiled for {target}"


def test_portable_and_hopper_variants_differ_where_they_must():
    """gate_twell's bf16 compare and TMA are Hopper-only: below 9.0 the specs ask for neither."""
    from tests.kernels.compile_specs.gate_twell import compile_specs

    for arch in COMPILE_TARGETS:
        specs = compile_specs(arch=arch)
        hopper = arch >= (9, 0)
        assert all(s[2]["NATIVE_BF16"] == hopper for s in specs if "NATIVE_BF16" in s[2])
        assert any(s[2].get("USE_TMA") for s in specs) == hopper
