"""Modules over the ops: `SparseMLP`, a drop-in for Hugging Face gated MLPs, and its plain counterpart;
`HFSparseMLP` for other Hugging Face MLP layouts (fused gate_up, non-gated) and `SparseExperts` for
routed MoE experts."""

from sparseffn.nn.hf_mlp import HFSparseMLP, MLPLayout
from sparseffn.nn.moe import SparseExperts
from sparseffn.nn.sparse_mlp import DenseMLP, SparseMLP

__all__ = ["DenseMLP", "HFSparseMLP", "MLPLayout", "SparseExperts", "SparseMLP"]
