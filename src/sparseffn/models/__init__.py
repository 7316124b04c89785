"""Hugging Face integration: sparsify a causal LM in place, named model configs, save/load, calibration.

transformers is imported inside the functions that need it, so importing this package stays light.
"""

from sparseffn.models.calibrate import calibrate_thresholds, measure_activity
from sparseffn.models.config import SparsityConfig
from sparseffn.models.fuse import compile_non_mlp_, fuse_non_mlp_, unfuse_non_mlp_
from sparseffn.models.pretrained import checkpoint_format, load_pretrained
from sparseffn.models.relufy import relufied_from, relufy_
from sparseffn.models.registry import MODEL_NAMES, build_model, model_config, parameter_count
from sparseffn.models.sparsify import (
    collect_l1,
    dispatch_report,
    named_sparse_layers,
    named_sparse_mlps,
    set_sparsity_config_,
    set_track_l1,
    sparse_layers,
    sparse_mlps,
    sparsify_,
    sparsity_config,
    sync_config,
    unsparsify_,
)

__all__ = [
    "MODEL_NAMES",
    "SparsityConfig",
    "build_model",
    "calibrate_thresholds",
    "checkpoint_format",
    "collect_l1",
    "compile_non_mlp_",
    "dispatch_report",
    "fuse_non_mlp_",
    "load_pretrained",
    "measure_activity",
    "model_config",
    "named_sparse_layers",
    "named_sparse_mlps",
    "parameter_count",
    "relufied_from",
    "relufy_",
    "set_sparsity_config_",
    "set_track_l1",
    "sparse_layers",
    "sparse_mlps",
    "sparsify_",
    "sparsity_config",
    "sync_config",
    "unfuse_non_mlp_",
    "unsparsify_",
]
