import argparse
import dataclasses
import json

import pytest

from sparseffn.cli import build_parser
from sparseffn.models import SparsityConfig
from sparseffn.train.config import TrainConfig, add_config_flags, config_from_flags
from sparseffn.train.demo import DEMO_CONFIG


def test_json_round_trip(tmp_path):
    cfg = TrainConfig(model="20m", model_overrides={"num_hidden_layers": 3, "rope_theta": 1e4}, data=None,
                      betas=(0.8, 0.99), steps=7, dtype="bfloat16",
                      sparsity=SparsityConfig(l1_coeff=1e-4, reinit_dead=True, reinit_dead_after=5, threshold=0.25))
    path = cfg.save(tmp_path / "config.json")
    raw = json.loads(path.read_text())
    assert raw["sparsity"]["reinit_dead"] is True and raw["betas"] == [0.8, 0.99] and raw["data"] is None
    back = TrainConfig.load(tmp_path)
    assert back == cfg
    assert isinstance(back.betas, tuple) and isinstance(back.sparsity, SparsityConfig)


def test_unknown_keys_and_bad_values_name_the_field():
    with pytest.raises(ValueError, match="unknown keys.*'nope'"):
        TrainConfig.from_dict({"nope": 1})
    with pytest.raises(ValueError, match="TrainConfig.seq_len"):
        TrainConfig(seq_len=0)
    with pytest.raises(ValueError, match="TrainConfig.min_lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValueError, match="TrainConfig.tokenizer"):
        TrainConfig(tokenizer="wordpiece")
    with pytest.raises(ValueError, match="TrainConfig.eval_fraction"):
        TrainConfig(eval_fraction=1.0)


def test_replace_routes_sparsity_fields():
    cfg = TrainConfig().replace(l1_coeff=3e-3, steps=5, reinit_dead=True)
    assert cfg.steps == 5 and cfg.sparsity.l1_coeff == 3e-3 and cfg.sparsity.reinit_dead


def _train_args(*argv):
    return build_parser().parse_args(["train", *argv])


def test_every_field_has_a_flag():
    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    flags = {opt for action in train._actions for opt in action.option_strings}
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "sparsity"]
    names += [f.name for f in dataclasses.fields(SparsityConfig)]
    for name in names:
        flag = "--model-override" if name == "model_overrides" else "--" + name.replace("_", "-")
        assert flag in flags, flag


def test_flags_map_onto_fields():
    args = _train_args("--seq-len", "64", "--lr", "2e-3", "--l1-coeff", "1e-3", "--reinit-dead", "--betas", "0.8",
                       "0.9", "--model-override", "num_hidden_layers=2", "--model-override", "rope_theta=10000.0",
                       "--data", "none", "--threshold", "0.5", "--no-activation-checkpointing", "--tokenizer", "byte",
                       "--expected-nnz", "12")
    cfg = config_from_flags(args, TrainConfig(data="somewhere"))
    assert cfg.seq_len == 64 and cfg.lr == 2e-3 and cfg.betas == (0.8, 0.9) and cfg.tokenizer == "byte"
    assert cfg.model_overrides == {"num_hidden_layers": 2, "rope_theta": 10000.0}
    assert cfg.data is None and cfg.activation_checkpointing is False
    # untouched flags keep the base's values, the default λ ramp among them
    assert cfg.sparsity == SparsityConfig(l1_coeff=1e-3, l1_warmup_steps=300, reinit_dead=True, threshold=0.5,
                                          expected_nnz=12.0)
    assert cfg.steps == TrainConfig().steps


def test_default_sparsity_is_the_recipe_that_reached_99_percent_zeros():
    # docs/training.md: `20m`, λ = 1.5e-2 ramped over 300 steps, 99.02% zeros at +0.99% held-out CE
    cfg = config_from_flags(_train_args(), TrainConfig())
    assert (cfg.sparsity.l1_coeff, cfg.sparsity.l1_warmup_steps, cfg.sparsity.reinit_dead) == (1.5e-2, 300, False)
    assert TrainConfig.from_dict({k: v for k, v in TrainConfig().to_dict().items() if k != "sparsity"}) == cfg
    assert SparsityConfig().l1_coeff == 2e-5  # sparsify_'s own default is unchanged
    train = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    help_text = " ".join(train.format_help().split())  # argparse wraps lines at the terminal's width
    assert "(default: 0.015)" in help_text and "(default: 300)" in help_text


def test_flags_keep_the_base_defaults_of_the_demo():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, TrainConfig, defaults=DEMO_CONFIG)
    cfg = config_from_flags(parser.parse_args(["--steps", "3"]), DEMO_CONFIG)
    assert cfg == DEMO_CONFIG.replace(steps=3)


def test_bad_flag_values_are_rejected(capsys):
    with pytest.raises(SystemExit):
        _train_args("--tokenizer", "wordpiece")
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _train_args("--model-override", "novalue")
    assert "KEY=VALUE" in capsys.readouterr().err
