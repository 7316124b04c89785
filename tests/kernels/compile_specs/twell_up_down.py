"""Compile specs of kernels/twell_up_down.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import dataclasses
import itertools

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.configs.twell_up_down import benchmark_configs, default_config
from sparseffn.kernels.row_split import split_signature
from sparseffn.kernels.twell_up_down import _constexprs, _twell_up_down_kernel


def compile_specs() -> list[tuple[object, dict[str, str], dict[str, object]]]:
    """Specializations to compile for every GPU target (tests/kernels/gpu_compile.py, 4 warps): for bf16
    and fp16, gated and non-gated, the default configs (all M buckets) at the paper's shape (D = 2048,
    H = 5632, tile 256, slots 32, aligned) and the generic paths (D = 100: unaligned and masked along D;
    D = 16384: D split over programs); for bf16 gated every distinct specialization of
    `benchmark_configs(2048)`, and the kernel variants (one chunk per batch without lookahead or
    hints; register double buffering; persistent) for fp16 and for non-gated; the deterministic
    variant of the paper shape's default configs."""
    shapes = [  # (config, D, n_tiles, slots, aligned)
        (default_config(2048), 2048, 22, 32, True),
        (default_config(2048, 1), 2048, 22, 32, True),  # the small-M buckets
        (default_config(2048, 256), 2048, 22, 32, True),
        (default_config(100), 100, 8, 16, False),
        (default_config(16384), 16384, 64, 32, True),
    ]
    base = default_config(2048)
    r = dataclasses.replace
    variants = [
        r(base, block_n=base.block_u, lookahead=False, evict=False),
        r(base, prefetch=True),
        r(base, persistent=5),
    ]
    cases = []  # (dtype, gated, config, D, n_tiles, slots, aligned, deterministic)
    for ty, gated in itertools.product(TL_DTYPES.values(), (True, False)):
        cases += [(ty, gated, *shape, False) for shape in shapes]
        cases += [(ty, gated, *shape, True) for shape in shapes[:3]]
        if (ty, gated) != ("bf16", True):
            cases += [(ty, gated, cfg, 2048, 22, 32, True, False) for cfg in variants]
    cases += [("bf16", True, cfg, 2048, 22, 32, True, False) for cfg in benchmark_configs(2048)[1:]]
    specs, seen = [], set()
    for ty, gated, cfg, d, n_tiles, slots, aligned, deterministic in cases:
        constexprs = _constexprs(cfg, d, n_tiles, slots, gated=gated, aligned=aligned, deterministic=deterministic)
        key = (ty, tuple(constexprs.items()))
        if key in seen:
            continue
        seen.add(key)
        split_args, split_constexprs = split_signature(constexprs["SPLIT"])
        constexprs = {**constexprs, **split_constexprs}
        signature = {
            "x_ptr": f"*{ty}", "values_ptr": f"*{ty}", "columns_ptr": "*i16", "counts_ptr": "*i32",
            "weight_ptr": f"*{ty}", "down_ptr": f"*{ty}", "out_ptr": f"*{ty}", **split_args,
            "M": "i32", "D": "i32", "n_tiles": "i32", "tile": "i32", "slots": "i32",
            "split_cap": "i32", "max_pieces": "i32",
            "stride_xm": "i32", "stride_wh": "i32", "stride_dh": "i32", "stride_om": "i32",
            **{k: "constexpr" for k in constexprs},
        }
        specs.append((_twell_up_down_kernel, signature, constexprs))
    return specs
