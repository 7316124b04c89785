"""CPU runs of the training-step, end-to-end and quality harnesses (numbers meaningless on CPU; the
tests check that the harnesses run end to end, check correctness first and write well-formed files)."""

import json

import pytest
import torch

from sparseffn.bench.mlp_train import CSV_FIELDS as TRAIN_FIELDS
from sparseffn.bench.mlp_train import GRAPH_PROVIDERS as TRAIN_GRAPH_PROVIDERS
from sparseffn.bench.mlp_train import TRAIN_PROVIDERS, TrainBenchConfig, run_train_bench
from sparseffn.bench.report import e2e_table, plot_train, read_rows, train_table
from tests.bench.interpreted import interpreted


@interpreted
def test_train_bench_checks_gradients_and_writes_csv(tmp_path):
    cfg = TrainBenchConfig(shapes="64x256", tokens="19", nnz="6,100", providers="dense,sparse", tile=64, slots=8,
                           out_dir=str(tmp_path), git_sha="abc")
    rows = run_train_bench(cfg, torch.device("cpu"), log=lambda _: None)
    assert len(rows) == 4
    written = read_rows(tmp_path / "cpu" / "mlp_train.csv")
    assert tuple(written[0]) == TRAIN_FIELDS and len(written) == 4
    for row in written:
        assert row["within_bound"] == "True", row  # every provider's gradients checked against fp32 autograd
        assert float(row["grad_rel_err"]) < 0.05 and float(row["median_ms"]) > 0
    assert int(written[-1]["overflow_rows"]) > 0  # the dense case goes through the dense-rows backward
    assert train_table(written).count("| 64×256 |") == 2
    assert "| graphed sparse | graph / graph |" in train_table(written)  # "–" without the graph providers
    assert "git abc." in train_table(written) and "| git |" not in train_table(written)
    # rows of two runs (e.g. a rerun of one density): each row names its commit
    mixed = train_table([dict(r, git_sha="def") if r["target_nnz"] == written[-1]["target_nnz"] else r
                         for r in written])
    assert "git abc, def (each row: last column)" in mixed and "| git |" in mixed
    assert mixed.count(" abc |") == 1 and mixed.count(" def |") == 1
    pytest.importorskip("matplotlib")
    assert plot_train(written, tmp_path / "train.png").stat().st_size > 0


def test_train_bench_graph_providers_need_cuda(tmp_path):
    cfg = TrainBenchConfig(shapes="64x256", tokens="19", nnz="6", providers="dense,sparse_graph", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="sparse_graph.*need a CUDA device"):
        run_train_bench(cfg, torch.device("cpu"), log=lambda _: None)
    # each graphed provider replays one of the step's eager providers (the default list on CUDA takes
    # them all); inference's auto_graph is not one of them
    assert all(p.removesuffix("_graph") in TRAIN_PROVIDERS for p in TRAIN_GRAPH_PROVIDERS)
    with pytest.raises(ValueError, match="unknown \\['auto_graph'\\]"):
        run_train_bench(TrainBenchConfig(providers="dense,auto_graph"), torch.device("cpu"), log=lambda _: None)


def test_e2e_bench_runs_at_tiny_size_and_calibrates(tmp_path):
    pytest.importorskip("transformers")
    from sparseffn.bench.e2e import CSV_FIELDS, E2EBenchConfig, run_e2e_bench

    cfg = E2EBenchConfig(model="tiny", target_nnz=12, batches="2", train_batches="2", seq_len=32, vocab_size=256,
                         dtype="float32", warmup=1, reps=1, out_dir=str(tmp_path), git_sha="abc",
                         calibration_batch_size=1)
    rows = run_e2e_bench(cfg, torch.device("cpu"), log=lambda _: None)
    written = read_rows(tmp_path / "cpu" / "e2e.csv")
    assert tuple(written[0]) == CSV_FIELDS and len(written) == len(rows) == 8
    assert {(r["non_mlp"], r["phase"], r["provider"]) for r in written} == {
        (v, p, q) for v in ("hf", "fused") for p in ("forward", "train") for q in ("dense", "sparse")}
    forward = [r for r in written if r["phase"] == "forward"]
    for r in forward:
        assert abs(float(r["mlp_nnz"]) - 12) <= 1.2  # calibrated on the measured sequences: within 10%
        # > 0 only: with one CPU rep each, the MLPs timed alone can take longer than the whole forward
        # (a CI run measured a share of 1.91), so a bound would test the machine's noise
        assert float(r["tokens_per_ms"]) > 0 and float(r["mlp_share"]) > 0
    for r in forward[1::2]:
        assert float(r["logits_rel_err"]) < 1e-5  # CPU: both providers run the same dense path
    table = e2e_table(written)
    assert "| forward | hf | 2×32 |" in table and "| train | fused | 2×32 |" in table
    with pytest.raises(ValueError, match="non_mlp must be"):
        run_e2e_bench(E2EBenchConfig(model="tiny", non_mlp="hf,compiled", out_dir=str(tmp_path)),
                      torch.device("cpu"), log=lambda _: None)


def test_quality_summary_reads_runs(tmp_path):
    from sparseffn.bench.quality import plot_quality, quality_table, summarize_runs

    for name, lam, ce, nnz, steps in (("l1_0.0", 0.0, 3.0, 100.0, 10), ("l1_0.001", 1e-3, 3.06, 5.0, 10),
                                      ("long_l1_0.001", 1e-3, 2.5, 4.0, 20)):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"model": "tiny", "batch_size": 2, "seq_len": 8,
                                                     "sparsity": {"l1_coeff": lam, "reinit_dead": False}}))
        rows = [{"kind": "train", "step": steps, "dead_frac_all": 0.25, "dead_frac": [0.25]},
                {"kind": "eval", "step": steps, "eval_ce": ce, "eval_hidden": [200], "eval_nnz_mean_all": nnz,
                 "eval_nnz_mean": [nnz], "eval_nnz_max": [150], "eval_zeros_pct": 100 - nnz / 2,
                 "eval_overflow_rate_all": 0.1}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = summarize_runs([tmp_path / "long_l1_0.001", tmp_path / "l1_0.001", tmp_path / "l1_0.0"])
    assert [(r["steps"], r["l1_coeff"]) for r in rows] == [(10, 0.0), (10, 1e-3), (20, 1e-3)]
    assert rows[1]["ce_increase_pct"] == pytest.approx(2.0) and rows[1]["nnz_pct_of_h"] == 2.5
    assert rows[2]["ce_increase_pct"] == ""  # its sweep (20 steps) has no λ = 0 run to compare with
    table = quality_table(rows)
    assert "| tiny | 10 × 16 | 0 | 0.001 | no | 3.0600 | +2.00% |" in table
    assert "| tiny | 20 × 16 | 0 | 0.001 | no | 2.5000 | – |" in table
    assert plot_quality(rows, tmp_path / "quality.png").stat().st_size > 10_000
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no eval or train rows"):
        summarize_runs([tmp_path / "empty"])


def test_e2e_bench_runs_on_a_trained_checkpoint(tmp_path):
    """A checkpoint directory (save_pretrained of a sparse model) keeps its own sparsity: no calibration,
    the table says so, and the measured activity is the model's."""
    pytest.importorskip("transformers")
    from sparseffn.bench.e2e import E2EBenchConfig, run_e2e_bench
    from sparseffn.models import SparsityConfig, build_model

    model = build_model("tiny", SparsityConfig(l1_coeff=1e-2), vocab_size=256, seed=0, max_position_embeddings=32)
    model.save_pretrained(tmp_path / "ckpt")
    cfg = E2EBenchConfig(model=str(tmp_path / "ckpt"), batches="2", train_batches="2", seq_len=32, dtype="float32",
                         warmup=1, reps=1, non_mlp="fused", out_dir=str(tmp_path), git_sha="abc")
    rows = run_e2e_bench(cfg, torch.device("cpu"), log=lambda _: None)
    assert len(rows) == 4 and all(r["target_nnz"] != r["target_nnz"] for r in rows)  # nan: not calibrated
    forward = [r for r in rows if r["phase"] == "forward"]
    assert all(0 < float(r["mlp_nnz"]) <= 352 for r in forward)  # tiny: H = 352, plain ReLU fires on ~half
    assert "trained checkpoint, its own sparsity" in e2e_table(read_rows(tmp_path / "cpu" / "e2e.csv"))
