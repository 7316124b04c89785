"""Marker for harness tests that run the Triton kernels on CPU tensors."""

import os

import pytest

# CPU tensors reach the kernels only under the interpreter (tests/conftest.py sets it without CUDA).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernels on CPU tensors, which needs TRITON_INTERPRET=1")
