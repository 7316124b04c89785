"""GPU only: the sparse kernels under a LoRA-wrapped MLP and per MoE expert, against fp32 truth.

Rule (STYLE): max|out - ref| <= 2 * max|out_dense_same_dtype - ref| + a rounding floor, where ref is the
fp32 dense computation. Skipped without CUDA (the CPU matrix covers the same code in dense mode).
"""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from sparseffn.models.layouts import build_sparse
from sparseffn.nn import SparseExperts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _within(out, dense, ref):
    err, base = (out.float() - ref).abs().max().item(), (dense.float() - ref).abs().max().item()
    assert err <= 2 * base + 1e-2 * ref.abs().max().item(), (err, base)


def _relu_sparse_input(m, d, seed=0):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed)).cuda()


def test_lora_wrapped_mlp_runs_the_sparse_kernels():
    d, h, m = 1024, 2816, 4096
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=d, intermediate_size=h, hidden_act="relu")).cuda()
    with torch.no_grad():
        mlp.gate_proj.weight.sub_(0.02)  # a negative shift: ~10% of the units fire, where the kernels pay
    holder = torch.nn.Module()
    holder.mlp = mlp
    peft = get_peft_model(holder, LoraConfig(r=16, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    ref_model = peft.base_model.model.mlp
    x = _relu_sparse_input(m, d)
    with torch.no_grad():
        ref = ref_model(x)  # PEFT's own fp32 forward: the truth
    sparse = build_sparse(ref_model, "gated", "sparse").bfloat16()
    dense = copy.deepcopy(sparse)
    dense.mode = "dense"
    for module in (sparse, dense):
        module.track_l1 = False
    with torch.no_grad():
        _within(sparse(x.bfloat16()), dense(x.bfloat16()), ref)
    sparse.track_l1 = True  # training kernels: gradients reach the adapters
    sparse(x.bfloat16()).float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in sparse.named_parameters() if "lora" in n)


def test_mixtral_shaped_experts_sparse_vs_dense():
    e, d, h, n, k = 8, 1024, 3584, 4096, 2
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(e, 2 * h, d, generator=gen) * d ** -0.5
    gate_up[:, :h] -= 0.03  # sparse gates
    down = torch.randn(e, d, h, generator=gen) * h ** -0.5
    experts = SparseExperts(torch.nn.Parameter(gate_up.cuda()), torch.nn.Parameter(down.cuda()), mode="dense")
    x = torch.randn(n, d, generator=gen).cuda()
    index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).cuda()
    weights = torch.rand(n, k, generator=gen).softmax(-1).cuda()
    experts.track_l1 = False
    with torch.no_grad():
        ref = experts(x, index, weights)
        low = copy.deepcopy(experts).bfloat16()
        dense = low(x.bfloat16(), index, weights.bfloat16())
        low.mode = "sparse"
        out = low(x.bfloat16(), index, weights.bfloat16())
    _within(out, dense, ref)
    for mode in ("dense", "sparse"):  # timing for the report (printed, not asserted)
        low.mode = mode
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.no_grad():
            for _ in range(3):
                low(x.bfloat16(), index, weights.bfloat16())
            start.record()
            for _ in range(10):
                low(x.bfloat16(), index, weights.bfloat16())
            end.record()
        torch.cuda.synchronize()
        print(f"experts E={e} D={d} H={h} N={n} k={k} mode={mode}: {start.elapsed_time(end) / 10:.3f} ms")
