"""The benchmark harness (specdec.evaluation.bench) and `specdec-bench`: the interleaved protocol's order and
sums, before/after matching, score costs after a prefix, the record files, and the command end to end (one
subcommand, and a before/after of HEAD against this checkout)."""

import json
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from specdec.cli import bench as bench_cli
from specdec.evaluation import bench
from tests.toy_models import PositionalTrigram


def test_interleaved_times_every_run_on_an_item_before_the_next_item(monkeypatch):
  clock, calls = [0.0], []
  monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

  def run(index: int, cost: float):
    def call(item, trial):
      calls.append((index, item, trial))
      clock[0] += cost * (item + 1)   # a run's time on an item: its cost × (item + 1)
      return jnp.asarray(item)
    return call

  seen = []
  seconds = bench.interleaved([run(0, 1.0), run(1, 10.0)], [0, 1, 2], trials=2, warmup=[2],
                              on_output=lambda i, j, out: seen.append((i, j, int(out))))
  warmup, timed = calls[:2], calls[2:]
  assert warmup == [(0, 2, 0), (1, 2, 0)]                     # each run once on each warm-up item, untimed
  assert timed == [(i, item, trial) for trial in (0, 1) for item in (0, 1, 2) for i in (0, 1)]
  np.testing.assert_allclose(seconds, [[2.0, 4.0, 6.0], [20.0, 40.0, 60.0]])   # summed over the 2 trials
  assert seen == [(i, j, j) for _ in (0, 1) for j in (0, 1, 2) for i in (0, 1)]


def test_compare_matches_rows_by_keys_and_takes_each_sides_median():
  def record(*rows):
    return {"keys": ["case", "batch"], "rows": list(rows)}
  before = [record({"case": "a", "batch": 1, "ms": 4.0, "label": "x"}, {"case": "gone", "batch": 1, "ms": 1.0}),
            record({"case": "a", "batch": 1, "ms": 6.0}), record({"case": "a", "batch": 1, "ms": 100.0})]
  after = [record({"case": "a", "batch": 1, "ms": 2.0, "mib": 3}, {"case": "new", "batch": 1, "ms": 1.0}),
           record({"case": "a", "batch": 1, "ms": 3.0})]
  assert bench.compare(before, after) == [
      {"case": "a", "batch": 1, "figure": "ms", "before": 6.0, "after": 2.5, "before / after": 2.4}]


def test_score_seconds_times_each_width_after_a_cache_of_the_prefix():
  model = PositionalTrigram.random(seed=0, vocab_size=8, max_length=32)
  cache = bench.cache_after(model, batch=3, prefix=5, room=4)
  np.testing.assert_array_equal(cache.lengths, [5, 5, 5])
  assert cache.kv.shape == (3, 9)
  seconds = bench.score_seconds(model, (1, 4), batch=3, prefix=5, repeats=2)
  assert set(seconds) == {1, 4} and all(t > 0 for t in seconds.values())


def test_a_record_is_written_as_json_and_markdown_under_one_header(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECDEC_CPU_KERNEL", "0")   # a variable that changes what is measured is recorded
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv("JAX_DEFAULT_MATMUL_PRECISION", raising=False)
  record = bench.new_record("demo", "specdec-bench demo --x 1", keys=("case",), x=1)
  assert record["machine"]["environment"] == {"SPECDEC_CPU_KERNEL": "0"}
  record["rows"].append({"case": "a", "ms": 1.5})
  bench.write_record(record, tmp_path / "out" / "demo", bench.markdown_table(record["rows"]))
  assert json.loads((tmp_path / "out" / "demo.json").read_text())["rows"] == [{"case": "a", "ms": 1.5}]
  text = (tmp_path / "out" / "demo.md").read_text()
  assert text.startswith("machine: cpu") and "command: `specdec-bench demo --x 1`" in text
  assert "\nenvironment: SPECDEC_CPU_KERNEL=0\n" in text
  assert "| a | 1.5 |" in text and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["demo.json", "demo.md"]


SCORE = ["score", "--models", "tiny", "--vocab", "64", "--widths", "1", "3", "--prefix", "4", "--repeats", "1"]


def test_bad_options_name_the_option():
  with pytest.raises(ValueError, match="--batch must be >= 1"):
    bench_cli.main(["decoding", "--batch", "0"])
  with pytest.raises(SystemExit):   # argparse: an unknown subcommand
    bench_cli.main(["nonsense"])


def test_before_after_runs_each_side_in_its_own_tree_and_tables_every_figure(tmp_path):
  """`specdec-bench --before HEAD score …`: the score subcommand run in a worktree of HEAD and in this checkout,
  each in a process of its own."""
  inside = subprocess.run(["git", "-C", str(bench.REPO_ROOT), "rev-parse", "HEAD"], capture_output=True)
  if inside.returncode:
    pytest.skip("not a git checkout: no revision to compare with")
  record = bench_cli.main(["--before", "HEAD", "--rounds", "1", *SCORE, "--out", str(tmp_path / "ba")])
  assert {(r["model"], r["n"], r["figure"]) for r in record["rows"]} == {
      ("tiny", n, figure) for n in (1, 3) for figure in ("ms", "relative", "params")}
  assert all(r["before"] > 0 and r["after"] > 0 for r in record["rows"])
  after = record["runs"]["after"][0]
  assert after["command"].startswith("specdec-bench " + " ".join(SCORE)) and after["keys"] == ["model", "batch", "n"]
  assert [(r["model"], r["n"], r["relative"] == 1.0) for r in after["rows"]] == [("tiny", 1, True), ("tiny", 3, False)]
  assert "| tiny | 1 | 1 | ms |" in (tmp_path / "ba.md").read_text()
  head = inside.stdout.decode().strip()
  assert record["runs"]["before"][0]["commit"].startswith(head)                  # the worktree of HEAD
  assert record["runs"]["after"][0]["commit"].startswith(head)
  worktrees = subprocess.run(["git", "-C", str(bench.REPO_ROOT), "worktree", "list"], capture_output=True, text=True)
  assert "specdec_before_" not in worktrees.stdout                              # removed afterwards
