"""`TrainConfig.init_from` / `sparseffn train --init-from`: runs that start from a saved model (a reference
`*_sparse_relu` checkpoint or a sparseffn save), resume exactly, and refuse what they cannot start from."""

import json

import pytest
import torch

from sparseffn.models import SparsityConfig, load_pretrained, sparse_mlps
from sparseffn.models.reference_fixture import FixtureSpec, write_fixture
from sparseffn.train.checkpoint import list_checkpoints
from sparseffn.train.eval import load_for_eval, resolve_target
from sparseffn.train.loop import train
from sparseffn.train.metrics import read_metrics

from .conftest import tiny_config

TIMING = {"tokens_per_s", "elapsed_s"}


def _rows(path):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(path)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("ref") / "ck", FixtureSpec(gated=False, new_intermediate_size=96,
                                                                             dtype="float32"))


def _config(corpus, out, init_from, **changes):
    settings = dict(init_from=str(init_from), model_overrides={}, steps=6, checkpoint_interval=2, eval_interval=3)
    return tiny_config(corpus, out, **{**settings, **changes})


def test_a_run_starts_from_the_checkpoint_and_resumes_exactly(small_corpus, reference, tmp_path):
    cfg = _config(small_corpus, tmp_path / "full", reference,
                  sparsity=SparsityConfig(l1_coeff=1e-3, l1_warmup_steps=2, reinit_dead=True, reinit_dead_after=2))
    full = train(cfg, progress=False, echo=None)
    run_tokenizer = json.loads((tmp_path / "full" / "tokenizer.json").read_text())
    assert full.completed and run_tokenizer == json.loads((reference / "tokenizer.json").read_text())
    saved = json.loads((tmp_path / "full" / "model" / "config.json").read_text())
    assert saved["sparseffn"]["l1_coeff"] == 1e-3 and saved["sparseffn"]["reinit_dead"] is True
    assert saved["sparseffn_layers"]["sparse_mlp"] == {"gated": False, "bias": False}
    mlps = sparse_mlps(full.model)
    assert [m.intermediate_size for m in mlps] == [96, 96] and all(m.gate_proj is None for m in mlps)

    part = cfg.replace(out_dir=str(tmp_path / "part"))
    stopped = train(part, progress=False, echo=None, stop_after_step=5)
    assert not stopped.completed and [s for s, _ in list_checkpoints(tmp_path / "part" / "checkpoints")] == [2, 4]
    resumed = train(part, resume=True, progress=False, echo=None)
    assert _rows(resumed.metrics_path) == _rows(full.metrics_path)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the .pt checkpoints of such a run load for eval (the model is rebuilt from init_from)
    model, tokenizer, run_cfg = load_for_eval(resolve_target(list_checkpoints(tmp_path / "part" / "checkpoints")[-1][1]),
                                              torch.device("cpu"))
    assert run_cfg.init_from == str(reference)
    assert all(torch.equal(b[k], v) for k, v in model.state_dict().items())


def test_lr_zero_keeps_the_checkpoint_weights(small_corpus, reference, tmp_path):
    cfg = _config(small_corpus, tmp_path / "run", reference, steps=2, lr=0.0, min_lr=0.0, eval_interval=0,
                  checkpoint_interval=0)
    result = train(cfg, progress=False, echo=None)
    original = load_pretrained(reference, dtype=torch.float32)
    want, got = original.state_dict(), result.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # a sparseffn save (the run's model/) is a starting point too
    again = train(_config(small_corpus, tmp_path / "again", tmp_path / "run" / "model", steps=2, eval_interval=0,
                          checkpoint_interval=0), progress=False, echo=None)
    assert again.completed and len(sparse_mlps(again.model)) == 2


def test_init_from_refusals_leave_no_run(small_corpus, reference, tmp_path):
    from sparseffn.models.registry import build_model

    dense = tmp_path / "dense"
    build_model("tiny", None, num_hidden_layers=1, vocab_size=300).save_pretrained(dense)
    with pytest.raises(FileNotFoundError, match="expected a saved model directory"):  # no tokenizer.json
        train(_config(small_corpus, tmp_path / "a", dense), progress=False, echo=None)
    assert not (tmp_path / "a").exists()

    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for f in reference.iterdir():
        if f.name != "tokenizer.json":
            (no_tok / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        train(_config(small_corpus, tmp_path / "b", no_tok), progress=False, echo=None)
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="model_overrides .* cannot reshape the init_from model"):
        tiny_config(small_corpus, tmp_path / "c", init_from=str(reference))
    with pytest.raises(FileNotFoundError, match="is not a directory with a config.json"):
        train(_config(small_corpus, tmp_path / "d", tmp_path / "missing"), progress=False, echo=None)


def test_a_dense_model_is_relufied_and_distilled_from_its_frozen_original(small_corpus, reference, tmp_path):
    from sparseffn.models import relufied_from
    from sparseffn.models.registry import build_model

    dense = tmp_path / "dense"
    original = build_model("tiny", None, num_hidden_layers=2, vocab_size=300, hidden_act="silu", seed=3)
    original.save_pretrained(dense)
    (dense / "tokenizer.json").write_text((reference / "tokenizer.json").read_text())
    cfg = _config(small_corpus, tmp_path / "run", dense, distill_weight=1.0, distill_temperature=2.0,
                  sparsity=SparsityConfig(l1_coeff=1e-3, l1_warmup_steps=2, l1_schedule="sine"))
    full = train(cfg, progress=False, echo=None)
    assert full.completed and len(sparse_mlps(full.model)) == 2
    saved = load_pretrained(tmp_path / "run" / "model")
    assert relufied_from(saved) and saved.config.sparseffn["l1_schedule"] == "sine"
    kl = [r["distill_kl"] for r in read_metrics(full.metrics_path) if r.get("kind") == "train"]
    assert kl and all(v >= 0 for v in kl) and kl[-1] > 0  # the teacher is the dense original, not the student
    # the dense original on disk is untouched, and a stopped run resumes to the same weights
    reloaded = type(original).from_pretrained(dense)
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in original.state_dict().items())
    part = cfg.replace(out_dir=str(tmp_path / "part"))
    train(part, progress=False, echo=None, stop_after_step=5)
    resumed = train(part, resume=True, progress=False, echo=None)
    assert _rows(resumed.metrics_path) == _rows(full.metrics_path)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
