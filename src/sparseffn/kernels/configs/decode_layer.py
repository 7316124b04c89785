"""Launch config of the persistent one-token decode layer (kernels/decode_layer.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import HOPPER, check_config_fields, pdl_by_default
from sparseffn.kernels.configs.decode_attention import AttentionConfig, ProjectionConfig, projection_config
from sparseffn.kernels.configs.decode_mlp import DecodeConfig, default_config


@dataclass(frozen=True)
class LayerConfig:
    """The persistent layer's launch: each phase's one-token config (their num_warps / num_stages are
    not used: the launch has one num_warps), programs_per_sm (None: as many as fit, at most
    max_per_sm), pdl; prefetch: each phase asks L2 for the next one's weights (o_proj's during attention,
    the gate's during o_proj, the next layer's q/k/v during the down pass; Hopper's and Ampere's
    `prefetch.global.L2`)."""

    qkv: ProjectionConfig
    out: ProjectionConfig
    attention: AttentionConfig
    mlp: DecodeConfig
    num_warps: int = 4
    programs_per_sm: int | None = None
    max_per_sm: int = 8
    pdl: bool = False
    prefetch: bool = True

    def __post_init__(self) -> None:
        check_config_fields(self, positive=("num_warps", "max_per_sm"), powers_of_two=("num_warps",),
                            flags=("pdl", "prefetch"))
        per_sm = self.programs_per_sm
        if per_sm is not None and (isinstance(per_sm, bool) or not isinstance(per_sm, int) or per_sm < 1):
            raise ValueError(f"LayerConfig.programs_per_sm must be None or a positive int, got {per_sm!r}")


@functools.lru_cache(maxsize=None)
def layer_config(arch: tuple[int, int] = HOPPER, dense: bool = False) -> LayerConfig:
    """The layer's default: the one-token configs of the launch-by-launch step's kernels (q/k/v and
    o_proj, AttentionConfig(), the engine's norm-fused MLP, dense or sparse), 4 warps, as many programs
    per SM as fit (at most 8); pdl: _runtime.pdl_by_default."""
    return LayerConfig(qkv=projection_config(1, arch, True), out=projection_config(1, arch, False),
                       attention=AttentionConfig(), mlp=default_config(1, arch, dense=dense, norm=True),
                       pdl=pdl_by_default(1))
