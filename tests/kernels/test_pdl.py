"""Programmatic dependent launch (config.pdl): where the decode kernels release the next launch and
wait in their sm_90a PTX, and that it is off where no GPU runs the kernels. (On a GPU,
tests/models/test_gpu_decode_step.py checks the engine's step gives the same bits with it on.)"""

import os
import subprocess
import sys
from pathlib import Path

import dataclasses

import pytest
import torch

from sparseffn.kernels._runtime import pdl_options
from sparseffn.kernels.configs.decode_attention import AttentionConfig, ProjectionConfig
from sparseffn.kernels.configs.decode_mlp import DecodeConfig
from sparseffn.kernels.decode_mlp import decode_mlp

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compile_specs import decode_attention, decode_attn_proj, decode_mlp
for module in (decode_mlp, decode_attn_proj, decode_attention):
    for fn, sig, cx, opt in module.compile_specs(arch=(9, 0), with_options=True):
        if cx.get("PDL") and cx.get("M_PAD", 1) == 1:
            ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                                 options=opt).asm["ptx"]
            order = "".join("W" if "griddepcontrol.wait" in l else "L" if "griddepcontrol.launch" in l else "."
                            for l in ptx.splitlines() if "griddepcontrol" in l or "ld.global" in l)
            early = cx.get("PREFETCH")
            print(fn.__name__, int(bool(early)), order)
"""


def test_off_where_no_gpu_runs_the_kernels():
    assert pdl_options(True, torch.device("cpu")) == {"PDL": False}  # the interpreter's tensors
    assert pdl_options(False, torch.device("cpu")) == {"PDL": False}


def test_configs_take_it_as_a_bool():
    for make in (lambda v: ProjectionConfig(block_n=2, block_k=64, pdl=v), lambda v: AttentionConfig(pdl=v)):
        assert make(True).pdl
        with pytest.raises(TypeError, match="pdl must be a bool"):
            make(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compare PDL on and off on the GPU")
def test_a_pdl_config_launches_where_it_is_off():
    """Under the interpreter pdl is dropped at launch (no launch_pdl option): the same bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    gate, up, down_t = (torch.randn(128, 64, generator=g).div(8).to(torch.bfloat16) for _ in range(3))
    config = DecodeConfig(block_h=16, block_k=64, block_s=16, prefix=128)
    want = decode_mlp(x, gate, up, down_t, config=config)
    assert torch.equal(decode_mlp(x, gate, up, down_t, config=dataclasses.replace(config, pdl=True)), want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
def test_release_first_then_only_weights_before_the_wait():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join((str(root / "src"), str(root / "tests" / "kernels")))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()]
    kernels = {name for name, _, _ in rows}
    assert kernels == {"_decode_gate_up_kernel", "_decode_down_kernel", "_dense_down_kernel",
                       "_decode_qkv_rope_kernel", "_decode_out_proj_kernel", "_decode_attention_kernel"}, kernels
    for name, early, order in rows:
        assert order.startswith("L") and order.count("W") == 1 and order.count("L") == 1, (name, order)
        before = order[1:order.index("W")]
        if early == "1":  # config.prefetch: a projection's first weight tile, attention's positions and older slots
            assert before and set(before) == {"."}, (name, order)
        else:  # nothing read before the wait
            assert before == "", (name, order)
