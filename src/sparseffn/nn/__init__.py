"""Modules over the ops: `SparseMLP`, a drop-in for Hugging Face gated MLPs, and its plain counterpart."""

from sparseffn.nn.sparse_mlp import DenseMLP, SparseMLP

__all__ = ["DenseMLP", "SparseMLP"]
