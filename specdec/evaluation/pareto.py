"""Pareto frontiers, the paper's Table 2 and its Figure 3 / Figure 4 plots, from sweep results (§6, App. F).

Records (`sweep.run`'s JSON lines) are grouped by run context (pair, task, settings), temperature and
top-P; in a group, the verifier alone is the large model, the drafter alone the small one, and every other
record belongs to a series: its family, split by γ or BiLD's α_f when the family sweeps several.

Table 2 (one table per group, relative latency = seconds per example / the large model's):
  latency↓ when matching the large model's quality: 1 / the smallest relative latency among the series'
      points whose quality ≥ the large model's (a speed-up factor, as the paper's "1.55×"; < 1 is slower);
  best quality without exceeding the large model's latency: the largest quality among the points with
      relative latency ≤ 1.
Both use measured operating points only, with exact comparisons: no interpolation along the frontier,
since a point between two α values is not a run anyone measured (the paper reports "the lowest latency at
which quality matches"). "—" when no point qualifies.
"""

from __future__ import annotations

import dataclasses
import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)

from specdec import decoding, targets  # noqa: E402
from specdec.evaluation.results import read_results  # noqa: E402

Record = dict[str, Any]

# Where each method's series sit in tables and legends (Table 2's row order: SpecDecode / SpecCascade rows
# first, the cascade and token rules after the BiLD variants), from its parameters. A method not listed
# here comes last. Speculative rules sit in their registration order (the papers' tables), the rules up to
# BiLD* before the BiLD method and the rest after it.
def _speculative_row(rule: str) -> float:
  index, bild = list(targets.RULES).index(rule), list(targets.RULES).index("bild")
  return 2 + 0.1 * index if index <= bild else 4 + 0.1 * index


SERIES_ORDER: dict[str, Callable[[Mapping[str, Any]], float]] = {
    "autoregressive": lambda p: -1,
    "seq_cascade": lambda p: 0,
    "token_cascade": lambda p: 1 + 0.01 * list(targets.RULES).index(p["rule"]),
    "speculative": lambda p: _speculative_row(p["rule"]),
    "cs_drafting": lambda p: 2.05,
    "confidence_stop": lambda p: 2.06,
    "specdec_pp": lambda p: 2.07,
    "spectr": lambda p: 2.08,
    "specinfer": lambda p: 2.09,
    "dynamic_tree": lambda p: 2.095,
    "bild": lambda p: 3,
    "oracle_cascade": lambda p: 6,
}
# The symbols that label series differing in a parameter ("SpecDecode [γ=3]"), in this order; a parameter
# not listed here does not split a family's legend entry.
SYMBOLS = {"gamma": "γ", "fallback_alpha": "α_f", "model_drafts": "k_m", "lower_gamma": "k_l", "gate": "g",
           "max_gamma": "Γ", "num_drafts": "K"}


def frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
  """The Pareto-optimal (cost, quality) pairs, by increasing cost: those no other pair beats with cost ≤
  and quality ≥ (one strict). Cost is relative latency or rejection rate; quality is higher-better."""
  best, optimal = -math.inf, []
  for cost, quality in sorted(points, key=lambda pair: (pair[0], -pair[1])):
    if quality > best:
      optimal.append((cost, quality))
      best = quality
  return optimal


@dataclasses.dataclass
class Group:
  """The records of one (context, temperature, top-P): the large and small models alone and the series."""
  title: str
  metric: str
  large: Record | None
  small: Record | None
  series: dict[str, list[Record]]


def _model_name(identity: dict[str, Any]) -> str:
  if "path" in identity:
    return os.path.basename(os.path.normpath(identity["path"]))
  return f"{identity['preset']} (seed {identity['seed']})"


def _series_names(records: list[Record]) -> list[str]:
  """Family names, suffixed with a parameter's symbol and value (γ, α_f: `SYMBOLS`) where that family
  holds several values of it among `records`."""
  values: dict[tuple[str, str], set] = {}
  for r in records:
    for name in SYMBOLS:
      values.setdefault((r["family"], name), set()).add(r["point"].get(name))
  return [r["family"] + "".join(f" [{symbol}={r['point'][name]}]" for name, symbol in SYMBOLS.items()
                                if len(values[r["family"], name]) > 1) for r in records]


def _series_rank(named: tuple[str, Record]) -> tuple[float, str]:
  """Table 2's row order (`SERIES_ORDER`), then the name."""
  name, record = named
  method = decoding.METHODS.get(record["point"]["method"])
  if method is None or method.name not in SERIES_ORDER:
    return math.inf, name
  stored = record["point"]
  return SERIES_ORDER[method.name]({p.name: p.default if stored.get(p.name) is None else stored[p.name]
                                    for p in method.params}), name


def group_records(records: Sequence[Record], *, name_over_all: bool = False) -> list[Group]:
  """Groups records (the last record of each hash wins), in order of first appearance; series in the
  paper's row order (Table 2), then by name. A series' name says its γ (α_f, …) where its family holds
  several values in the group (a table's rows), or with `name_over_all` in all the records (the plots: a
  family whose γ differs between panels, γ=3 at T=1 and γ=5 at T=0, says so in each legend, and a series
  keeps one name, and so one style, in every panel)."""
  unique = list({r["hash"]: r for r in records}.values())
  # The models alone (autoregressive) are reference points; every other method is a series.
  alone = lambda r: r["point"]["method"] == "autoregressive"
  pair = [r for r in unique if not alone(r)]
  names = {r["hash"]: name for r, name in zip(pair, _series_names(pair))} if name_over_all else {}
  keys: dict[tuple, list[Record]] = {}
  for r in unique:
    keys.setdefault((r["context_hash"], r["point"]["temperature"], r["point"]["top_p"]), []).append(r)
  groups = []
  for (context_hash, temperature, top_p), members in keys.items():
    context = members[0]["context"]
    by_model = {r["point"]["model"]: r for r in members if alone(r)}
    series: dict[str, list[Record]] = {}
    in_group = [r for r in members if not alone(r)]
    named = [names[r["hash"]] for r in in_group] if name_over_all else _series_names(in_group)
    for name, r in sorted(zip(named, in_group), key=_series_rank):
      series.setdefault(name, []).append(r)
    title = (f"{context['task']}: {_model_name(context['drafter'])} → {_model_name(context['verifier'])}, "
             f"T={temperature:g}, top-P={top_p:g}")
    siblings = {key[0]: ms[0]["context"] for key, ms in keys.items() if key[1:] == (temperature, top_p)}
    if len(siblings) > 1:  # runs with other settings share this title: say what differs
      title += f" [{_differences(context, list(siblings.values()))}]"
    groups.append(Group(title=title, metric=members[0]["metric"], large=by_model.get("verifier"),
                        small=by_model.get("drafter"), series=series))
  return groups


def _flat(context: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in context.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f"{prefix}{key}."))
    else:
      flat[prefix + key] = value
  return flat


def _differences(context: dict[str, Any], others: list[dict[str, Any]]) -> str:
  """The settings of `context` in which runs that share its title differ (e.g. "n_examples=500")."""
  flats = [_flat(c) for c in others]
  mine = _flat(context)
  keys = sorted({k for f in flats for k in f if len({repr(g.get(k)) for g in flats}) > 1})
  return ", ".join(f"{k}={mine.get(k)}" for k in keys) or "same settings, another run"


@dataclasses.dataclass
class Table2Row:
  """One method's Table 2 entries; the points chosen are kept for reference (None: none qualifies)."""
  name: str
  matching: Record | None   # the fastest point with quality ≥ the large model's
  best: Record | None       # the best-quality point with relative latency ≤ 1

  @property
  def speedup(self) -> float | None:
    return None if self.matching is None else 1.0 / self.matching["relative_latency"]


def table2_rows(group: Group) -> list[Table2Row]:
  """Table 2 for one group: the small model first, then the series (in the paper's row order)."""
  if group.large is None:
    raise ValueError(f"{group.title}: no record of the verifier alone, the reference of Table 2")
  candidates = ([("Small (drafter)", [group.small])] if group.small else []) + list(group.series.items())
  rows = []
  for name, records in candidates:
    matching = [r for r in records if r["quality"] >= group.large["quality"]]
    within = [r for r in records if r["relative_latency"] <= 1.0]
    rows.append(Table2Row(name=name, matching=min(matching, key=lambda r: r["relative_latency"], default=None),
                          best=max(within, key=lambda r: r["quality"], default=None)))
  return rows


METRIC_NAMES = {"bleu": "BLEU", "rouge2": "ROUGE-2", "log_likelihood": "log-likelihood (nats/token)",
                "exact_match": "exact match", "f1": "F1", "gsm8k_exact_match": "GSM8K exact match",
                "pass_at_1": "pass@1"}


def _parameters(record: Record) -> str:
  alpha = record["point"]["alpha"]
  latency = f"latency {record['relative_latency']:.2f}"
  return f" (α={alpha:g}, {latency})" if alpha is not None else f" ({latency})"


def _interval(record: Record, key: str, transform=lambda x: x) -> str:
  """" [lo, hi]" of a record's bootstrap interval (`<key>_interval`), through a monotone `transform`;
  empty for records written before intervals existed."""
  interval = record.get(f"{key}_interval")
  if interval is None:
    return ""
  lo, hi = sorted(transform(x) for x in interval)
  return f" [{lo:.2f}, {hi:.2f}]"


def table2_markdown(records: Sequence[Record]) -> str:
  """The paper's Table 2 as Markdown, one table per group (see the module docstring for definitions)."""
  sections = []
  for group in group_records(records):
    large, metric = group.large, group.metric
    lines = [f"### {group.title}", ""]
    if large is None:
      sections.append("\n".join(lines + ["No record of the verifier alone: Table 2 needs it.", ""]))
      continue
    name = METRIC_NAMES.get(metric, metric)
    lines += [f"Large model (verifier alone): {name} {large['quality']:.2f}{_interval(large, 'quality')}, "
              f"{large['seconds_per_example'] * 1e3:.1f} ms per example (batch 1). Brackets: bootstrap 95 % "
              "intervals over examples.", "",
              f"| method | speed-up↑ when matching the large model's quality | best {name} without exceeding "
              f"the large model's latency |", "|---|---|---|"]
    rows = table2_rows(group)
    for row in rows:
      matching = ("—" if row.matching is None else f"{row.speedup:.2f}×"
                  f"{_interval(row.matching, 'relative_latency', lambda x: 1.0 / x)}{_parameters(row.matching)}")
      best = ("—" if row.best is None else
              f"{row.best['quality']:.2f}{_interval(row.best, 'quality')}{_parameters(row.best)}")
      lines.append(f"| {row.name} | {matching} | {best} |")
    if any(row.matching is None or row.best is None for row in rows):
      lines += ["", f"—: in the speed-up column, no measured point reaches the large model's quality; in the best "
                f"{name} column, every measured point is slower than the large model."]
    sections.append("\n".join(lines + [""]))
  return "\n".join(sections)


def multi_draft_methods() -> list[str]:
  """The methods that draft several drafts per block (a `num_drafts` parameter): SpecTr's table's."""
  return [name for name, method in decoding.METHODS.items() if any(p.name == "num_drafts" for p in method.params)]


def multi_draft_markdown(records: Sequence[Record]) -> str:
  """SpecTr's Table 2 layout, one table per group: per method and draft length L = γ, for each number of
  drafts K (K = 1 is SpecDecode, except for DynamicTree, whose one beam is a greedy chain): tokens per
  serial verifier call, latency relative to SpecDecode at the same L (batch 1; < 1 is faster), and verifier
  positions scored per token (the price of K drafts)."""
  names = {"speculative": "SpecDecode", "spectr": "SpecTr", "specinfer": "SpecInfer", "dynamic_tree": "DynamicTree"}
  sections = []
  for group in group_records(records):
    members = [r for rs in group.series.values() for r in rs if r["point"]["method"] in names
               and (r["point"]["rule"] is None or targets.get_rule(r["point"]["rule"]).lossless)]
    if not any(r["point"]["method"] in multi_draft_methods() for r in members):
      continue
    spec = {r["point"]["gamma"]: r for r in members if r["point"]["method"] == "speculative"}
    drafts = sorted({r["point"].get("num_drafts") or 1 for r in members})
    lines = [f"### {group.title}", "", "Cells: tokens per verifier call · latency relative to SpecDecode at the "
             "same L · verifier positions per token.", "",
             "| method | L | " + " | ".join(f"K={k}" for k in drafts) + " |", "|---|---|" + "---|" * len(drafts)]
    rows = []
    for method, name in names.items():
      for gamma in sorted({r["point"]["gamma"] for r in members}):
        by_k = {r["point"].get("num_drafts") or 1: r for r in members
                if r["point"]["method"] == method and r["point"]["gamma"] == gamma}
        if not by_k:
          continue
        if gamma in spec and method != "dynamic_tree":   # one beam is a greedy chain, not SpecDecode
          by_k.setdefault(1, spec[gamma])
        rows.append(f"| {name} | {gamma} | " + " | ".join(
            _multi_draft_cell(by_k.get(k), spec.get(gamma)) for k in drafts) + " |")
    lines += rows
    if any("—" in row for row in rows):
      lines += ["", "—: as a whole cell, no run of the method at that L and K; as the latency, no SpecDecode run "
                "at that L to compare with; as the positions, a run recorded before that counter existed."]
    sections.append("\n".join(lines + [""]))
  return "\n".join(sections)


def _multi_draft_cell(record: Record | None, spec: Record | None) -> str:
  if record is None:
    return "—"
  relative = "—" if spec is None else f"{record['relative_latency'] / spec['relative_latency']:.2f}×"
  positions = record["costs"].get("verifier_positions_per_token")
  return (f"{record['costs']['tokens_per_verifier_call']:.2f} · {relative} · "
          + ("—" if positions is None else f"{positions:.1f}"))


def _axes(n: int) -> tuple[plt.Figure, list[plt.Axes]]:
  columns = min(n, 2)
  rows = math.ceil(n / columns)
  # at the saved resolution: overlaps are settled in display coordinates before saving
  figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.5 * rows), dpi=120, squeeze=False)
  for extra in axes.flat[n:]:
    extra.set_visible(False)
  return figure, list(axes.flat[:n])


_MARKERS = "osD^vP*Xh<>p"
_LINE_STYLES = ("-", "--", ":", "-.")
_MARKER_SIZE = 5.0   # points; a series' frontier markers
_MARKER_STEP = 3.0   # points wider per later series drawn over a marker (its ring)
_LABEL_OFFSETS = ((3, 3), (3, -9))   # an α label above-right of its point, else below-right


def _styles(groups: Sequence[Group]) -> dict[str, tuple[Any, str, str]]:
  """(colour, marker, line style) per series name across every panel and both figures: one colour and
  marker per method (family), in Table 2's order; a method's variants (γ=1, γ=5, …) differ in line style."""
  family = {name: records[0]["family"] for group in groups for name, records in group.series.items()}
  families = list(dict.fromkeys(family.values()))
  colours = plt.get_cmap("tab20" if len(families) > 10 else "tab10").colors
  styles = {}
  for name, method in family.items():
    i = families.index(method)
    variant = sum(family[other] == method for other in styles)   # this method's series styled so far
    styles[name] = (colours[i % len(colours)], _MARKERS[i % len(_MARKERS)], _LINE_STYLES[variant % len(_LINE_STYLES)])
  return styles


def _error(records: list[Record], key: str, values: list[float]) -> list[list[float]] | None:
  """Asymmetric error bars [[below…], [above…]] from `<key>_interval`, or None when a record has none."""
  intervals = [r.get(f"{key}_interval") for r in records]
  if any(i is None for i in intervals):
    return None
  return [[max(v - i[0], 0.0) for v, i in zip(values, intervals)],
          [max(i[1] - v, 0.0) for v, i in zip(values, intervals)]]


def _ring_covered_markers(lines: list[plt.Line2D], dpi: float) -> None:
  """Under each frontier marker that series drawn later cover (a marker of theirs within a marker's width on
  screen), a larger one, a step per such series: coinciding series (at T = 0 SpecDecode and SpecDecode
  [Lossy]) show as rings around the marker on top instead of hiding under it."""
  width = _MARKER_SIZE * dpi / 72   # in pixels
  centres = [line.get_transform().transform(line.get_xydata()) for line in lines]
  for i, line in enumerate(lines):
    over = [sum(any(math.dist(a, b) < width for b in later) for later in centres[i + 1:]) for a in centres[i]]
    covered = [(xy, n) for xy, n in zip(line.get_xydata(), over) if n]
    if covered:
      points, counts = zip(*covered)
      line.axes.scatter(*zip(*points), s=[(_MARKER_SIZE + _MARKER_STEP * n) ** 2 for n in counts],
                        marker=line.get_marker(), color=line.get_color(), zorder=line.get_zorder() - 0.1)


def _place_labels(labels: list[plt.Annotation]) -> None:
  """Puts each α label at the first offset where it overlaps no label placed before it, and drops it where
  none is free: nearby frontier points would pile their labels up."""
  placed = []
  for label in labels:
    for offset in _LABEL_OFFSETS:
      label.xyann = offset
      box = label.get_window_extent()
      if not any(box.overlaps(other) for other in placed):
        placed.append(box)
        break
    else:
      label.remove()


def _plot_groups(groups: Sequence[Group], path: str | os.PathLike, cost, cost_label: str, *,
                 latency: bool, styles: dict[str, tuple[Any, str, str]]) -> None:
  """One panel per group: per series its measured points with error bars, the Pareto frontier as a line,
  α on the frontier points where labels do not overlap; the large model's quality as a dotted line (and, on
  the latency axis, x = 1 and both models alone as markers)."""
  if not groups:
    raise ValueError("no records to plot")
  figure, axes = _axes(len(groups))
  drawn = []   # per panel: its frontier lines and α labels, in drawing order
  for ax, group in zip(axes, groups):
    lines, labels = [], []
    for name, members in group.series.items():
      members = [r for r in members if cost(r) is not None]
      if not members:
        continue
      colour, marker, line_style = styles[name]
      xs, ys = [cost(r) for r in members], [r["quality"] for r in members]
      ax.errorbar(xs, ys, yerr=_error(members, "quality", ys),
                  xerr=_error(members, "relative_latency", xs) if latency else None, fmt="none", ecolor=colour,
                  alpha=0.35, linewidth=0.8)
      optimal = frontier(list(zip(xs, ys)))
      lines += ax.plot(*zip(*optimal), marker=marker, markersize=_MARKER_SIZE, color=colour, linestyle=line_style,
                       label=name)
      ax.scatter([x for x, y in zip(xs, ys) if (x, y) not in optimal],
                 [y for x, y in zip(xs, ys) if (x, y) not in optimal], s=12, marker=marker, color=colour, alpha=0.35)
      alphas = {(x, y): r["point"]["alpha"] for r, x, y in zip(members, xs, ys) if r["point"].get("alpha") is not None}
      labels += [ax.annotate(f"{alphas[xy]:g}", xy, textcoords="offset points", xytext=_LABEL_OFFSETS[0], fontsize=6,
                             color=colour) for xy in optimal if xy in alphas]
    if group.large is not None:
      ax.axhline(group.large["quality"], color="black", linestyle=":", linewidth=1,
                 label=None if latency else "Large (verifier)")   # on the latency axis its marker has the entry
    if latency:
      ax.axvline(1.0, color="grey", linestyle="--", linewidth=0.8)
      for record, marker, name in ((group.small, "*", "Small (drafter)"), (group.large, "s", "Large (verifier)")):
        if record is not None:
          ax.errorbar([record["relative_latency"]], [record["quality"]],
                      yerr=_error([record], "quality", [record["quality"]]), fmt=marker, markersize=9,
                      color="black", label=name, zorder=3)
    low, high = ax.dataLim.intervaly
    if high - low < 1e-9 * max(1.0, abs(high)):   # one quality for all (0 on random models): a readable axis,
      pad = max(0.05, 0.05 * abs(high))           # not matplotlib's 1e-17 wide one
      ax.set_ylim(low - pad, high + pad)
    ax.set_title(textwrap.fill(group.title, 80), fontsize=9)   # long pair names would run off the panel
    ax.set_xlabel(cost_label)
    ax.set_ylabel(METRIC_NAMES.get(group.metric, group.metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    drawn.append((lines, labels))
  figure.tight_layout()
  figure.canvas.draw()   # settles the axis limits and the layout, hence where everything lands on screen
  for lines, labels in drawn:
    _ring_covered_markers(lines, figure.dpi)
    _place_labels(labels)
  figure.savefig(path)
  plt.close(figure)


def plot_latency(records: Sequence[Record], path: str | os.PathLike) -> None:
  """Figure 4: quality vs latency relative to the large model, one line per method along its frontier
  (α labels, 95 % intervals as error bars), the models alone as markers, the large model's quality as a
  dotted line and its latency (x = 1) dashed; one panel per group."""
  groups = group_records(records, name_over_all=True)
  _plot_groups(groups, path, lambda r: r["relative_latency"], "latency relative to the large model",
               latency=True, styles=_styles(groups))


def _draft_rejection_rate(record: Record) -> float | None:
  """Rejected draft tokens / draft tokens (records without it: from their counters)."""
  costs, counters = record["costs"], record.get("counters", {})
  if "draft_rejection_rate" in costs:
    return costs["draft_rejection_rate"]
  drafted = counters.get("drafted")
  return (drafted - counters["accepted"]) / drafted if drafted else None


def plot_rejection(records: Sequence[Record], path: str | os.PathLike) -> None:
  """Figure 3: quality vs the paper's rejection rate (rejected draft tokens / draft tokens) for the methods
  that draft, frontier lines, the large model's quality as a dotted line; one panel per group and γ (the
  paper's figure is at γ = 1)."""
  # styled from all the records' series, as plot_latency is: a method keeps its colour in both figures
  _plot_groups(rejection_panels(records), path, _draft_rejection_rate,
               "rejection rate (rejected draft tokens / draft tokens)", latency=False,
               styles=_styles(group_records(records, name_over_all=True)))


def rejection_panels(records: Sequence[Record]) -> list[Group]:
  """Figure 3's panels: each group split by γ."""
  panels = []
  for group in group_records(records, name_over_all=True):
    gammas = sorted({r["point"]["gamma"] for rs in group.series.values() for r in rs
                     if r["point"].get("gamma") is not None})
    for gamma in gammas:
      series = {name: [r for r in rs if r["point"].get("gamma") == gamma] for name, rs in group.series.items()}
      panels.append(dataclasses.replace(group, title=f"{group.title}, γ={gamma}",
                                        series={name: rs for name, rs in series.items() if rs}))
  return panels


def report(results: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, str]:
  """Writes pareto.png (Figure 4), rejection.png (Figure 3) and table.md (Table 2) from a results file, and
  multi_draft.md (SpecTr's Table 2 layout) when it holds multi-draft runs."""
  if not os.path.exists(results):
    raise FileNotFoundError(f"no such file: {results}")
  records = read_results(results)
  os.makedirs(out_dir, exist_ok=True)
  paths = {name: os.path.join(out_dir, name) for name in ("pareto.png", "rejection.png", "table.md")}
  plot_latency(records, paths["pareto.png"])
  plot_rejection(records, paths["rejection.png"])
  with open(paths["table.md"], "w") as f:
    f.write(table2_markdown(records))
  multi_draft = multi_draft_markdown(records)
  if multi_draft:
    paths["multi_draft.md"] = os.path.join(out_dir, "multi_draft.md")
    with open(paths["multi_draft.md"], "w") as f:
      f.write(multi_draft)
  return paths
