"""Test-session setup shared by every test.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the interpreter
switch must be set before any `sparseffn.kernels` module is imported: on a machine without CUDA the
kernels run on CPU tensors under `TRITON_INTERPRET=1`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
