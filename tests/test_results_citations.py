"""The archive of measurements, `benchmarks/results/`, against the documents and code that cite it.

A citation is a path `benchmarks/results/<folder>[/<file>...]`, or a bare results folder name
(`2026-12-05-recall-study`, optionally followed by `/<file>...`), in the docs, the benchmarks' scripts or the code.
Every cited path must exist, and every folder kept in the archive must be cited (the rest lives in git history).
"""

from __future__ import annotations

import re
from pathlib import Path

THIS = Path(__file__).resolve()
ROOT = THIS.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "BENCHMARKS.md", "runs/README.md")
TREES = ("docs", "fidelity", "oracles", "probes", "benchmarks", "tools", "tests")
SUFFIXES = {".md", ".py", ".sh"}
FULL = re.compile(r"benchmarks/results/([^\s`'\"()\[\]|,;<>]+)")
BARE = re.compile(r"(?<![\w.-])(20\d\d-\d\d-\d\d-[A-Za-z0-9_.-]*[A-Za-z0-9_])((?:/[A-Za-z0-9_.*-]+)*)")


def _sources() -> list[Path]:
    """The files whose citations are checked: the top-level docs and every source or doc file outside the archive
    (this test's own examples aside)."""
    files = [ROOT / name for name in DOCS if (ROOT / name).exists()]
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and RESULTS not in path.parents and path != THIS:
                files.append(path)
    return files


def _cited_paths(text: str) -> set[str]:
    """Paths relative to `benchmarks/results/` that `text` cites, trailing slashes and dots removed."""
    found = {m.group(1) for m in FULL.finditer(text)}
    found |= {m.group(1) + m.group(2) for m in BARE.finditer(text)}
    return {p.rstrip("/.") for p in found if p.rstrip("/.")}


def _exists(rel: str) -> bool:
    """Whether a cited path (globs such as `call7_*` allowed) names something in the archive."""
    if any(ch in rel for ch in "*?"):
        return any(RESULTS.glob(rel))
    return (RESULTS / rel).exists()


def test_every_cited_results_path_exists():
    missing = []
    for path in _sources():
        for rel in sorted(_cited_paths(path.read_text(errors="replace"))):
            if not _exists(rel):
                missing.append(f"{path.relative_to(ROOT)}: benchmarks/results/{rel}")
    assert not missing, "cited but not in benchmarks/results/:\n" + "\n".join(missing)


def test_every_results_folder_is_cited():
    cited = set()
    for path in _sources():
        cited |= {rel.split("/")[0] for rel in _cited_paths(path.read_text(errors="replace"))}
    for readme in RESULTS.glob("*/README.md"):
        own = readme.parent.name
        cited |= {rel.split("/")[0] for rel in _cited_paths(readme.read_text(errors="replace"))} - {own}
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    uncited = sorted(folders - cited)
    assert not uncited, "folders in benchmarks/results/ that nothing cites: " + ", ".join(uncited)


def test_citation_patterns_find_full_paths_and_bare_folder_names():
    text = "see `benchmarks/results/2026-12-05-a/b.log`, (`2026-12-04-c/d/`), `benchmarks/results/<date>-x`"
    assert _cited_paths(text) == {"2026-12-05-a/b.log", "2026-12-04-c/d"}
