import csv

import pytest
import torch

from sparseffn.bench.mlp import CSV_FIELDS, GRAPH_PROVIDERS, PROVIDERS, MLPBenchConfig, run_mlp_bench
from sparseffn.bench.report import mlp_table, plot_mlp, read_rows, replace_block
from sparseffn.bench.timing import Timing, median_timing
from tests.bench.interpreted import interpreted


@interpreted
def test_bench_runs_end_to_end_and_writes_a_well_formed_csv(tmp_path):
    cfg = MLPBenchConfig(shapes="64x256", tokens="5", nnz="8,200", providers="dense,sparse,auto,gate_cublas,gate_pack",
                         tile=64, slots=8, out_dir=str(tmp_path), git_sha="abc123")
    rows = run_mlp_bench(cfg, torch.device("cpu"), log=lambda _: None)
    assert len(rows) == 2 * 5
    path = tmp_path / "cpu" / "mlp.csv"
    with path.open() as f:
        written = list(csv.DictReader(f))
    assert tuple(written[0]) == CSV_FIELDS and len(written) == len(rows)
    for row in written:
        assert row["git_sha"] == "abc123" and row["gpu"].startswith("cpu")
        assert float(row["median_ms"]) > 0 and float(row["p20_ms"]) <= float(row["p80_ms"])
        if row["provider"] in ("dense", "sparse", "auto"):
            assert row["within_bound"] == "True", row  # every output checked against the fp32 reference
    sparse = [r for r in written if r["provider"] == "sparse"]
    assert int(sparse[1]["overflow_rows"]) > 0  # the dense-ish case overflows and is still exact
    assert {r["mode"] for r in written if r["provider"] == "auto"} == {"dense"}  # never interprets on CPU

    table = mlp_table(read_rows(path))
    assert table.count("\n| 64×256 |") == 2 and "git abc123" in table
    pytest.importorskip("matplotlib")
    assert plot_mlp(written, tmp_path / "mlp.png").stat().st_size > 0


def test_replace_block_and_bad_providers():
    text = "a\n<!-- bench:mlp -->\nold\n<!-- /bench:mlp -->\nb"
    assert replace_block(text, "mlp", "new") == "a\n<!-- bench:mlp -->\nnew\n<!-- /bench:mlp -->\nb"
    with pytest.raises(ValueError, match="no <!-- bench:e2e -->"):
        replace_block(text, "e2e", "x")
    with pytest.raises(ValueError, match="providers: unknown"):
        run_mlp_bench(MLPBenchConfig(providers="dense,fastest"), torch.device("cpu"))
    with pytest.raises(ValueError, match="need a CUDA device"):
        run_mlp_bench(MLPBenchConfig(providers="dense,sparse_graph"), torch.device("cpu"))


@interpreted
def test_default_providers_on_cpu_leave_out_the_cuda_graphs(tmp_path):
    cfg = MLPBenchConfig(shapes="32x128", tokens="3", nnz="4", tile=64, slots=8, out_dir=str(tmp_path), rep_ms=1)
    rows = run_mlp_bench(cfg, torch.device("cpu"), log=lambda _: None)
    # torch.compile's provider runs in a second pass, after every other provider of every case
    eager = [p for p in PROVIDERS if p not in GRAPH_PROVIDERS and p != "dense_compiled"]
    assert [r["provider"] for r in rows] == eager + ["dense_compiled"]
    compiled = rows[-1]
    assert compiled["m"] == rows[0]["m"] and compiled["mean_nnz"] == rows[0]["mean_nnz"]
    assert compiled["within_bound"] == "True" and float(compiled["speedup_vs_dense"]) > 0


def test_median_timing_takes_each_statistic_over_rounds():
    rounds = [Timing(3.0, 1.0, 4.0), Timing(1.0, 0.5, 9.0), Timing(2.0, 2.0, 2.5)]
    assert median_timing(rounds) == Timing(2.0, 1.0, 4.0)
    assert median_timing(rounds[:2]) == Timing(2.0, 0.75, 6.5)
    with pytest.raises(ValueError, match="at least one"):
        median_timing([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphed_replays_on_the_inputs_current_values():
    from sparseffn.bench.timing import cuda_graphed

    x = torch.randn(64, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    replay = cuda_graphed(lambda: x @ w, x.device)
    x.copy_(torch.randn_like(x))  # captured inputs are read at replay time
    torch.testing.assert_close(replay(), x @ w)
