"""sparseffn: sparse transformer feed-forward layers (ReLU + L1 sparsity, TwELL packing, Triton kernels)."""

from sparseffn.format import Hybrid, TwELL, UnitMajor
from sparseffn.ops import SparseMLPWeights, choose_mode, l1_penalty, sparse_mlp, sparse_mlp_reference

__version__ = "0.1.0"

__all__ = [
    "Hybrid",
    "SparseMLPWeights",
    "TwELL",
    "UnitMajor",
    "__version__",
    "choose_mode",
    "l1_penalty",
    "sparse_mlp",
    "sparse_mlp_reference",
]
