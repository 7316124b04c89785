"""benchmarks/ stays navigable: every script is listed in its README, every path cited exists, and the
scripts' imports of sparseffn still resolve (they run only on a GPU machine, so nothing else would notice)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.parts)
PY_SCRIPTS = [p for p in SCRIPTS if p.suffix == ".py"]


def test_every_script_has_its_line_in_the_readme_and_every_listed_script_exists():
    suite, _, probes = (BENCH / "README.md").read_text().partition("\n## probes/\n")
    item = re.compile(r"^- `(\w+\.(?:py|sh))`", re.M)
    listed = set(item.findall(suite)) | {f"probes/{name}" for name in item.findall(probes)}
    on_disk = {p.relative_to(BENCH).as_posix() for p in SCRIPTS}
    assert on_disk == listed, f"in benchmarks/ but not its README: {sorted(on_disk - listed)}; " \
                              f"in the README but not on disk: {sorted(listed - on_disk)}"


def test_no_script_is_named_after_a_run():
    for path in SCRIPTS:
        assert not re.search(r"session|h200|h100|\d{4}-\d\d|_[0-9a-f]{7}\b", path.stem), path.name


def _cited_paths() -> list[tuple[Path, str]]:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"), BENCH / "README.md",
             *SCRIPTS, *(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    found = []
    for page in pages:
        if not page.exists():
            continue
        for cited in re.findall(r"benchmarks/[\w./<>-]*\w", page.read_text()):
            if "<" not in cited and "$" not in cited:
                found.append((page, cited))
    return found


def test_every_cited_benchmarks_path_exists():
    missing = [f"{page.relative_to(ROOT)}: {cited}" for page, cited in _cited_paths() if not (ROOT / cited).exists()]
    assert not missing, "; ".join(missing)


@pytest.mark.parametrize("path", PY_SCRIPTS, ids=[p.relative_to(BENCH).as_posix() for p in PY_SCRIPTS])
def test_script_imports_of_sparseffn_resolve(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparseffn"):
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                        and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sparseffn"):
                    importlib.import_module(alias.name)
    assert not missing, f"{path.name} imports what sparseffn no longer has: {missing}"
