"""sparseffn: sparse transformer feed-forward layers (ReLU + L1 sparsity, TwELL packing, Triton kernels)."""

from sparseffn.format import Hybrid, TwELL, UnitMajor
from sparseffn.models import (
    SparsityConfig,
    build_model,
    calibrate_thresholds,
    collect_l1,
    dispatch_report,
    fuse_non_mlp_,
    load_pretrained,
    model_config,
    relufy_,
    sparsify_,
    unfuse_non_mlp_,
    unsparsify_,
)
from sparseffn.models.generate import CapturedDecoder
from sparseffn.nn import SparseMLP
from sparseffn.ops import SparseMLPWeights, choose_mode, l1_penalty, sparse_mlp, sparse_mlp_reference

__version__ = "0.1.0"

__all__ = [
    "CapturedDecoder",
    "Hybrid",
    "SparseMLP",
    "SparseMLPWeights",
    "SparsityConfig",
    "TwELL",
    "UnitMajor",
    "__version__",
    "build_model",
    "calibrate_thresholds",
    "choose_mode",
    "collect_l1",
    "dispatch_report",
    "fuse_non_mlp_",
    "l1_penalty",
    "load_pretrained",
    "model_config",
    "relufy_",
    "sparse_mlp",
    "sparse_mlp_reference",
    "sparsify_",
    "unfuse_non_mlp_",
    "unsparsify_",
]
