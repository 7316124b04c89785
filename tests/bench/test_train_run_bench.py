"""`bench train-run` on CPU with the tiny model: both modes train, rows carry speed, sparsity and the
paths auto mode took, the summary has the wall time and final CE, the table and plot are made."""

import csv

import pytest

from sparseffn.bench.train_run import TrainRunBenchConfig, plot_train_run, run_train_run_bench, train_run_table


@pytest.mark.timeout(600)
def test_train_run_bench_on_cpu(tmp_path):
    cfg = TrainRunBenchConfig(model="tiny", steps=12, batch_size=2, seq_len=32, l1_coeff=1e-2, l1_warmup_steps=4,
                              log_interval=4, eval_interval=0, out_dir=str(tmp_path), git_sha="test")
    rows = run_train_run_bench(cfg, log=lambda line: None)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [4, 8, 12] * 2 and {r["mode"] for r in steps} == {"dense", "auto"}
    assert all(r["layers"] == 4 and r["sparse_layers"] == 0 for r in steps)  # CPU: auto never interprets
    summaries = [r for r in rows if r["kind"] == "summary"]
    assert [s["mode"] for s in summaries] == ["dense", "auto"] and all(s["wall_s"] > 0 for s in summaries)
    assert all(s["final_eval_ce"] == s["final_eval_ce"] for s in summaries)  # not NaN
    with (tmp_path / "cpu" / "train_run.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "| auto |" in train_run_table(rows)
    assert plot_train_run(rows, tmp_path / "train_run.png").exists()
