"""`bench train-run`: each mode trains (in its own process by default) on CPU with the tiny model; rows
carry speed, sparsity, the paths auto mode took and held-out CE; the summary answers for runs where some
layers stay dense; per-size λ defaults and bad flags."""

import csv
import subprocess
from pathlib import Path

import pytest

from sparseffn.bench.train_run import (PAPER_REGIME_L1, TrainRunBenchConfig, plot_train_run, run_train_run_bench,
                                       summarize, train_run_table)
from sparseffn.train.data import default_corpus_dir

TINY = dict(model="tiny", steps=4, batch_size=2, seq_len=32, l1_coeff=1e-2, l1_warmup_steps=2, log_interval=2,
            eval_interval=2, eval_batches=1, git_sha="test")


@pytest.fixture
def corpus(tmp_path):
    """A 20 kB cut of the embedded corpus (tokenizing all of it takes half a minute on a busy CPU)."""
    path = tmp_path / "play.txt"
    path.write_text((default_corpus_dir() / "hamlet_gut.txt").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


@pytest.mark.timeout(900)
@pytest.mark.parametrize("processes", [True, False], ids=["own-process", "one-process"])
def test_train_run_bench_on_cpu(tmp_path, corpus, processes, monkeypatch):
    modes = ["auto", "dense", "no-l1"] if processes else ["auto", "dense"]
    caches = []  # each mode's process gets an empty Triton cache of its own
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        if "sparseffn.bench.train_run" in str(args):  # a mode's process (not a git call)
            caches.append(kwargs["env"]["TRITON_CACHE_DIR"])
        return real_popen(args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    profile = "" if processes else "3-4"  # --profile-steps: each mode's profile kept beside the CSV
    cfg = TrainRunBenchConfig(**TINY, data=str(corpus), processes=processes, modes=",".join(modes),
                              out_dir=str(tmp_path), profile_steps=profile)
    lines = []
    rows = run_train_run_bench(cfg, log=lines.append)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [(r["mode"], r["step"]) for r in steps] == [(m, s) for m in modes for s in (2, 4)]
    assert {r["mode"]: r["l1_coeff"] for r in steps} == {m: {"no-l1": 0.0}.get(m, 1e-2) for m in modes}
    assert all(r["layers"] == 4 and r["sparse_layers"] == 0 for r in steps)  # CPU: auto never interprets
    assert all(isinstance(r["eval_ce"], float) and r["eval_ce"] > 0 for r in steps)  # CE at the same steps
    summaries = [r for r in rows if r["kind"] == "summary"]
    assert [s["mode"] for s in summaries] == modes
    assert all(s["wall_s"] >= s["warmup_s"] > 0 and s["final_eval_ce"] > 0 for s in summaries)
    assert any("tokenizer:" in line for line in lines)  # the runs' own output reached the log
    with (tmp_path / "cpu" / "train_run.csv").open() as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) and {r["process"] for r in written} == {"own" if processes else "shared"}
    assert len(set(caches)) == len(caches) == (len(modes) if processes else 0)
    assert not any(Path(c).exists() for c in caches)  # removed with the runs' temporary folder
    table = train_run_table(written, width=4)  # from the CSV's strings, as `bench report` reads it
    assert "| 0–2 |" in table and "warm-up" in table and "| 2–4 |" in table
    assert ("Final held-out CE against λ = 0: auto" in table) is processes
    assert "no sparse phase" in table and "nan" not in table
    assert plot_train_run(written, tmp_path / "train_run.png").exists()
    kept = sorted(p.name for p in (tmp_path / "cpu").glob("train_run_profile_*.txt"))
    assert kept == ([] if processes else ["train_run_profile_tiny_auto.txt", "train_run_profile_tiny_dense.txt"])
    assert all((tmp_path / "cpu" / name).read_text().startswith("optimizer steps 3-4: wall") for name in kept)


def _row(mode, step, tps, sparse, layers=4):
    return dict(kind="step", mode=mode, step=step, tokens_per_s=tps, tokens_per_step=1000, sparse_layers=sparse,
                layers=layers)


def test_summary_phases_when_some_layers_stay_dense():
    """Auto switches 3 of 4 layers at step 30 and a 4th never: the sparse phase at share 0.75 holds the
    windows with >= 3 sparse layers at both ends, and at share 1 there is none (stated, not NaN)."""
    dense = [_row("dense", s, 1000.0, 0) for s in (10, 20, 30, 40, 50)]
    auto = [_row("auto", 10, 500.0, 0), _row("auto", 20, 1000.0, 0), _row("auto", 30, 800.0, 3),
            _row("auto", 40, 1500.0, 3), _row("auto", 50, 1500.0, 3)]
    s = summarize(dense + auto, share=0.75)
    assert s["dense_phase"] == pytest.approx(1.0) and s["dense_windows"] == 1  # 10-20; 0-10 is warm-up
    assert s["sparse_phase"] == pytest.approx(1.5) and s["sparse_windows"] == 2 and s["sparse_from"] == 40
    assert s["slowest"] == pytest.approx(0.8) and s["slowest_steps"] == (20, 30)
    assert s["after_warmup"] == pytest.approx(40 / (10 + 12.5 + 20 / 3 + 20 / 3))
    whole = summarize(dense + auto, share=1.0)
    assert whole["sparse_windows"] == 0 and whole["most_sparse"] == (3, 4, 30)
    summary = [dict(kind="summary", mode=m, wall_s=w, warmup_s=1.0, kernel_warm_s=0.0, final_eval_ce=3.0, l1_coeff=1e-4)
               for m, w in (("auto", 50.0), ("dense", 55.0))]
    meta = dict(gpu="GPU", git_sha="x", model="tiny", process="own")
    table = train_run_table([dict(meta, **r) for r in dense + auto + summary], width=20, share=1.0)
    assert "no sparse phase (no window with ≥ 100% of auto's layers sparse; at most 3 of 4, at step 30)" in table
    assert "nan" not in table and "whole-run wall time, warm-up and evaluations included, 1.10x" in table


def test_paper_regime_lambda_per_size_and_bad_flags():
    assert TrainRunBenchConfig().l1 == PAPER_REGIME_L1["0.5b"]
    assert TrainRunBenchConfig(model="2b").l1 == 2e-4
    assert TrainRunBenchConfig(model="2b", l1_coeff=0.0).l1 == 0.0  # --l1-coeff overrides
    with pytest.raises(ValueError, match="--l1-coeff: no paper-regime λ is set for --model 'tiny'"):
        TrainRunBenchConfig(model="tiny")
    with pytest.raises(ValueError, match="--modes"):
        TrainRunBenchConfig(modes="auto,fast")
    with pytest.raises(ValueError, match="--sparse-share"):
        TrainRunBenchConfig(sparse_share=0)
    with pytest.raises(ValueError, match="--profile-steps"):
        TrainRunBenchConfig(profile_steps="4")
