"""Launching a Triton kernel with less host work than `kernel[grid](...)`.

Why. At a few thousand tokens a sparse MLP step is bound by host work, not GPU work (a training step
makes about 18 Triton launches), and Triton's per-launch path (argument binder, C launcher checking
each tensor, cache key, metadata) costs tens of µs per 20-argument launch on the hosts measured
(docs/kernel-notes.md).

How. `Launcher(kernel)[grid](*args, **meta)` launches exactly what `kernel[grid](*args, **meta)`
would. The first launch of each argument key goes through Triton (which compiles, caches and
checks); the compiled kernel is kept under that key, and later launches with the same key call its
C launcher directly, with raw device pointers. The key refines Triton's specialization, so one key
never stands for two compiled variants:

    tensor             (dtype, device index, data_ptr % 16 == 0)    Triton: pointer type, 16-byte alignment
    int                bits: ==1, %16 == 0, i32 / i64 / u64 range    Triton: constexpr 1, divisibility, type
    bool, float, None  the type (None: constexpr)             Triton: u1, fp32, constexpr None
    TensorDescriptor   (base dtype, block shape, padding)     Triton: tensordesc<dtype[block]>
    meta (constexprs and launch options): their values

(`tests/kernels/test_launch.py` checks the refinement against Triton's own binder.) Arguments of
any other type, tensors off the current device, and launches while a Triton launch hook is set
(profilers) always take Triton's path. Pointers are passed as integers, which skips the launcher's
per-tensor device-access check: a key is kept only when every tensor is on the current CUDA device.
Positional arguments are the kernel's leading parameters; the rest, constexprs only (else the launch
is not kept), come by name in `meta`, whose values must be hashable.

The cache is per Launcher (one per kernel), one entry per argument key: it stays put when only
sizes change (M, a stride) and grows with dtypes, alignments and constexprs, as Triton's does.
A kernel decorated under TRITON_INTERPRET=1 (Triton's interpreter) is always launched through Triton.
"""

from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

_I32 = (-(2**31), 2**31 - 1)
_UNCACHEABLE = object()  # an argument key of a launch that always takes Triton's path


def _int_key(arg: int) -> int:
    """An int's key as one small int: bits ==1, % 16 == 0, i32 range, < 2**63."""
    return (arg == 1) | (arg % 16 == 0) << 1 | (_I32[0] <= arg <= _I32[1]) << 2 | (arg < 2**63) << 3


def _arg_key(arg: object) -> object:
    """What Triton's specialization of `arg` depends on (module docstring), or _UNCACHEABLE."""
    if isinstance(arg, torch.Tensor):  # the device as its index (-1 off CUDA): no torch.device built
        return arg.dtype, arg.get_device(), arg.data_ptr() % 16 == 0
    kind = type(arg)
    if kind is int:
        return _int_key(arg)
    if kind is bool or kind is float or arg is None:
        return kind
    if kind is TensorDescriptor:
        return kind, arg.base.dtype, tuple(arg.block_shape), arg.padding
    return _UNCACHEABLE


_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def _keys_and_raw(args: tuple) -> tuple[list, list]:
    """([_arg_key(a) for a in args], [_raw(a) for a in args]) in one pass, plain tensors (one pointer
    read, no isinstance through torch's metaclass) and ints first: a launch's key is its largest host
    cost."""
    keys, raw = [], []
    for arg in args:
        kind = type(arg)
        if kind in _PLAIN_TENSORS:
            ptr = arg.data_ptr()  # read once for the key and the launch
            keys.append((arg.dtype, arg.get_device(), ptr % 16 == 0))
            raw.append(ptr)
        elif kind is int:
            keys.append(_int_key(arg))
            raw.append(arg)
        else:
            keys.append(_arg_key(arg))
            raw.append(_raw(arg))
    return keys, raw


def _hooked() -> bool:
    """Whether a Triton launch hook is set (a function, or a non-empty HookChain: Triton 3.6's
    default is an empty one)."""
    return any(hook is not None and not (isinstance(hook, HookChain) and not hook.calls)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def _raw(arg: object) -> object:
    """The C launcher's form of an argument: a tensor's device address, anything else as is."""
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


class Launcher:
    """`Launcher(kernel)[grid](*args, **meta)`: `kernel[grid](*args, **meta)` with a lean host path
    for repeated argument keys (module docstring). `cache` maps argument keys to compiled kernels."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        # Triton chose at decoration time (TRITON_INTERPRET then) between a compiled kernel and the
        # interpreter's stand-in, which has no compiled kernels to keep
        self.interpreted = not isinstance(kernel, JITFunction)
        self.cache: dict[tuple, tuple] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        if callable(grid):  # a grid computed from the meta-parameters: Triton's path
            return self.kernel[grid]
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        if self.interpreted or _hooked() or self.kernel.pre_run_hooks:
            self.kernel[grid](*args, **meta)
            return
        device = torch.cuda.current_device()
        keys, raw = _keys_and_raw(args)
        # Triton's debug / instrumentation knobs are part of its cache key too
        key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, *keys, *meta.items())
        entry = self.cache.get(key)
        if entry is None:
            self._first_launch(key, device, grid, args, meta)
            return
        run, function, packed_metadata, trailing = entry
        for (name, _), (value, globals_dict) in self.kernel.used_global_vals.items():
            if globals_dict.get(name, _UNCACHEABLE) != value:  # as Triton checks on every launch
                raise RuntimeError(f"global {name} of {self.kernel.fn.__name__} changed since it was compiled")
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device), function, packed_metadata, None, None, None,
            *raw, *trailing)

    def _first_launch(self, key: tuple, device: int, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        """Triton's launch; the compiled kernel is kept under `key` when later launches may bypass it."""
        compiled = self.kernel[grid](*args, **meta)
        cacheable = (isinstance(compiled, CompiledKernel) and _UNCACHEABLE not in key
                     and all(a.device.type == "cuda" and a.device.index == device
                             for a in args if isinstance(a, torch.Tensor)))
        if not cacheable:
            return
        # the trailing parameters (constexprs, passed by name) in signature order; the C launcher
        # takes every parameter and skips the constexprs
        trailing = []
        for param in self.kernel.params[len(args):]:
            if not param.is_constexpr:  # a runtime argument by name: its value is not in the key
                return
            if param.name in meta:
                trailing.append(meta[param.name])
            elif param.default is not inspect.Parameter.empty:
                trailing.append(param.default)
            else:
                return
        self.cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, tuple(trailing))


def hash_kernel_sources() -> int:
    """Compute Triton's source hash of every `@triton.jit` function of sparseffn.kernels now (it is cached
    on the function). Triton computes it on a kernel's first launch in a process by walking the source of
    the kernel and of everything it calls, ~7 ms a kernel on the H200's host: host work that can run
    before the kernels are needed (nn/warm.py). Returns how many were hashed (0 under the interpreter)."""
    import importlib
    import pkgutil

    import sparseffn.kernels as package

    count = 0
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.__module__ == module.__name__:
                value.cache_key  # noqa: B018 (a property that computes and caches the hash)
                count += 1
    return count

