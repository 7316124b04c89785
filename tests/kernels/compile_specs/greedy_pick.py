"""Compile specs of kernels/greedy_pick.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

from sparseffn.kernels._runtime import cdiv, next_power_of_2
from sparseffn.kernels.greedy_pick import BLOCK_B, BLOCK_V, NUM_WARPS, _greedy_pick_kernel


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for bf16, fp16 and fp32 logits at the 2b model's
    vocabulary (49152: 12 chunks), Llama 3's (128256: 32) and one chunk."""
    specs = []
    for dtype in ("bf16", "fp16", "fp32"):
        for vocab in (49152, 128256, 1000):
            chunks = cdiv(vocab, BLOCK_V)
            signature = {"logits_ptr": f"*{dtype}", "stride_lb": "i32", "part_val_ptr": "*fp32",
                         "part_idx_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*i64", "stride_ob": "i32",
                         "ids_ptr": "*i64", "position_ptr": "*i64", "B": "i32", "V": "i32"}
            constexprs = {"CHUNKS": chunks, "CHUNKS_PAD": next_power_of_2(chunks), "BLOCK_V": BLOCK_V,
                          "BLOCK_B": BLOCK_B}
            signature.update({name: "constexpr" for name in constexprs})
            spec = (_greedy_pick_kernel, signature, constexprs)
            specs.append(spec + ({"num_warps": NUM_WARPS},) if with_options else spec)
    return specs
