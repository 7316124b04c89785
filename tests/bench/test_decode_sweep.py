"""bench.decode's config sweep grids: every change is a valid DecodeConfig on its token count's default,
the streamed loops are swept at one token only and compact_up from 3 tokens (the launchers reject them
elsewhere)."""

import dataclasses

import pytest

from sparseffn.bench.decode import _sweep_grids
from sparseffn.kernels.configs.decode_mlp import default_config
from sparseffn.kernels.decode_mlp import m_pad


@pytest.mark.parametrize("m", [1, 2, 16, 64])
def test_sweep_grids_are_valid_configs(m):
    grids = _sweep_grids(m)
    extra = {"one_token"} if m == 1 else ({"compact_up"} if m >= 3 else set())
    assert set(grids) == {"gate", "down"} | extra
    base = default_config(m_pad(m))
    for part, grid in grids.items():
        assert grid, part
        for change in grid:
            config = dataclasses.replace(base, **change)  # runs DecodeConfig's checks
            assert config.stream == (part == "one_token")
            assert config.compact_up == (part == "compact_up")
