"""`bench report`: which CSV feeds which block, the README's headline rows, and the errors."""

from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path

import pytest

from sparseffn.bench.report import deterministic_table, find_csv, headline_table, read_rows, regenerate

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _copy(tmp_path: Path, *names: str, device: str = "h200") -> Path:
    (tmp_path / device).mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(RESULTS / device / name, tmp_path / device / name)
    return tmp_path


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_find_csv_takes_a_device_folder_or_the_results_root(tmp_path):
    root = _copy(tmp_path, "quality.csv")
    assert find_csv(root, "quality.csv") == root / "h200" / "quality.csv"
    assert find_csv(root / "h200", "quality.csv") == root / "h200" / "quality.csv"
    assert find_csv(root, "calibrate.csv", "cpu") is None


def test_headline_rows_come_from_the_csvs_present(tmp_path):
    root = _copy(tmp_path, "quality.csv")
    table = headline_table(root)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 2  # header + the quality row: no MLP or e2e CSV here
    # the sparsest-enough run (>= 99% zeros) with the smallest CE increase: 20m, λ 1.5e-2 ramped over 300
    assert "λ = 0.015 ramped over 300 steps" in lines[1] and "**99.02% zeros**" in lines[1]
    assert "+0.99% vs λ = 0" in lines[1] and "quality.csv abaf270" in table
    _copy(tmp_path, "mlp_paper_shape.csv", "mlp_train.csv", "e2e.csv", "decode_model.csv")
    full = headline_table(root)
    assert "**1.48x / 1.74x / 1.66x**" in full and "**0.90x / 2.02x / 1.93x**" in full
    assert "**1.37x / 1.36x**" in full and "peak memory 0.69x |" in full
    generation = next(line for line in full.splitlines() if "model generation" in line)
    assert "batch 1 / 4 / 16 / 64" in generation and "at the generated positions; fused RMSNorm/RoPE" in generation
    assert "**1.14x / 1.19x / 1.16x / 1.00x**" in generation and "norms/RoPE: 1.02x / 1.12x / 1.10x / 1.00x" in generation
    assert "torch.compile (hf norms/RoPE, batch 1 / 4 / 16 / 64): 1.22x / 1.14x / 1.10x / 1.00x" in generation
    assert headline_table(tmp_path / "nothing") is None


def test_every_headline_row_links_to_its_section_of_the_benchmarks_page():
    """One click from a README number to its conditions and command (test_docs checks the anchors exist)."""
    rows = [line for line in headline_table(RESULTS).splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 8
    for row in rows:
        first_cell = row.split(" | ")[0]
        assert re.fullmatch(r"\| \[[^\]]+\]\(docs/benchmarks\.md#[a-z0-9-]+\)", first_cell), first_cell


def test_headline_has_no_quality_row_below_99_percent(tmp_path):
    rows = read_rows(RESULTS / "h200" / "quality.csv")
    _write(tmp_path / "h200" / "quality.csv", [r for r in rows if float(r["zeros_pct"]) < 99.0])
    assert headline_table(tmp_path) is None


def test_regenerate_rewrites_the_blocks_it_has_csvs_for(tmp_path):
    root = _copy(tmp_path / "results", "quality.csv", "deterministic.csv")
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- bench:headline -->\nold\n<!-- /bench:headline -->\n")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("<!-- bench:quality -->\nold\n<!-- /bench:quality -->\n"
                    "<!-- bench:deterministic -->\nold\n<!-- /bench:deterministic -->\n"
                    "<!-- bench:e2e -->\nkept: no CSV\n<!-- /bench:e2e -->\n")
    used = regenerate(root, [readme, docs], plots=False)
    assert [Path(p).name for p in used] == ["deterministic.csv", "quality.csv"]
    assert "old" not in readme.read_text() and "99.02% zeros" in readme.read_text()
    text = docs.read_text()
    assert "old" not in text and "kept: no CSV" in text and "| 16384 | 2.76 ms | 3.10 ms (+12%) |" in text
    assert not (root / "h200" / "quality.png").exists()  # plots=False


def test_regenerate_refuses_a_csv_without_a_block_and_an_empty_folder(tmp_path):
    root = _copy(tmp_path / "results", "quality.csv")
    page = tmp_path / "page.md"
    page.write_text("no blocks\n")
    with pytest.raises(ValueError, match="no <!-- bench:quality --> block"):
        regenerate(root, [page], plots=False)
    with pytest.raises(FileNotFoundError, match="no benchmark CSV"):
        regenerate(tmp_path / "empty", [page], plots=False)


def test_deterministic_table_shows_each_variant_against_the_default():
    table = deterministic_table(read_rows(RESULTS / "h200" / "deterministic.csv"))
    assert "| M | default | deterministic | deterministic, no NaN fill |" in table
    assert "| 4096 | 1.77 ms | 2.01 ms (+14%) | 1.89 ms (+7%) |" in table
    assert deterministic_table([]) == "(no rows)"
