"""Sparsifying a pretrained dense model: dense pretraining (TrainConfig.dense), the distillation loss and
its frozen teacher, fine-tuning a relufied model (sine λ ramp, distillation, final calibration), and
`sparseffn bench quality --init-from` writing its CSV and plot."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from sparseffn.cli import main
from sparseffn.models import relufied_from, sparse_mlps, sparsity_config
from sparseffn.train.distill import Distiller, distill_kl, frozen_copy
from sparseffn.train.loop import train
from sparseffn.train.metrics import read_metrics
from sparseffn.train.relufy import InitialModel, load_dense, relufy_start
from sparseffn.train.schedule import l1_coeff_at

from .conftest import tiny_config


@pytest.fixture(scope="module")
def dense_run(small_corpus, tmp_path_factory):
    """A dense SiLU tiny model trained 40 steps (TrainConfig.dense), saved with its tokenizer."""
    cfg = tiny_config(small_corpus, tmp_path_factory.mktemp("dense") / "run", steps=40, eval_interval=20,
                      checkpoint_interval=0, log_interval=5, dense=True, l1_coeff=0.0,
                      model_overrides={"num_hidden_layers": 2, "hidden_act": "silu"})
    return cfg, train(cfg, progress=False, echo=None)


def _finetune_config(dense_cfg, out, **changes):
    fields = dict(dense=False, out_dir=str(out), steps=12, lr=1e-3, min_lr=1e-4, warmup_steps=2, eval_interval=6,
                  log_interval=1, l1_coeff=1e-2, l1_warmup_steps=8, l1_schedule="sine")
    return dense_cfg.replace(**{**fields, **changes})


def _training_batches(cfg, tokenizer):
    """The [B, T + 1] batches `train` draws for cfg's steps on one process."""
    from sparseffn.train.data import BatchSampler, read_corpus, split_documents, token_stream

    tokens = token_stream(tokenizer, split_documents(read_corpus(cfg.data), cfg.eval_fraction)[0])
    sampler = BatchSampler(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, 0)
    return [sampler.batch(step) for step in range(cfg.steps)]


@torch.no_grad()
def _objective(model, teacher, batches, temperature):
    was = model.training
    model.eval()
    total = 0.0
    for batch in batches:
        logits = model(input_ids=batch[:, :-1]).logits
        ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        total += float(ce + distill_kl(logits, teacher(input_ids=batch[:, :-1]).logits, temperature))
    model.train(was)
    return total / len(batches)


def test_dense_pretraining_keeps_the_models_own_activation(dense_run):
    _, result = dense_run
    assert not sparse_mlps(result.model) and result.model.config.hidden_act == "silu"
    rows = read_metrics(result.metrics_path)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert all(r["l1_coeff"] == 0 and r["l1"] == 0 and "zeros_pct" not in r for r in train_rows)
    assert train_rows[-1]["ce"] < train_rows[0]["ce"] - 0.5  # it learned
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [20, 40] and "eval_zeros_pct" not in evals[-1]
    assert json.loads((result.out_dir / "run.json").read_text())["dense"] is True
    model, tokenizer = load_dense(result.out_dir)
    assert not sparse_mlps(model) and model.config.hidden_act == "silu"
    assert tokenizer.vocab_size == result.tokenizer.vocab_size


def test_dense_refuses_sparsity_settings(small_corpus, tmp_path):
    with pytest.raises(ValueError, match="--l1-coeff"):
        tiny_config(small_corpus, tmp_path, dense=True)  # the default λ is not 0
    with pytest.raises(ValueError, match="--distill-weight"):
        tiny_config(small_corpus, tmp_path, dense=True, l1_coeff=0.0, distill_weight=1.0)


def test_distill_kl_matches_hand_computed_kl():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, 7, generator=gen, requires_grad=True)
    teacher = torch.randn(2, 3, 7, generator=gen)
    T = 2.0
    p_t = torch.softmax(teacher / T, -1)
    expected = (p_t * (p_t.log() - torch.log_softmax(student / T, -1))).sum(-1).mean() * T * T
    got = distill_kl(student, teacher, T)
    torch.testing.assert_close(got, expected)
    assert float(distill_kl(teacher, teacher, T)) == pytest.approx(0.0, abs=1e-6)
    got.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="differ in shape"):
        distill_kl(student, teacher[..., :5], T)


def test_teacher_is_frozen(dense_run):
    _, result = dense_run
    teacher = frozen_copy(result.model)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(teacher.parameters(), result.model.parameters()))
    with pytest.raises(ValueError, match="frozen"):
        Distiller(result.model, 1.0)


def test_relufied_finetuning_with_distillation_reduces_the_loss_and_leaves_the_teacher(dense_run, tmp_path):
    dense_cfg, result = dense_run
    cfg = _finetune_config(dense_cfg, tmp_path / "ft", distill_weight=1.0, distill_temperature=2.0, steps=20,
                           lr=3e-3, eval_interval=0)
    model, tokenizer = load_dense(result.out_dir)
    student, teacher = relufy_start(model, cfg)
    assert relufied_from(student) == {"hidden_act": "silu"} and sparse_mlps(student)
    assert sparsity_config(student).l1_schedule == "sine"
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    batches = _training_batches(cfg, tokenizer)
    start_loss = _objective(student, teacher, batches, cfg.distill_temperature)
    out = train(cfg, progress=False, echo=None, initial=InitialModel(student, tokenizer, teacher))
    rows = [r for r in read_metrics(out.metrics_path) if r["kind"] == "train"]
    assert len(rows) == 20 and all("distill_kl" in r for r in rows)
    for i, r in enumerate(rows):
        lam = l1_coeff_at(i, 1e-2, 8, "sine")
        assert r["l1_coeff"] == pytest.approx(lam)
        assert r["loss"] == pytest.approx(r["ce"] + lam * r["l1"] + r["distill_kl"], rel=1e-6)
    assert rows[0]["distill_kl"] > 0
    # the objective (CE + KL to the teacher) on the batches it was fine-tuned on went down
    end_loss = _objective(student, teacher, batches, cfg.distill_temperature)
    assert end_loss < start_loss - 0.01, (start_loss, end_loss)
    # the teacher: no gradients, same weights, still frozen
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert out.model is student and out.model_dir is not None
    saved = json.loads((out.model_dir / "config.json").read_text())
    assert saved["sparseffn_layers"]["relufied_from"] == {"hidden_act": "silu"}


def test_distillation_needs_a_teacher_and_a_teacher_needs_a_weight(dense_run, tmp_path):
    dense_cfg, result = dense_run
    model, tokenizer = load_dense(result.out_dir)
    cfg = _finetune_config(dense_cfg, tmp_path / "a", distill_weight=1.0)
    student, teacher = relufy_start(model, cfg)
    with pytest.raises(ValueError, match="needs a teacher"):
        train(cfg, progress=False, echo=None, initial=InitialModel(student, tokenizer, None))
    with pytest.raises(ValueError, match="distill_weight is 0"):
        train(cfg.replace(distill_weight=0.0, out_dir=str(tmp_path / "b")), progress=False, echo=None,
              initial=InitialModel(student, tokenizer, teacher))


def test_final_calibration_sets_thresholds_to_the_target(dense_run, tmp_path):
    dense_cfg, result = dense_run
    cfg = _finetune_config(dense_cfg, tmp_path / "cal", steps=4, eval_interval=0, calibrate_nnz=20.0)
    model, tokenizer = load_dense(result.out_dir)
    student, _ = relufy_start(model, cfg)
    out = train(cfg, progress=False, echo=None, initial=InitialModel(student, tokenizer))
    assert all(m.has_threshold and m.expected_nnz == 20.0 for m in sparse_mlps(student))
    # the final evaluation (held-out, not the calibration batches) runs the calibrated model
    assert out.final_eval.stats.nnz_mean_all == pytest.approx(20.0, rel=0.35)


def test_bench_quality_init_from_writes_csv_and_plot(dense_run, tmp_path, capsys):
    dense_cfg, result = dense_run
    out = tmp_path / "quality"
    common = ["bench", "quality", "--init-from", str(result.out_dir), "--data", dense_cfg.data, "--tokenizer", "byte",
              "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2", "--steps", "6", "--eval-interval", "3",
              "--log-interval", "1", "--warmup-steps", "1", "--l1-warmup-steps", "4", "--out-dir", str(out),
              "--no-progress"]
    assert main(common + ["--l1-coeff", "1e-2"]) == 0
    assert main(common + ["--l1-coeff", "3e-2", "--distill-weight", "0.5", "--name", "strong_kd"]) == 0
    rows = list(csv.DictReader((out / "relufy.csv").open()))
    assert {r["run"] for r in rows} == {"l1_0.01_sine_kd1", "strong_kd"}
    for name in ("l1_0.01_sine_kd1", "strong_kd"):
        mine = [r for r in rows if r["run"] == name]
        assert [(r["stage"], int(r["step"])) for r in mine] == [
            ("dense", 0), ("relufied", 0), ("fine-tuning", 3), ("fine-tuning", 6)]
        dense_ce = float(mine[0]["eval_ce"])
        assert float(mine[0]["dense_ce"]) == dense_ce and float(mine[0]["ce_gap_pct"]) == 0
        assert mine[0]["zeros_pct"] == "" and 0 < float(mine[1]["zeros_pct"]) < 100
        for r in mine[1:]:
            assert float(r["ce_gap_pct"]) == pytest.approx(100 * (float(r["eval_ce"]) / dense_ce - 1), abs=2e-3)
        assert int(mine[-1]["tokens"]) == 6 * 4 * 32
        assert float(mine[-1]["tokens_pct_of_pretraining"]) == pytest.approx(100 * 6 / 40, abs=1e-3)
        assert mine[0]["relufied_from"] == "hidden_act=silu"
    assert (out / "relufy.png").stat().st_size > 10_000
    assert "strong_kd" in capsys.readouterr().out


def test_bench_quality_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "quality"]) == 2
    assert "needs --init-from" in capsys.readouterr().err
    assert main(["bench", "quality", "--init-from", str(tmp_path)]) == 2
    assert "expected a saved model directory" in capsys.readouterr().err


def test_sine_l1_schedule_flag_reaches_the_config(small_corpus, tmp_path):
    from sparseffn.cli import build_parser
    from sparseffn.train.config import TrainConfig, config_from_flags

    args = build_parser().parse_args(["train", "--l1-schedule", "sine", "--distill-weight", "0.5",
                                      "--calibrate-nnz", "12"])
    cfg = config_from_flags(args, TrainConfig())
    assert cfg.sparsity.l1_schedule == "sine" and cfg.distill_weight == 0.5 and cfg.calibrate_nnz == 12
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert math.isclose(TrainConfig().sparsity.l1_coeff, 1.5e-2)


def test_train_dense_from_the_command_line(small_corpus, tmp_path, capsys):
    out = tmp_path / "dense"
    flags = ["train", "--model", "tiny", "--model-override", "num_hidden_layers=1", "--model-override",
             "hidden_act=gelu", "--data", str(small_corpus), "--tokenizer", "byte", "--seq-len", "16",
             "--batch-size", "2", "--steps", "2", "--eval-batches", "1", "--out-dir", str(out), "--no-progress"]
    assert main(flags + ["--dense"]) == 2
    assert "--l1-coeff 0" in capsys.readouterr().err
    assert main(flags + ["--dense", "--l1-coeff", "0"]) == 0
    assert "dense; run in" in capsys.readouterr().out
    assert json.loads((out / "model" / "config.json").read_text())["hidden_act"] == "gelu"
    assert main(["train", "--preset", "relufy", "--config", str(out / "config.json")]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_initial_model_must_have_sparse_mlps(dense_run, tmp_path):
    from tests.models.families import family_lm

    dense_cfg, result = dense_run
    model, tokenizer = load_dense(result.out_dir)
    cfg = _finetune_config(dense_cfg, tmp_path / "a")
    with pytest.raises(ValueError, match="no sparse layers"):
        train(cfg, progress=False, echo=None, initial=InitialModel(model, tokenizer))
    from sparseffn import relufy_

    gpt2 = relufy_(family_lm("gpt2"))
    gpt2.config.vocab_size = 10_000  # past the vocabulary check, to reach the layer check
    with pytest.raises(ValueError, match=r"\['HFSparseMLP'\]"):
        train(cfg.replace(out_dir=str(tmp_path / "b")), progress=False, echo=None, initial=InitialModel(gpt2, tokenizer))
