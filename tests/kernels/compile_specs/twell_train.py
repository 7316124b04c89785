"""Compile specs of kernels/twell_train.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import itertools

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.configs.twell_train import default_backward_config, default_forward_config
from sparseffn.kernels.row_split import split_signature
from sparseffn.kernels.twell_train import _constexprs, _twell_train_backward_kernel, _twell_train_forward_kernel


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for both kernels, bf16 and fp16, gated and
    non-gated, at the default configs of D = 2048 (the paper's shape: H = 5632, tile 256, slots
    32, aligned; also deterministic), D = 100 (unaligned, masked along D) and D = 16384 (D split
    over programs)."""
    specs = []
    shapes = [(2048, 22, 32, True, False), (2048, 22, 32, True, True), (100, 8, 16, False, False),
              (16384, 64, 32, True, False)]
    for (d, n_tiles, slots, aligned, deterministic), ty, gated in itertools.product(
            shapes, TL_DTYPES.values(), (True, False)):
        for kernel, config in ((_twell_train_forward_kernel, default_forward_config(d)),
                               (_twell_train_backward_kernel, default_backward_config(d))):
            constexprs = _constexprs(config, d, n_tiles, slots, gated=gated, aligned=aligned,
                                     deterministic=deterministic)
            split_args, split_constexprs = split_signature(constexprs["SPLIT"])
            if kernel is _twell_train_forward_kernel:
                split_args["l1_partials_ptr"] = "*fp32" if constexprs["SPLIT"] else "constexpr"
                if not constexprs["SPLIT"]:
                    split_constexprs["l1_partials_ptr"] = None
            constexprs.update(split_constexprs)
            sizes = {"M": "i32", "D": "i32", "n_tiles": "i32", "tile": "i32", "slots": "i32", "split_cap": "i32",
                     "max_pieces": "i32"}
            if kernel is _twell_train_forward_kernel:
                signature = {
                    "x_ptr": f"*{ty}", "values_ptr": f"*{ty}", "columns_ptr": "*i16",
                    "counts_ptr": "*i32", "up_ptr": f"*{ty}", "down_ptr": f"*{ty}",
                    "out_ptr": f"*{ty}", "u_ptr": "*fp32", "l1_ptr": "*fp32", **split_args, **sizes,
                    "stride_xm": "i32", "stride_uh": "i32", "stride_dh": "i32", "stride_om": "i32",
                }
            else:
                signature = {
                    "dy_ptr": f"*{ty}", "values_ptr": f"*{ty}", "columns_ptr": "*i16",
                    "counts_ptr": "*i32", "u_ptr": "*fp32", "gate_ptr": f"*{ty}",
                    "up_ptr": f"*{ty}", "down_ptr": f"*{ty}", "l1_grad_ptr": "*fp32",
                    "dx_ptr": f"*{ty}", "du_ptr": "*fp32", "dg_ptr": "*fp32", **split_args, **sizes,
                    "stride_dym": "i32", "stride_gh": "i32", "stride_uh": "i32", "stride_dh": "i32",
                    "stride_dxm": "i32",
                }
            signature.update({k: "constexpr" for k in constexprs})
            options = {"num_warps": config.num_warps}
            if config.max_regs is not None:
                options["maxnreg"] = config.max_regs
            spec = (kernel, signature, constexprs)
            specs.append(spec + (options,) if with_options else spec)
    return specs
