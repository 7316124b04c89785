"""Compile specs of kernels/unit_grads.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import itertools

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.configs.unit_grads import default_unit_grads_config
from sparseffn.kernels.unit_grads import (_ORDER_STEP, _ORDER_UNITS, _PREFIX_BLOCKS, _PREFIX_UNITS, _SLOT_WARPS,
                                          _block_prefix_kernel, _slot_blocks, _unit_grads_constexprs,
                                          _unit_grads_options, _unit_histogram_kernel, _unit_offsets_kernel,
                                          _unit_scatter_kernel, _unit_spill_grads_kernel,
                                          _unit_weight_grads_kernel, _search_steps)


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for the slot histogram, the block prefix,
    the unit offsets / order and both scatters (int32 and int64 indices; tile 256 / slots 32 and
    tile 64 / slots 4 blocks; without coefficients, with the non-gated and with the gated ones:
    bf16 values with int32 indices, fp16 with int64), and the weight-gradient kernel for bf16 /
    fp16, gated / non-gated, int32 / int64 entries, D = 2048 (aligned, one shared int32 row offset,
    the default config: 8 entries per step, BLOCK_D 1024, 4 warps) and D = 100 (unaligned, masked
    along D, separate int64 row offsets), with the launcher's options."""
    specs = []

    def add(fn, signature, constexprs, options):
        signature.update({k: "constexpr" for k in constexprs})
        spec = (fn, signature, constexprs)
        specs.append(spec + (options,) if with_options else spec)

    for ty, (n_tiles, slots) in itertools.product(("i32", "i64"), ((22, 32), (5, 4))):
        block_t, block_s = _slot_blocks(n_tiles, slots)
        common = {"columns_ptr": "*i16", "counts_ptr": "*i32"}
        sizes = {"M": "i32", "H": "i32", "n_tiles": "i32", "tile": "i32", "slots": "i32"}
        if (n_tiles, slots) == (22, 32):  # the scans over units do not depend on the slot blocks
            add(_block_prefix_kernel, {"hist_ptr": f"*{ty}", "n_blocks": "i32", "H": "i32"},
                {"BLOCK_B": _PREFIX_BLOCKS, "BLOCK_H": _PREFIX_UNITS}, {"num_warps": 4})
            add(_unit_offsets_kernel,
                {"counts_ptr": f"*{ty}", "offsets_ptr": f"*{ty}", "order_ptr": "*i32", "H": "i32"},
                {"BLOCK_J": _ORDER_UNITS, "BLOCK_K": _ORDER_STEP}, {"num_warps": 4})
        add(_unit_histogram_kernel,
            {**common, "hist_ptr": f"*{ty}", **sizes, "rows_per_block": "i32"},
            {"BLOCK_T": block_t, "BLOCK_S": block_s}, {"num_warps": _SLOT_WARPS})
        values = "*bf16" if ty == "i32" else "*fp16"
        for serial, coefficients in itertools.product((False, True), (0, 1, 2)):
            moved = {"values_ptr": values if coefficients else f"*{ty}"}
            moved.update({name: "*fp32" if coefficients else f"*{ty}" for name in (
                "u_ptr", "du_ptr", "dg_ptr", "dg_out_ptr", "h_out_ptr", "du_out_ptr")})
            add(_unit_scatter_kernel,
                {**common, "offsets_ptr": f"*{ty}", "cursor_ptr": f"*{ty}", "entries_ptr": f"*{ty}", **moved,
                 **sizes, "rows_per_program": "i32"},
                {"SERIAL": serial, "COEFFICIENTS": coefficients, "BLOCK_T": block_t, "BLOCK_S": block_s},
                {"num_warps": _SLOT_WARPS})
    for ty, gated, (d, aligned), index in itertools.product(
            TL_DTYPES.values(), (True, False), ((2048, True), (100, False)), ("i32", "i64")):
        inputs = {
            "x_ptr": f"*{ty}", "dy_ptr": f"*{ty}", "dg_ptr": "*fp32", "h_ptr": "*fp32",
            "du_ptr": "*fp32", "offsets_ptr": f"*{index}",
            "entries_ptr": f"*{index}", "order_ptr": "*i32",
        }
        outputs = {"grad_gate_ptr": "*fp32", "grad_up_ptr": "*fp32", "grad_down_ptr": "*fp32"}
        strides = {"stride_xm": "i32", "stride_dym": "i32", "stride_gg": "i32", "stride_gu": "i32", "stride_gd": "i32"}
        config = default_unit_grads_config(d)
        constexprs = _unit_grads_constexprs(config, d, gated=gated, aligned=aligned, shared_rows=aligned)
        add(_unit_weight_grads_kernel,
            {**inputs, **outputs, "D": "i32", "H": "i32", "n_groups": "i32", "cap": "i32", **strides},
            dict(constexprs), _unit_grads_options(config))
        add(_unit_spill_grads_kernel,
            {**inputs, "chunk_end_ptr": "*i64", **outputs, "D": "i32", "H": "i32", "cap": "i32", "n_programs": "i32",
             **strides},
            {**{k: v for k, v in constexprs.items() if k != "UNITS"}, "CHUNK": config.cap_entries,
             "SEARCH_STEPS": _search_steps(5632)}, _unit_grads_options(config))
    return specs
