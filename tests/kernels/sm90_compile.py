"""Compile every Triton kernel of sparseffn for the H200 (sm_90a) on a machine without a GPU.

Run as a script in its own process (the interpreter switch of the test session must not be set):
each kernel module exposes `sm90_compile_specs(with_options=True)`, a list of
`(jit_function, signature, constexprs[, options])` covering the specializations the launchers use,
where options are the launch's compile options (num_warps, num_stages). Prints one line per compiled
variant and exits non-zero on the first failure.
"""

import importlib
import inspect
import os
import pkgutil
import sys

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("sm90_compile: unset TRITON_INTERPRET; the interpreter cannot compile for a GPU target")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import sparseffn.kernels

H200 = GPUTarget("cuda", 90, 32)

# kernels that must be among the compiled ones (a module that stops exposing them fails the run)
REQUIRED = {
    "twell_train._twell_train_forward_kernel",
    "twell_train._twell_train_backward_kernel",
    "unit_grads._unit_histogram_kernel", "unit_grads._block_prefix_kernel", "unit_grads._unit_offsets_kernel",
    "unit_grads._unit_scatter_kernel",
    "unit_grads._unit_weight_grads_kernel",
    "convert._convert_kernel",
    "dense_rows_mlp_backward._dense_rows_mlp_backward_dx_kernel",
    "dense_rows_mlp_backward._dense_rows_mlp_backward_dw_kernel",
    "rms_norm._rms_norm_forward_kernel", "rms_norm._rms_norm_backward_kernel", "rope._rope_kernel",
    "row_split._classify_rows_kernel", "twell_up_down._twell_up_down_kernel",
}


def main() -> int:
    compiled = 0
    names = set()
    for info in pkgutil.iter_modules(sparseffn.kernels.__path__):
        module = importlib.import_module(f"sparseffn.kernels.{info.name}")
        specs = getattr(module, "sm90_compile_specs", None)
        if specs is None:
            continue
        takes_options = "with_options" in inspect.signature(specs).parameters
        for fn, signature, constexprs, *options in specs(with_options=True) if takes_options else specs():
            source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            kernel = triton.compile(source, target=H200, options=options[0] if options else None)
            assert "cubin" in kernel.asm, f"{info.name}: no cubin for {constexprs}"
            print(f"{info.name}.{fn.__name__} {constexprs}: ok ({kernel.metadata.num_warps} warps, "
                  f"{kernel.metadata.shared} B shared)")
            compiled += 1
            names.add(f"{info.name}.{fn.__name__}")
    print(f"compiled {compiled} kernel variants for sm_90a")
    missing = REQUIRED - names
    if missing:
        print(f"not compiled: {sorted(missing)}")
    return 0 if compiled and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
