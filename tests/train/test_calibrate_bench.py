"""`sparseffn bench calibrate` on a finished tiny run (CPU): thresholds fitted on the training split,
quality measured on the held-out split against the uncalibrated checkpoint."""

import pytest

from sparseffn.bench.calibrate import CSV_FIELDS, CalibrateBenchConfig, calibrate_table, run_calibrate_bench
from sparseffn.bench.report import read_rows


def test_calibrate_bench_rows_csv_and_table(trained_run, tmp_path):
    cfg = CalibrateBenchConfig(checkpoint=str(trained_run.out_dir), targets="40,10", calibration_windows=8,
                               out_dir=str(tmp_path), git_sha="abc")
    rows = run_calibrate_bench(cfg, log=lambda _: None)
    assert [r["target_nnz"] for r in rows] == ["none", 40.0, 10.0]
    base, *calibrated = rows
    assert base["ce_increase_pct"] == 0 and base["calibration_tokens"] == 0
    for row, goal in zip(calibrated, (40, 10)):
        assert row["calibration_tokens"] == 8 * 32  # 8 windows of the run's seq_len
        assert abs(row["nnz_mean"] - goal) < 0.35 * goal  # held-out, so near but not at the fitted target
    assert calibrated[0]["zeros_pct"] < calibrated[1]["zeros_pct"]
    written = read_rows(tmp_path / "cpu" / "calibrate.csv")
    assert tuple(written[0]) == CSV_FIELDS and len(written) == 3
    table = calibrate_table(written)
    assert table.count("\n| tiny |") == 3 and "git abc" in table


def test_calibrate_bench_bad_input(trained_run, tmp_path):
    with pytest.raises(ValueError, match="checkpoint: give a training run directory"):
        run_calibrate_bench(CalibrateBenchConfig())
    with pytest.raises(ValueError, match="targets"):
        run_calibrate_bench(CalibrateBenchConfig(checkpoint=str(trained_run.out_dir), targets=" , "))
    with pytest.raises(ValueError, match="targets: comma-separated"):
        run_calibrate_bench(CalibrateBenchConfig(checkpoint=str(trained_run.out_dir), targets="8,many"))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'missing'} does not exist"):
        run_calibrate_bench(CalibrateBenchConfig(checkpoint=str(tmp_path / "missing")))


def test_cli_bench_calibrate_then_report(trained_run, tmp_path, capsys):
    from sparseffn.cli import main

    args = ["bench", "calibrate", str(trained_run.out_dir), "--targets", "20", "--calibration-windows", "4",
            "--out-dir", str(tmp_path), "--git-sha", "c1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| tiny | 20.0 |" in out and (tmp_path / "cpu" / "calibrate.png").stat().st_size > 0
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- bench:calibrate -->\nSTALE\n<!-- /bench:calibrate -->\n")
    assert main(["bench", "report", "--results-dir", str(tmp_path / "cpu"), "--readme", str(readme)]) == 0
    assert "STALE" not in readme.read_text() and "git c1" in readme.read_text()
