"""Pareto frontiers, Table 2 and the plots (specdec.evaluation.pareto, scripts/plot.py)."""

import itertools
import pathlib

import matplotlib.colors
import pytest

from specdec.evaluation import pareto
from tests.commands import load_script

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "sweep" / "results.jsonl"
_ids = itertools.count()


def _record(family, quality, latency, *, method="speculative", rule="lossy", alpha=0.1, model="pair",
            temperature=1.0, gamma=5, rejection_rate=0.1):
  point = {"method": method, "model": model, "rule": rule, "alpha": alpha, "gamma": gamma,
           "temperature": temperature, "top_p": 1.0, "fallback_alpha": None}
  return {"hash": f"h{next(_ids)}", "context_hash": "c", "metric": "bleu", "family": family, "point": point,
          "context": {"task": "debian_en_de", "drafter": {"path": "m/small"}, "verifier": {"path": "m/large"}},
          "quality": quality, "relative_latency": latency, "seconds_per_example": 0.01 * latency,
          "costs": {"rejection_rate": rejection_rate}}


def _large(quality, temperature=1.0):
  return _record("Large (verifier)", quality, 1.0, method="autoregressive", rule=None, alpha=None,
                 model="verifier", temperature=temperature, gamma=None, rejection_rate=None)


def test_frontier_keeps_the_points_nothing_beats():
  points = [(1.0, 10.0), (0.5, 8.0), (0.7, 7.0), (0.9, 10.0), (1.2, 12.0), (0.5, 6.0), (0.5, 8.0)]
  assert pareto.frontier(points) == [(0.5, 8.0), (0.9, 10.0), (1.2, 12.0)]


def test_table2_matching_and_best_quality_on_hand_made_frontiers():
  records = [
      _large(20.0),
      *[_record("A", q, lat, alpha=a) for a, q, lat in [(0.9, 18.0, 0.5), (0.7, 20.5, 0.6), (0.5, 21.0, 0.8),
                                                         (0.1, 23.0, 1.1)]],
      *[_record("B", q, lat, rule="opt") for q, lat in [(15.0, 0.4), (19.0, 0.9)]],      # never matches
      *[_record("C", q, lat, rule="chow") for q, lat in [(25.0, 1.2), (26.0, 1.5)]],     # always slower
      _record("D", 20.0, 1.0, rule="diff"),                                              # ties count
  ]
  (group,) = pareto.group_records(records)
  rows = {row.name: row for row in pareto.table2_rows(group)}
  assert rows["A"].speedup == pytest.approx(1 / 0.6) and rows["A"].best["quality"] == 21.0
  assert rows["B"].matching is None and rows["B"].best["quality"] == 19.0
  assert rows["C"].speedup == pytest.approx(1 / 1.2) and rows["C"].best is None
  assert rows["D"].speedup == 1.0 and rows["D"].best["quality"] == 20.0
  table = pareto.table2_markdown(records)
  assert "| A | 1.67× (α=0.7, latency 0.60) | 21.00 (α=0.5, latency 0.80) |" in table
  assert "| B | — | 19.00 (α=0.1, latency 0.90) |" in table
  assert "| C | 0.83× (α=0.1, latency 1.20) | — |" in table


def test_table2_has_one_table_per_temperature_with_its_own_large_model():
  records = [_large(20.0, 1.0), _record("A", 20.0, 0.5, temperature=1.0),
             _large(25.0, 0.5), _record("A", 24.0, 0.5, temperature=0.5)]
  groups = pareto.group_records(records)
  assert [g.title.split("T=")[1] for g in groups] == ["1, top-P=1", "0.5, top-P=1"]
  assert [pareto.table2_rows(g)[0].speedup for g in groups] == [2.0, None]


def test_runs_with_other_settings_get_their_own_tables_labelled_by_what_differs():
  def other_run(record):
    return {**record, "context_hash": "d", "context": {**record["context"], "n_examples": 500}}
  first = [_large(20.0), _record("A", 20.0, 0.5)]
  first[0]["context"]["n_examples"] = first[1]["context"]["n_examples"] = 100
  groups = pareto.group_records([*first, *(other_run(r) for r in (_large(21.0), _record("A", 22.0, 0.9)))])
  assert [g.title.rsplit(" [", 1)[1] for g in groups] == ["n_examples=100]", "n_examples=500]"]
  assert [g.large["quality"] for g in groups] == [20.0, 21.0]


def test_series_are_split_by_gamma_and_ordered_as_table_2():
  records = [_large(20.0), _record("SpecCascade [Token]", 21.0, 0.8, rule="token_v3"),
             _record("SpecDecode [Lossy]", 20.0, 0.7, gamma=3), _record("SpecDecode [Lossy]", 21.0, 0.9, gamma=7),
             _record("TokenCascade [Chow]", 19.0, 1.2, method="token_cascade", rule="chow")]
  (group,) = pareto.group_records(records)
  assert list(group.series) == ["TokenCascade [Chow]", "SpecDecode [Lossy] [γ=3]", "SpecDecode [Lossy] [γ=7]",
                                "SpecCascade [Token]"]


def test_table2_without_the_verifier_alone_says_so():
  records = [_record("A", 20.0, 0.5)]
  assert "No record of the verifier alone" in pareto.table2_markdown(records)
  with pytest.raises(ValueError, match="no record of the verifier alone"):
    pareto.table2_rows(pareto.group_records(records)[0])


def test_plot_script_renders_figures_and_table_from_a_results_file(tmp_path):
  paths = load_script("plot").main([f"--results={FIXTURE}", f"--out_dir={tmp_path}"])
  for name in ("pareto.png", "rejection.png"):
    data = (tmp_path / name).read_bytes()
    assert paths[name] == str(tmp_path / name)
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
  table = (tmp_path / "table.md").read_text()
  # T = 1: Large 20.0; Token matches it at 0.85 (1.18×) with 21.5 its best within latency 1.
  assert "| SpecCascade [Token] | 1.18× (α=0.1, latency 0.85) | 21.50 (α=0.1, latency 0.85) |" in table
  assert table.count("### debian_synopsis") == 2


def test_multi_draft_table_has_spectrs_layout():
  def run(family, method, k, gamma, tokens_per_call, latency):
    record = _record(family, 20.0, latency, method=method, rule=None if method != "speculative" else "spec",
                     alpha=None, gamma=gamma)
    record["point"]["num_drafts"] = k
    record["costs"] = {"tokens_per_verifier_call": tokens_per_call,
                       "verifier_positions_per_token": (1 + (k or 1) * gamma) / tokens_per_call}
    return record
  records = [_large(20.0), run("SpecDecode", "speculative", None, 4, 2.0, 0.8),
             *[run("SpecTr", "spectr", k, 4, t, lat) for k, t, lat in [(2, 2.2, 0.88), (4, 2.5, 1.0)]],
             run("SpecInfer", "specinfer", 4, 4, 2.4, 0.96)]
  table = pareto.multi_draft_markdown(records)
  assert "| method | L | K=1 | K=2 | K=4 |" in table
  assert "| SpecDecode | 4 | 2.00 · 1.00× · 2.5 | — | — |" in table
  assert "| SpecTr | 4 | 2.00 · 1.00× · 2.5 | 2.20 · 1.10× · 4.1 | 2.50 · 1.25× · 6.8 |" in table
  assert "| SpecInfer | 4 | 2.00 · 1.00× · 2.5 | — | 2.40 · 1.20× · 7.1 |" in table
  assert table.rstrip().endswith("\n\n—: as a whole cell, no run of the method at that L and K; as the latency, "
                                 "no SpecDecode run at that L to compare with; as the positions, a run recorded "
                                 "before that counter existed.")
  assert pareto.multi_draft_markdown([_large(20.0), run("SpecDecode", "speculative", None, 4, 2.0, 0.8)]) == ""


def test_table2_cells_carry_the_bootstrap_intervals():
  large = {**_large(20.0), "quality_interval": [19.5, 20.5]}
  a = {**_record("A", 21.0, 0.6), "quality_interval": [20.2, 21.9], "relative_latency_interval": [0.55, 0.65]}
  table = pareto.table2_markdown([large, a])
  assert "speed-up↑ when matching the large model's quality" in table and "BLEU 20.00 [19.50, 20.50]" in table
  assert "| A | 1.67× [1.54, 1.82] (α=0.1, latency 0.60) | 21.00 [20.20, 21.90] (α=0.1, latency 0.60) |" in table


def test_figure_3_has_a_panel_per_gamma_and_methods_keep_their_style_across_figures(monkeypatch):
  records = [_large(20.0), *[_record("A", 20.0 + g, 0.5, gamma=g) for g in (1, 5)],
             *[_record("B", 19.0, 0.7, rule="opt", gamma=g) for g in (1, 5)]]
  panels = pareto.rejection_panels(records)
  assert [p.title.rsplit(", ", 1)[1] for p in panels] == ["γ=1", "γ=5"]
  assert all(len(rs) == 1 for p in panels for rs in p.series.values())
  # a method without drafts (in Figure 4, not in Figure 3) comes first in Table 2's order
  records.append(_record("Seq", 18.0, 0.4, method="seq_cascade", rule="chow", gamma=None))
  used = {}
  monkeypatch.setattr(pareto, "_plot_groups", lambda groups, path, *args, styles, **kwargs: used.update({path: styles}))
  pareto.plot_latency(records, "pareto")
  pareto.plot_rejection(records, "rejection")
  styles = used["pareto"]
  assert used["rejection"] == styles and "Seq" in styles
  colour_and_marker = {name: style[:2] for name, style in styles.items()}
  assert colour_and_marker["A [γ=1]"] == colour_and_marker["A [γ=5]"] != colour_and_marker["B [γ=1]"]
  assert styles["A [γ=1]"][2] != styles["A [γ=5]"][2]
  assert len(set(styles.values())) == len(styles)


def test_report_on_a_missing_file_says_so(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such file"):
    pareto.report(tmp_path / "nothing.jsonl", tmp_path)


@pytest.fixture
def figures(monkeypatch):
  """The figures the plots draw, kept open for the test (closed after it)."""
  drawn, close = [], pareto.plt.close
  monkeypatch.setattr(pareto.plt, "close", drawn.append)
  yield drawn
  for figure in drawn:
    close(figure)


def _figure_4(records, tmp_path, figures):
  pareto.plot_latency(records, tmp_path / "pareto.png")
  (figure,) = figures
  return figure


def test_legends_name_gamma_even_where_a_panel_holds_one_value(tmp_path, figures):
  # γ = 3 at T = 1 and γ = 5 at T = 0: each panel has one value, the figure two
  records = [_large(20.0), _record("SpecDecode", 21.0, 0.8, rule="spec", alpha=None, gamma=3),
             _large(22.0, temperature=0.0), _record("SpecDecode", 22.0, 0.7, rule="spec", alpha=None, gamma=5,
                                                    temperature=0.0)]
  figure = _figure_4(records, tmp_path, figures)
  names = [text.get_text() for ax in figure.axes if ax.get_visible() for text in ax.get_legend().get_texts()
           if text.get_text().startswith("SpecDecode")]
  assert names == ["SpecDecode [γ=3]", "SpecDecode [γ=5]"]


def test_alpha_labels_of_nearby_points_do_not_overlap(tmp_path, figures):
  alphas = [0.1 * i for i in range(1, 10)]
  records = [_large(20.0), *[_record("A", 18.0 + 0.05 * i, 0.5 + 0.005 * i, alpha=a) for i, a in enumerate(alphas)]]
  figure = _figure_4(records, tmp_path, figures)
  figure.canvas.draw()
  (ax,) = [ax for ax in figure.axes if ax.get_visible()]
  boxes = [text.get_window_extent() for text in ax.texts if text.get_visible()]
  assert len(boxes) >= 2
  assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))


def test_coinciding_series_stay_visible(tmp_path, figures):
  # at T = 0 greedy SpecDecode and its lossy variant measure the same point: the one below must show around
  records = [_large(20.0, temperature=0.0),
             _record("SpecDecode", 21.0, 0.7, rule="spec", alpha=None, temperature=0.0),
             _record("SpecDecode [Lossy]", 21.0, 0.7, temperature=0.0),
             _record("SpecCascade [Chow]", 19.0, 0.4, rule="chow", temperature=0.0)]
  figure = _figure_4(records, tmp_path, figures)
  (ax,) = [ax for ax in figure.axes if ax.get_visible()]
  spec, lossy = ax.lines[:2]   # in drawing order
  assert (spec.get_label(), lossy.get_label()) == ("SpecDecode", "SpecDecode [Lossy]")
  # SpecDecode's marker is covered: a wider one of its colour rings it, under SpecDecode [Lossy]'s
  (ring,) = [c for c in ax.collections if [tuple(xy) for xy in c.get_offsets()] == [(0.7, 21.0)]]
  assert matplotlib.colors.same_color(ring.get_facecolor(), spec.get_color())
  assert ring.get_sizes()[0] > lossy.get_markersize() ** 2 and ring.get_zorder() < lossy.get_zorder()


def test_tables_explain_their_dashes():
  records = [_large(20.0), _record("A", 19.0, 0.5), _record("B", 21.0, 1.2, rule="opt")]
  table = pareto.table2_markdown(records)
  assert "| A | — |" in table and "| B | 0.83× (α=0.1, latency 1.20) | — |" in table
  assert table.rstrip().endswith("\n\n—: in the speed-up column, no measured point reaches the large model's "
                                 "quality; in the best BLEU column, every measured point is slower than the large "
                                 "model.")
  assert "—:" not in pareto.table2_markdown([_large(20.0), _record("A", 21.0, 0.5)])
