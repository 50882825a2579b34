"""The recorded experiments follow their results files: every table in `experiments/` is what
`scripts/plot.py` computes from the JSONL beside it, every table row quoted in a write-up under a
`<!-- rows of experiments/…/table.md -->` marker is a row of that table, and every figure listed in a
`<!-- figures of experiments/…/results.jsonl … -->` comment is its record's value, quoted in the prose of
that section. A figures comment has one line per record:

    SpecCascade [Token] α=0.9 γ=5: quality 12.66, quality_interval 10.78 14.41, speed_up 0.74

the family, then selectors (α, γ, T, top_p) that must pick exactly one record, then quantities: a record
key (dotted for nested ones: `costs.tokens_per_verifier_call`) or a derived one (`speed_up` = 1 / relative
latency, `speed_up_interval`, `ms` = milliseconds per example), each with its value(s) as quoted, compared at the quoted
decimals."""

import math
import pathlib
import re

import pytest

from specdec.evaluation import pareto
from specdec.evaluation.results import read_results

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLES = {"table.md": pareto.table2_markdown, "multi_draft.md": pareto.multi_draft_markdown}
RECORDED = sorted((results, name) for results in REPO_ROOT.glob("experiments/*/results.jsonl")
                  for name in TABLES if (results.parent / name).exists())
WRITE_UPS = (REPO_ROOT / "README.md", *sorted(REPO_ROOT.glob("docs/*.md")),
             *sorted(REPO_ROOT.glob("experiments/**/README.md")))
MARKER = re.compile(r"<!-- rows of (\S+) -->")
FIGURES = re.compile(r"<!-- figures of (\S+)\n(.*?)-->", re.DOTALL)
SELECTORS = {"α": ("point", "alpha"), "γ": ("point", "gamma"), "T": ("point", "temperature"),
             "top_p": ("point", "top_p")}
DERIVED = {"speed_up": lambda record: [1 / record["relative_latency"]],
           "speed_up_interval": lambda record: [1 / bound for bound in record["relative_latency_interval"][::-1]],
           "ms": lambda record: [1e3 * record["seconds_per_example"]]}


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
    assert row in table, f"{doc.relative_to(REPO_ROOT)} quotes a row that {source} does not hold: {row}"


def quoted_figures(text: str) -> list[tuple[str, str, str, str]]:
  """(results path, claim line, section text before the comment, section heading) for each figures line."""
  figures = []
  for match in FIGURES.finditer(text):
    start = max(text.rfind("\n## ", 0, match.start()), 0)
    section = text[start:match.start()]
    figures += [(match.group(1), line.strip(), section, section.split("\n")[1])
                for line in match.group(2).splitlines() if line.strip()]
  return figures


def _select(records: list[dict], selector: str) -> dict:
  family, *settings = selector.split(" ")
  while settings and "=" not in settings[0]:
    family = f"{family} {settings.pop(0)}"
  chosen = [r for r in records if r.get("family") == family]
  for setting in settings:
    name, value = setting.split("=")
    section, key = SELECTORS[name]
    chosen = [r for r in chosen if r[section][key] is not None and math.isclose(r[section][key], float(value))]
  assert len(chosen) == 1, f"'{selector}' picks {len(chosen)} records, not one"
  return chosen[0]


def _values(record: dict, quantity: str) -> list[float]:
  if quantity in DERIVED:
    return DERIVED[quantity](record)
  value = record
  for key in quantity.split("."):
    value = value[key]
  return list(value) if isinstance(value, list) else [value]


def check_figure(records: list[dict], claim: str, prose: str) -> None:
  """Raises AssertionError unless each quoted value of the claim line is its record's, and in the prose."""
  selector, quantities = claim.split(": ", 1)
  record = _select(records, selector)
  for quantity in quantities.split(", "):
    name, *quoted = quantity.split(" ")
    values = _values(record, name)
    assert len(values) == len(quoted), f"{claim}: {name} has {len(values)} values, {len(quoted)} quoted"
    for value, figure in zip(values, quoted):
      decimals = len(figure.partition(".")[2])
      assert f"{value:.{decimals}f}" == figure, f"{claim}: {name} is {value}, quoted {figure}"
      assert re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", prose), f"{figure} ({claim}) is not in the prose"


def test_a_figure_is_checked_against_its_record_and_the_prose():
  records = [{"family": "A", "point": {"alpha": 0.5, "gamma": 5}, "quality": 12.6551, "relative_latency": 1.25,
              "costs": {"rate": 0.1234}},
             {"family": "A", "point": {"alpha": 0.9, "gamma": 5}, "quality": 3.0, "relative_latency": 0.5,
              "costs": {"rate": 0.2}}]
  check_figure(records, "A α=0.5: quality 12.66, speed_up 0.80, costs.rate 0.123", "12.66 at 0.80× (0.123)")
  for claim, prose in [("A α=0.5: quality 12.65", "12.65"),  # wrong value
                       ("A α=0.5: quality 12.66", "112.66"),  # not in the prose
                       ("A: quality 12.66", "12.66"),  # two records
                       ("A γ=1: quality 12.66", "12.66")]:  # none
    with pytest.raises(AssertionError):
      check_figure(records, claim, prose)


def test_figures_quoted_in_the_write_ups_are_their_records_values():
  figures = [(doc, *figure) for doc in WRITE_UPS for figure in quoted_figures(doc.read_text())]
  assert len(figures) >= 10, "the write-ups list their figures in figures comments (the protocol runs', at least)"
  records = {source: read_results(REPO_ROOT / source) for source in {figure[1] for figure in figures}}
  for doc, source, claim, prose, heading in figures:
    try:
      check_figure(records[source], claim, prose)
    except AssertionError as e:
      raise AssertionError(f"{doc.relative_to(REPO_ROOT)}, {heading}: {e}") from e
