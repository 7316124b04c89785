"""Ops: the public functional API, launchers and the eager fp32 reference."""

from sparseffn.ops.reference import l1_penalty, sparse_mlp_reference
from sparseffn.ops.sparse_mlp import sparse_mlp

__all__ = ["l1_penalty", "sparse_mlp", "sparse_mlp_reference"]
