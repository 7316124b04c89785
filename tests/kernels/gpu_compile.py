"""Compile every Triton kernel of sparseffn for one GPU target on a machine without a GPU.

    python tests/kernels/gpu_compile.py 90        # sm_90a (H100/H200); 80, 86, 89, 100, 120 likewise

Run in its own process (the interpreter switch of the test session must not be set). For each kernel
module kernels/<op>.py, tests/kernels/compile_specs/<op>.py has `compile_specs(with_options=True[,
arch=(major, minor)])`, a list of `(jit_function, signature, constexprs[, options])` covering the
specializations its launchers use on that GPU generation, where options are the launch's compile
options (num_warps, num_stages). Prints one line per compiled variant; exits non-zero when a variant
fails to compile, takes more shared memory than one program may have on the target, or a kernel of
sparseffn.kernels (`every_kernel`) was not compiled.
"""

import importlib
import inspect
import os
import pkgutil
import sys

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("gpu_compile: unset TRITON_INTERPRET; the interpreter cannot compile for a GPU target")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparseffn.kernels._runtime import COMPILE_TARGETS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script: the specs beside it
import compile_specs  # noqa: E402  (tests/kernels/compile_specs, one module per kernel module)


def every_kernel() -> dict[object, str]:
    """Every kernel of sparseffn (a @triton.jit function named *_kernel defined in a module of
    sparseffn.kernels) -> "module.name": each must be among the compiled ones, so a kernel added
    without a compile spec fails the run."""
    import sparseffn.kernels
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.iter_modules(sparseffn.kernels.__path__):
        module = importlib.import_module(f"sparseffn.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel") and value.__module__ == module.__name__:
                found[value] = f"{info.name}.{name}"
    return found


def specs_for(arch: tuple[int, int]):
    """(module name, spec) for every kernel variant launched on `arch`, duplicates dropped."""
    seen = set()
    for info in pkgutil.iter_modules(compile_specs.__path__):
        make = importlib.import_module(f"compile_specs.{info.name}").compile_specs
        params = inspect.signature(make).parameters
        kwargs = {"with_options": True} if "with_options" in params else {}
        if "arch" in params:
            kwargs["arch"] = arch
        for spec in make(**kwargs):
            key = (info.name, spec[0].__name__, repr(spec[1:]))
            if key not in seen:
                seen.add(key)
                yield info.name, spec


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        sys.exit(f"usage: gpu_compile.py CAPABILITY  (one of {', '.join(f'{a}{b}' for a, b in COMPILE_TARGETS)})")
    arch = divmod(int(argv[0]), 10)
    if arch not in COMPILE_TARGETS:
        sys.exit(f"gpu_compile: {argv[0]} is not a compile target ({sorted(COMPILE_TARGETS)})")
    target = GPUTarget("cuda", arch[0] * 10 + arch[1], 32)
    limit = COMPILE_TARGETS[arch]
    compiled, failed, done = 0, 0, set()
    for name, (fn, signature, constexprs, *options) in specs_for(arch):
        label = f"{name}.{fn.__name__} {constexprs}"
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                    options=options[0] if options else None)
        except Exception as error:  # reported per variant, and the run fails below
            print(f"FAILED {label}: {type(error).__name__}: {str(error)[:2000]}")
            failed += 1
            continue
        if "cubin" not in kernel.asm or kernel.metadata.shared > limit:
            print(f"FAILED {label}: {kernel.metadata.shared} B of shared memory (limit {limit}) or no cubin")
            failed += 1
            continue
        print(f"{label}: ok ({kernel.metadata.num_warps} warps, {kernel.metadata.shared} B shared)")
        compiled += 1
        done.add(fn)
    print(f"compiled {compiled} kernel variants for {target.arch} ({failed} failed)")
    missing = sorted(label for fn, label in every_kernel().items() if fn not in done)
    if missing:
        print(f"not compiled: {missing}")
    return 0 if compiled and not failed and not missing else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
