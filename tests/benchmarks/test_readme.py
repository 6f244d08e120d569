"""benchmarks/README.md's index: a row per measurement module, and its results column
names exactly the files under benchmarks/results/ (none that does not exist, none left
out)."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def index() -> list[tuple[str, list[str]]]:
    """(module, the files its results cell names) per row of the index table."""
    text = (BENCH / "README.md").read_text()
    table = text[text.index("| module | what | results |"):].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        module, _, results = line.strip("|").split(" | ")
        rows.append((module.strip("` "), re.findall(r"`([^`]+)`", results)))
    return rows


def test_every_measurement_has_a_row():
    modules = {f"benchmarks.{p.stem}" for p in BENCH.glob("*.py") if p.stem != "__init__"}
    assert {m for m, _ in index()} == modules


def test_the_index_lists_every_result_file_and_only_those():
    listed = [f for _, files in index() for f in files if not f.startswith("figures/")]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(p.name for p in (BENCH / "results").iterdir() if p.is_file())
    figures = [f for _, files in index() for f in files if f.startswith("figures/")]
    assert figures and all(list(BENCH.glob(f)) for f in figures)
