"""The recorded experiments follow their results files: every table in `experiments/` is what
`scripts/plot.py` computes from the JSONL beside it, and every table row quoted in a write-up under a
`<!-- rows of experiments/…/table.md -->` marker is a row of that table."""

import pathlib
import re

import pytest

from specdec.evaluation import pareto
from specdec.evaluation.sweep import read_results

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLES = {"table.md": pareto.table2_markdown, "multi_draft.md": pareto.multi_draft_markdown}
RECORDED = sorted((results, name) for results in REPO_ROOT.glob("experiments/*/results.jsonl")
                  for name in TABLES if (results.parent / name).exists())
WRITE_UPS = (REPO_ROOT / "README.md", REPO_ROOT / "experiments" / "README.md")
MARKER = re.compile(r"<!-- rows of (\S+) -->")


@pytest.mark.parametrize("results, name", RECORDED, ids=[f"{r.parent.name}/{n}" for r, n in RECORDED])
def test_recorded_tables_are_recomputed_from_their_results(results, name):
  recorded = (results.parent / name).read_text()
  assert recorded == TABLES[name](read_results(results)), (
      f"{results.parent / name} differs from what its results file gives: "
      f"rerun `python scripts/plot.py --results={results.relative_to(REPO_ROOT)}`")


def quoted_rows(text: str) -> list[tuple[str, str]]:
  """(table path, row) for each table row that follows a marker, up to the first line that is not a row."""
  quoted, source = [], None
  for line in text.splitlines():
    marker = MARKER.search(line)
    if marker:
      source = marker.group(1)
    elif source and line.startswith("|"):
      quoted.append((source, line))
    elif source and line.strip():
      source = None
  return quoted


def test_quoted_rows_are_found_by_the_marker_up_to_the_table_end():
  text = "<!-- rows of a/table.md -->\n| x | 1 |\n| y | 2 |\n\nprose\n| z | 3 |\n"
  assert quoted_rows(text) == [("a/table.md", "| x | 1 |"), ("a/table.md", "| y | 2 |")]


def test_rows_quoted_in_the_write_ups_are_rows_of_their_tables():
  quoted = [(doc, source, row) for doc in WRITE_UPS for source, row in quoted_rows(doc.read_text())]
  assert len(quoted) >= 10, "the write-ups quote tables under markers (the protocol run's Table 2, at least)"
  for doc, source, row in quoted:
    table = (REPO_ROOT / source).read_text().splitlines()
    assert row in table, f"{doc.name} quotes a row that {source} does not hold: {row}"
