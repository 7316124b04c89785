"""Helpers for tests that inspect Triton kernels, compiled or interpreted, and their launchers."""

import inspect


def do_not_specialize(kernel) -> list:
    """Arguments a kernel keeps out of its specialization key (JITFunction or InterpretedFunction)."""
    names = getattr(kernel, "do_not_specialize", None)
    return kernel.kwargs["do_not_specialize"] if names is None else names


def positional_args(fn) -> tuple[str, ...]:
    """Names of fn's positional parameters (through functools wrappers such as lru_cache)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(name for name, p in inspect.signature(fn).parameters.items() if p.kind in positional)
