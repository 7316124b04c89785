"""Ops: the public functional API, launchers and the eager fp32 reference."""

from sparseffn.ops.reference import l1_penalty, sparse_mlp_reference
from sparseffn.ops.sparse_mlp import ModeDecision, choose_mode, sparse_mlp
from sparseffn.ops.twell_mlp import SparseMLPWeights

__all__ = ["ModeDecision", "SparseMLPWeights", "choose_mode", "l1_penalty", "sparse_mlp", "sparse_mlp_reference"]
