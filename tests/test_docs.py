"""The README and docs/ stay true: links resolve, the quick start runs, generated tables match the CSVs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from sparseffn.bench.report import regenerate
from sparseffn.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks").rglob("README.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page):
    links = _links(page)
    assert links, f"{page.name} has no links: is the pattern still right?"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto: are not checked offline
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target})")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.name})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_pages_cite_nothing_outside_the_repository():
    for page in PAGES:
        text = page.read_text()
        for pattern in (r"DESIGN(\.md)? ?§", r"ANCHORS", r"\.\./shared"):
            assert not re.search(pattern, text), f"{page.name} cites {pattern}"


def _quick_start_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_the_quick_start_snippets():
    snippets = _quick_start_snippets()
    assert len(snippets) == 2 and "sparse_mlp(" in snippets[0] and "sparsify_(" in snippets[1]


@pytest.mark.parametrize("index", range(len(_quick_start_snippets())))
def test_readme_quick_start_runs(index, tmp_path, monkeypatch, capsys):
    code = _quick_start_snippets()[index]
    if "transformers" in code:
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the snippets write runs/... relative to the working directory
    exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": f"readme_snippet_{index}"})
    capsys.readouterr()


def test_readme_hugging_face_snippet_saves_the_sparsity_it_trained_with(tmp_path, monkeypatch, capsys):
    """What is saved is what was used: the λ of the snippet's loss is the l1_coeff in its config.json."""
    import json

    pytest.importorskip("transformers")
    code = next(s for s in _quick_start_snippets() if "sparsify_(" in s)
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme_snippet"}
    exec(compile(code, "README.md snippet", "exec"), scope)
    capsys.readouterr()
    saved = json.loads((tmp_path / "runs" / "my-sparse" / "config.json").read_text())["sparseffn"]
    used = scope["sparsity"].l1_coeff
    assert used == saved["l1_coeff"] == 1.5e-2
    assert re.search(r"\+ sparsity\.l1_coeff \* sparseffn\.collect_l1\(model\)", code)  # the loss uses it
    assert "λ = 1.5e-2" in code  # and the comment on save_pretrained says so


def test_bench_report_regenerates_the_readme_and_docs_without_a_diff(tmp_path):
    (tmp_path / "docs").mkdir()
    readme, docs = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md"
    shutil.copy(ROOT / "README.md", readme)
    shutil.copy(ROOT / "docs" / "benchmarks.md", docs)
    shutil.copy(ROOT / "docs" / "sparsify.md", tmp_path / "docs" / "sparsify.md")
    (tmp_path / "docs" / "design.md").write_text("no generated block here\n")
    # the CLI finds the docs pages with generated blocks beside the README; --no-plots leaves the PNGs alone
    assert main(["bench", "report", "--results-dir", str(ROOT / "benchmarks" / "results"), "--readme", str(readme),
                 "--no-plots"]) == 0
    assert readme.read_text() == (ROOT / "README.md").read_text(), "README.md: run `sparseffn bench report`"
    for page in ("benchmarks.md", "sparsify.md"):
        assert (tmp_path / "docs" / page).read_text() == (ROOT / "docs" / page).read_text(), \
            f"docs/{page}: run `sparseffn bench report`"


def test_every_result_csv_has_its_table(tmp_path):
    """Each block's CSV lands in the docs: regenerate raises for a CSV without a block, so removing a
    table from the docs without removing its CSV fails here."""
    pages = [tmp_path / "benchmarks.md", tmp_path / "sparsify.md"]
    for page in pages:
        shutil.copy(ROOT / "docs" / page.name, page)
    used = regenerate(ROOT / "benchmarks" / "results", pages, plots=False)
    names = {Path(p).name for p in used}
    assert {"mlp.csv", "mlp_paper_shape.csv", "mlp_train.csv", "e2e.csv", "quality.csv", "calibrate.csv",
            "relufy_20m.csv", "relufy_100m.csv"} <= names


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_benchmarks_page_is_results_not_a_lab_notebook():
    """Tables, conditions, commands and caveats in <= 400 lines; which commit measured what lives in the
    generated table headers (and file names), history in CHANGELOG.md."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 400
    by_hand = re.sub(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", "", text, flags=re.S)
    shas = [s for s in re.findall(r"(?<![\w/-])[0-9a-f]{7,12}\b", by_hand) if re.search(r"[a-f]", s) and re.search(r"\d", s)]
    assert not shas, f"commit hashes outside the generated blocks of docs/benchmarks.md: {shas}"


KERNEL_FILES = sorted((ROOT / "src" / "sparseffn" / "kernels").glob("[!_]*.py"))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_kernel_files_open_with_a_short_docstring(path):
    """A newcomer reads the math, layouts and constraints in <= 30 lines; timings go to docs/benchmarks.md."""
    import ast

    tree = ast.parse(path.read_text())
    first = tree.body[0] if tree.body else None
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), f"{path.name} has no docstring"
    assert first.end_lineno <= 30, f"{path.name}: module docstring ends at line {first.end_lineno}"
