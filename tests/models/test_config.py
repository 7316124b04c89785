import dataclasses
import json

import pytest

import sparseffn
from sparseffn import SparsityConfig


def test_defaults_and_round_trip():
    config = SparsityConfig()
    assert (config.l1_coeff, config.l1_warmup_steps, config.activation, config.threshold) == (2e-5, 0, "relu", None)
    assert (config.reinit_dead, config.reinit_dead_after, config.mode, config.expected_nnz) == (False, 200, "auto", None)
    custom = SparsityConfig(l1_coeff=1e-4, l1_warmup_steps=100, threshold=0.1, reinit_dead=True, reinit_dead_after=50,
                            mode="dense", expected_nnz=29)
    data = json.loads(json.dumps(custom.to_dict()))
    assert SparsityConfig.from_dict(data) == custom
    assert SparsityConfig.from_dict({}) == config
    assert sparseffn.SparsityConfig is SparsityConfig


def test_frozen_and_normalized():
    config = SparsityConfig(l1_coeff=0, threshold=1, expected_nnz=29)
    assert isinstance(config.l1_coeff, float) and isinstance(config.threshold, float)
    assert isinstance(config.expected_nnz, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.l1_coeff = 1.0
    assert dataclasses.replace(config, mode="sparse").mode == "sparse"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"l1_coeff": -1.0}, ValueError, "SparsityConfig.l1_coeff must be >= 0"),
        ({"l1_coeff": "2e-5"}, TypeError, "SparsityConfig.l1_coeff must be a number"),
        ({"l1_coeff": float("nan")}, ValueError, "SparsityConfig.l1_coeff must be finite"),
        ({"l1_warmup_steps": -1}, ValueError, "SparsityConfig.l1_warmup_steps must be >= 0"),
        ({"l1_warmup_steps": 1.5}, TypeError, "SparsityConfig.l1_warmup_steps must be an int"),
        ({"activation": "silu"}, ValueError, r"SparsityConfig.activation must be one of \('relu',\), got 'silu'"),
        ({"threshold": -0.1}, ValueError, "SparsityConfig.threshold must be >= 0"),
        ({"reinit_dead": 1}, TypeError, "SparsityConfig.reinit_dead must be a bool"),
        ({"reinit_dead_after": 0}, ValueError, "SparsityConfig.reinit_dead_after must be >= 1"),
        ({"mode": "fast"}, ValueError, "SparsityConfig.mode must be one of"),
        ({"expected_nnz": -3}, ValueError, "SparsityConfig.expected_nnz must be >= 0"),
        ({"expected_nnz": True}, TypeError, "SparsityConfig.expected_nnz must be a number"),
    ],
)
def test_validation_names_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        SparsityConfig(**kwargs)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown SparsityConfig field\(s\) \['l1', 'warmup'\]"):
        SparsityConfig.from_dict({"l1": 1.0, "warmup": 3, "mode": "auto"})
    with pytest.raises(TypeError, match="needs a mapping, got list"):
        SparsityConfig.from_dict([("mode", "auto")])
