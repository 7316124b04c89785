"""Helpers for tests that inspect Triton kernels, compiled or interpreted."""


def do_not_specialize(kernel) -> list:
    """Arguments a kernel keeps out of its specialization key (JITFunction or InterpretedFunction)."""
    names = getattr(kernel, "do_not_specialize", None)
    return kernel.kwargs["do_not_specialize"] if names is None else names
