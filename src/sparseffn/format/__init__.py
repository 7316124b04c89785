"""Typed packed formats for sparse MLP activations: exact, validated, CPU and CUDA."""

from sparseffn.format.hybrid import Hybrid, UnitMajor
from sparseffn.format.twell import TwELL

__all__ = ["Hybrid", "TwELL", "UnitMajor"]
