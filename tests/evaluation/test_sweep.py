"""Sweeps (specdec.evaluation.grid, sweep and results; scripts/sweep.py): grids, validation before
compute, the JSONL store, resuming a killed run. Runs on random `tiny` models over the shipped vocabulary
and sample (configs/experiments/smoke.gin): the machinery, not the methods."""

import dataclasses
import hashlib
import json
import math
import pathlib

import gin
import pytest

from specdec.evaluation import grid, results, sweep
from tests.sweeps import SMOKE, load_script, outcomes, smoke

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE_POINTS = 6  # small model, large model, 2 families × 2 α


def _lines(path):
  return pathlib.Path(path).read_text().splitlines()


@pytest.fixture(scope="module")
def complete(tmp_path_factory):
  """An uninterrupted smoke sweep through scripts/sweep.py: (results path, records)."""
  output = tmp_path_factory.mktemp("complete") / "results.jsonl"
  gin.clear_config()
  try:
    records = load_script("sweep").main([f"--gin_file={SMOKE}", f"--gin_bindings=Experiment.output = '{output}'"])
  finally:
    gin.clear_config()
  return output, records


def test_smoke_sweep_writes_one_valid_record_per_point(complete):
  output, records = complete
  stored = [json.loads(line) for line in _lines(output)]
  assert len(stored) == len(records) == SMOKE_POINTS
  assert len({r["hash"] for r in stored}) == SMOKE_POINTS
  by_family = {}
  for r in stored:
    by_family.setdefault(r["family"], []).append(r)
    assert r["metric"] == "rouge2" and 0.0 <= r["quality"] <= 100.0
    assert r["context"]["task"] == "debian_synopsis" and r["context"]["max_new_tokens"] == 8
    assert r["seeds"] == {"sweep": 0, "drafter": 1, "verifier": 2}
    assert r["git_commit"] and r["device"].startswith("cpu")
    assert r["counters"]["generated"] > 0 and r["seconds_per_example"] > 0
    assert math.isclose(r["relative_latency"], r["seconds_per_example"] / r["baseline"]["seconds_per_example"])
    assert r["hash"] == results.digest({"point": r["point"], "context": r["context"]})
  assert sorted(by_family) == ["Large (verifier)", "Small (drafter)", "SpecCascade [Token]", "SpecDecode [Lossy]"]
  (large,) = by_family["Large (verifier)"]
  assert large["relative_latency"] == 1.0 and large["baseline"]["hash"] == large["hash"]
  assert large["point"] == {"method": "autoregressive", "model": "verifier", "rule": None, "alpha": None,
                            "gamma": None, "temperature": 1.0, "top_p": 1.0, "fallback_alpha": None}
  assert large["costs"]["verifier_calls_per_token"] == 1.0 and large["costs"]["rejection_rate"] is None
  (small,) = by_family["Small (drafter)"]
  assert small["costs"]["drafter_calls_per_token"] == 1.0 and small["counters"]["verifier_calls"] == 0
  lossy = by_family["SpecDecode [Lossy]"]
  assert sorted(r["point"]["alpha"] for r in lossy) == [0.1, 0.5]
  assert all(r["point"]["gamma"] == 3 and r["costs"]["rejection_rate"] is not None for r in lossy)


def test_rerun_of_a_finished_sweep_runs_and_writes_nothing(complete, monkeypatch):
  output, records = complete
  before = pathlib.Path(output).read_bytes()
  monkeypatch.setattr(sweep, "run_point", _forbidden)
  assert sweep.run(smoke(output), progress=False) == records
  assert pathlib.Path(output).read_bytes() == before


def _forbidden(*args, **kwargs):
  raise AssertionError("nothing should run")


class Killed(Exception):
  pass


def _dies_after(n: int, monkeypatch) -> tuple[list, object]:
  """Makes `sweep.run_point` raise Killed once n points ran; returns (the points run, the real run_point)."""
  real_run_point, calls = sweep.run_point, []

  def dies(point, workload):
    if len(calls) == n:
      raise Killed
    calls.append(point)
    return real_run_point(point, workload)

  monkeypatch.setattr(sweep, "run_point", dies)
  return calls, real_run_point


def test_killed_sweep_resumes_without_losing_or_duplicating(complete, tmp_path, monkeypatch):
  output = tmp_path / "results.jsonl"
  experiment = smoke(output)
  calls, real_run_point = _dies_after(3, monkeypatch)
  with pytest.raises(Killed):
    sweep.run(experiment, progress=False)
  assert len(_lines(output)) == 3
  monkeypatch.setattr(sweep, "run_point", real_run_point)
  resumed = sweep.run(experiment, progress=False)
  stored = [json.loads(line) for line in _lines(output)]
  assert len(stored) == SMOKE_POINTS and {r["hash"] for r in stored} == {r["hash"] for r in resumed}
  assert outcomes(stored) == outcomes(complete[1])


def test_truncated_last_line_is_dropped_and_its_point_rerun(complete, tmp_path, capsys):
  output = tmp_path / "results.jsonl"
  lines = _lines(complete[0])
  output.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:len(lines[-1]) // 2])
  assert [r["hash"] for r in results.read_results(output)] == [json.loads(line)["hash"] for line in lines[:-1]]
  assert f"results.jsonl:{len(lines)} left out" in capsys.readouterr().err   # the plots say so too
  sweep.run(smoke(output), progress=False)
  stored = [json.loads(line) for line in _lines(output)]
  assert len(stored) == SMOKE_POINTS
  assert outcomes(stored) == outcomes(complete[1])


def test_a_damaged_or_foreign_line_before_the_last_raises_naming_it(complete, tmp_path):
  output = tmp_path / "results.jsonl"
  first = _lines(complete[0])[0]
  output.write_text(f'{first}\n{{"hash": \n{first}\n')
  with pytest.raises(ValueError, match="results.jsonl:2 is not a JSON record"):
    results.read_results(output)
  output.write_text(f'{first}\n{first}\n{{"loss": 0.5, "step": 10}}\n')
  with pytest.raises(ValueError, match="results.jsonl:3 is not a sweep record \\(no hash, context_hash"):
    results.read_results(output)


def test_resume_is_announced_and_refused_across_code_versions_unless_asked(complete, tmp_path, capsys):
  output = tmp_path / "results.jsonl"
  lines = [json.loads(line) for line in _lines(complete[0])]
  for record in lines:
    record["code"] = "0123abc"
  output.write_text("".join(json.dumps(r) + "\n" for r in lines[:-2]))
  with pytest.raises(ValueError, match="recorded with code 0123abc .*allow_mixed_runs"):
    sweep.run(smoke(output), progress=True)
  sweep.run(smoke(output, "Experiment.allow_mixed_runs = True"), progress=True)
  assert f"resuming: {SMOKE_POINTS - 2} of {SMOKE_POINTS} points already done" in capsys.readouterr().err
  assert len(_lines(output)) == SMOKE_POINTS
  sweep.run(smoke(output, "Experiment.allow_mixed_runs = True"), progress=True)   # nothing left: no empty bar
  err = capsys.readouterr().err
  assert f"nothing to run: all {SMOKE_POINTS} points are already done" in err and "0point" not in err


def test_resume_is_keyed_on_the_package_code_not_the_commit(complete, tmp_path):
  """An edit to a gin file, a doc or a test makes the tree dirty (another git_commit) but leaves the
  `specdec` code, and so the measurement, unchanged: the run resumes. Records from before the code digest
  still resume on their own commit only."""
  output = tmp_path / "results.jsonl"
  lines = [json.loads(line) for line in _lines(complete[0])]
  assert lines[0]["code"] == results.code_digest()
  for record in lines:
    record["git_commit"] = "0123abc-dirty"
  output.write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]))
  assert len(sweep.run(smoke(output), progress=False)) == SMOKE_POINTS
  for record in lines:
    del record["code"]
  output.write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]))
  with pytest.raises(ValueError, match="recorded with commit 0123abc-dirty"):
    sweep.run(smoke(output), progress=False)


def test_hosts_split_the_grid_into_shards_that_merge_into_the_single_host_run(complete, tmp_path, monkeypatch):
  output = tmp_path / "results.jsonl"
  experiment = smoke(output)
  calls, real_run_point = _dies_after(1, monkeypatch)
  with pytest.raises(Killed):
    sweep.run(experiment, progress=False, host=(1, 2))      # host 1 of 2 dies after its first point
  monkeypatch.setattr(sweep, "run_point", real_run_point)
  assert len(sweep.run(experiment, progress=False, host=(0, 2))) == SMOKE_POINTS // 2 + 1
  shards = [results.host_shard(output, i, 2) for i in range(2)]
  assert results.result_files(output) == shards and not output.exists()
  assert [len(_lines(s)) for s in shards] == [SMOKE_POINTS // 2, 1]
  merged = sweep.run(experiment, progress=False, host=(1, 2))   # the rerun finishes host 1's block only
  assert [len(_lines(s)) for s in shards] == [SMOKE_POINTS // 2] * 2
  assert len(merged) == SMOKE_POINTS and outcomes(merged) == outcomes(complete[1])
  assert outcomes(results.read_results(output)) == outcomes(complete[1])


def test_intervals_and_figures_are_recomputable_from_the_stored_examples(complete):
  """Quality, relative latency and their bootstrap intervals come from the per-example data in the record."""
  from specdec.evaluation import metrics
  for r in complete[1]:
    statistics = r["examples"]["quality_statistics"]
    assert len(statistics) == 6 and math.isclose(metrics.from_statistics(r["metric"], statistics), r["quality"])
    seconds, baseline = r["examples"]["seconds"], r["examples"]["baseline_seconds"]
    assert len(seconds) == len(baseline) == r["context"]["n_latency_examples"]
    assert math.isclose(sum(seconds) / sum(baseline), r["relative_latency"])
    lo, hi = r["quality_interval"]
    assert lo <= r["quality"] <= hi
    lo, hi = r["relative_latency_interval"]
    assert lo <= r["relative_latency"] <= hi


@pytest.mark.parametrize("bindings, message", [
    (["lossy/Family.method = 'beam_search'"], "family 'SpecDecode \\[Lossy\\]': unknown method 'beam_search'"),
    (["lossy/Family.rule = 'fancy'"], "unknown rule 'fancy'"),
    (["lossy/Family.alphas = [0.5, 1.0]"], "alpha \\(rule 'lossy'\\) must lie in \\[0.0, 1.0\\); got \\[1.0\\]"),
    (["token_v3/Family.rule = 'chow_log'", "token_v3/Family.alphas = [-0.5]"],
     "alpha \\(rule 'chow_log', a threshold in nats\\) must lie in \\[0.0, inf\\)"),
    (["Experiment.gammas = [0]"], "gamma \\(the number of draft tokens per block\\) must be an int >= 1"),
    (["Experiment.temperatures = [1.0, -0.5]"], "temperature must lie in \\[0.0, inf\\)"),
    (["Experiment.top_ps = [1.5]"], "top_p must lie in \\(0.0, 1.0\\]"),
    (["lossy/Family.method = 'token_cascade'"], "chow or chow_log"),
    (["lossy/Family.alphas = 0.5"], "alphas must be a non-empty list"),
    (["small/Family.model = 'pair'"], "model must be 'drafter' or 'verifier'"),
    (["token_v3/Family.rule = 'lossy'"], "both contain the point"),
    (["Experiment.n_latency_examples = 10"], "n_latency_examples must lie in \\[1, n_examples=6\\]"),
    (["drafter/ModelSource.max_length = 58"], "max_length=58"),   # prompt 48 + 8 new + γ+1 = 4 overhang > 58
])
def test_bad_grids_are_rejected_before_compute(bindings, message, tmp_path, monkeypatch):
  output = tmp_path / "results.jsonl"
  monkeypatch.setattr(sweep.decoding, "generate", _forbidden)
  with pytest.raises(ValueError, match=message):
    sweep.run(smoke(output, *bindings), progress=False)
  assert not output.exists()


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO_ROOT / "configs" / "experiments").glob("*.gin")))
def test_every_experiment_config_expands_to_a_valid_grid(config):
  gin.clear_config()
  try:
    experiment = grid.parse_gin([f"configs/experiments/{config}"])
  finally:
    gin.clear_config()
  points = grid.expand_grid(experiment)
  assert sum(p.is_baseline for p in points) == len(experiment.temperatures) * len(experiment.top_ps)
  assert any(p.model == "pair" for p in points)


def test_every_method_of_the_comparison_is_expressible():
  gin.clear_config()
  try:
    experiment = grid.parse_gin(["configs/experiments/all_methods_synopsis.gin"])
  finally:
    gin.clear_config()
  runs = {(p.method, p.rule, p.model) for p in grid.expand_grid(experiment)}
  cascade_rules = ["chow", "chow_log", "diff", "diff_log", "opt", "opt_log", "token_v1", "token_v2", "token_v3"]
  assert runs >= {("autoregressive", None, "drafter"), ("autoregressive", None, "verifier"),
                  ("speculative", "spec", "pair"), ("speculative", "lossy", "pair"),
                  ("speculative", "lossy_tuned", "pair"), ("speculative", "bild", "pair"), ("bild", None, "pair"),
                  ("token_cascade", "chow", "pair"), ("seq_cascade", None, "pair"),
                  *[("speculative", rule, "pair") for rule in cascade_rules]}


def test_grid_points_are_canonical():
  experiment = grid.Experiment(
      drafter=grid.ModelSource(preset="tiny"), verifier=grid.ModelSource(preset="tiny"), task="debian_lm",
      families=[grid.Family("SD", "speculative", "spec", alphas=[0.0, 0.3]),
                grid.Family("Large", "autoregressive", alphas=[0.1, 0.2], gammas=[3, 5]),
                grid.Family("Seq", "seq_cascade", "chow", alphas=[0, 0.5])],
      temperatures=[1.0, 0.0], gammas=[5])
  points = grid.expand_grid(experiment)
  # Per temperature: SpecDecode once (α does not change it), the large model alone once (it ignores α and
  # γ, and is the temperature's baseline under the family's label), SeqCascade at 2 α (no rule, no γ).
  assert len(points) == 2 * (1 + 1 + 2)
  assert [p.family for p in points if p.is_baseline] == ["Large", "Large"]
  assert {(p.rule, p.alpha, p.gamma) for p in points if p.family == "SD"} == {("spec", None, 5)}
  assert {(p.rule, p.alpha, p.gamma) for p in points if p.family == "Seq"} == {(None, 0.0, None), (None, 0.5, None)}


def test_point_hash_is_the_digest_of_canonical_json_without_the_label():
  point = grid.baseline_point(1, 1.0)  # an int temperature is stored as a float
  renamed = dataclasses.replace(point, family="another label")
  canonical = (b'{"context": {"task": "debian_synopsis"}, "point": {"alpha": null, "fallback_alpha": null, '
               b'"gamma": null, "method": "autoregressive", "model": "verifier", "rule": null, '
               b'"temperature": 1.0, "top_p": 1.0}}')
  expected = hashlib.sha256(canonical).hexdigest()[:16]
  assert results.point_hash(point, {"task": "debian_synopsis"}) == expected == "cdb1553ee3067343"
  assert results.point_hash(renamed, {"task": "debian_synopsis"}) == expected


def test_lm_task_quality_is_the_verifiers_log_likelihood(tmp_path):
  experiment = grid.Experiment(
      drafter=grid.ModelSource(preset="tiny", seed=1, max_length=64),
      verifier=grid.ModelSource(preset="tiny", seed=2, max_length=64), task="debian_lm", source="sample",
      families=[], n_examples=3, batch_size=3, max_new_tokens=4, n_latency_examples=1, latency_trials=1,
      output=str(tmp_path / "results.jsonl"))
  with pytest.raises(ValueError, match="families must be a non-empty list"):
    sweep.run(experiment, progress=False)
  experiment = dataclasses.replace(experiment, families=[grid.Family("Small", "autoregressive", model="drafter"),
                                                        grid.Family("Large", "autoregressive")])
  records = sweep.run(experiment, progress=False)
  assert [r["family"] for r in records] == ["Large", "Small"]  # the listed verifier is the baseline
  assert records[0]["relative_latency"] == 1.0 and records[1]["baseline"]["hash"] == records[0]["hash"]
  # Random tiny models are near uniform over the 8192 pieces: log-likelihood ≈ −log 8192 = −9.01 nats.
  for r in records:
    assert r["metric"] == "log_likelihood" and -10.0 < r["quality"] < -8.0


def test_a_t5_pair_on_a_tfds_task_decodes_t5_prompts(tmp_path, monkeypatch):
  """The paper's setting in small: an encoder-decoder pair on a tfds task ('wmt_t2t_ende'; its records come
  from `seqio_tasks.tfds_records`, here in memory) gets T5's encoder inputs as prompts — the task prefix, no
  decoder-only separator — and the grid runs with BLEU against the references."""
  from specdec.data import seqio_tasks, tasks
  from specdec.data.vocab import load_vocabulary
  records = [{"en": f"The package {name} provides a small tool.", "de": f"Das Paket {name} stellt ein kleines "
              "Werkzeug bereit."} for name in ("kilo", "nano", "vim", "less")]
  asked = []

  def fake_tfds_records(name, split, *, data_dir=None, limit=None):
    asked.append((name, split, data_dir, limit))
    return records[:limit]

  monkeypatch.setattr(seqio_tasks, "tfds_records", fake_tfds_records)
  experiment = smoke(tmp_path / "t5.jsonl", "Experiment.task = 'wmt_t2t_ende'", "Experiment.n_examples = 4",
                      "Experiment.split = 'test'", "Experiment.tfds_data_dir = '/data/tfds'",
                      "drafter/ModelSource.preset = 't5_tiny'", "verifier/ModelSource.preset = 't5_tiny'",
                      "Experiment.families = [@token_v3/Family()]", "token_v3/Family.alphas = [0.5]")
  workload = sweep.load_workload(experiment)
  assert asked == [("specdec_wmt_t2t_ende", "test", "/data/tfds", 4)]
  want = [load_vocabulary().encode("translate English to German: " + r["en"]) + [1] for r in records]
  for prompt, length, ids in zip(workload.prompts, workload.prompt_lengths, want):
    assert prompt[:length].tolist() == ids
  assert workload.references == [r["de"] for r in records]
  done = sweep.run(experiment, progress=False)
  assert len(done) == 2 and {r["metric"] for r in done} == {"bleu"}   # the verifier alone, one SpecCascade
  with pytest.raises(ValueError, match="unknown task 'wmt'; local tasks: .*tfds tasks: wmt_t2t_ende"):
    sweep.run(smoke(tmp_path / "bad.jsonl", "Experiment.task = 'wmt'"), progress=False)
  with pytest.raises(ValueError, match="both be decoder-only or both encoder-decoder"):
    sweep.load_workload(smoke(tmp_path / "mixed.jsonl", "Experiment.task = 'wmt_t2t_ende'",
                               "verifier/ModelSource.preset = 't5_tiny'"))


def test_gemma_miniature_sweeps_few_shot_prompts_to_the_rejection_plot(tmp_path):
  """configs/experiments/miniature_gemma_synopsis.gin, two families at one α: a random gemma2_tiny pair on
  few-shot Debian synopses (prompts with their shots), γ = 1, through the sweep to Figure 3's plot."""
  from specdec.evaluation import pareto
  gin.clear_config()
  try:
    experiment = grid.parse_gin(["configs/experiments/miniature_gemma_synopsis.gin"], [
        f"Experiment.output = '{tmp_path}/results.jsonl'", "Experiment.families = [@lossy/Family(), @token_v3/Family()]",
        "PROBABILITY_ALPHAS = [0.5]", "Experiment.n_examples = 4", "Experiment.batch_size = 1",
        "Experiment.n_latency_examples = 1"])   # batch 1: the latency examples' program, compiled once
  finally:
    gin.clear_config()
  workload = sweep.load_workload(experiment)
  prompt = workload.vocab.decode(workload.prompts[0, :workload.prompt_lengths[0]])
  assert prompt.startswith("Write the one-line synopsis") and prompt.count("Synopsis:") == 3   # 2 shots + query
  assert workload.stop_id == workload.vocab.eos_id and workload.max_new_tokens == 32
  records = sweep.run(experiment, progress=False)
  assert [r["family"] for r in records] == ["Large (verifier)", "SpecDecode [Lossy]", "SpecCascade [Token]"]
  assert all(r["metric"] == "rouge2" and r["point"]["gamma"] in (None, 1) for r in records)
  assert all(0 <= pareto._draft_rejection_rate(r) <= 1 for r in records[1:])
  paths = pareto.report(experiment.output, tmp_path)
  assert pathlib.Path(paths["rejection.png"]).stat().st_size > 10_000


def test_chat_template_is_for_the_few_shot_benchmarks(tmp_path):
  with pytest.raises(ValueError, match="chat_template applies to the few-shot benchmarks"):
    grid.expand_grid(smoke(tmp_path / "results.jsonl", "Experiment.chat_template = True"))


def test_a_sweep_names_a_feature_head_as_its_drafter(tmp_path):
  """The shipped verifier's EAGLE head as the sweep's drafter: greedy speculative decoding scores exactly the
  verifier alone's quality (lossless, token for token), the head's drafts are counted, the plan reads it as a
  feature drafter, and families it cannot serve are refused before compute. (The dynamic tree over a feature
  drafter: tests/drafters/test_dynamic_tree.py.)"""
  from specdec.evaluation import plan
  experiment = grid.Experiment(
      drafter=grid.ModelSource(path="data/models/debian_verifier_eagle"),
      verifier=grid.ModelSource(path="data/models/debian_verifier"), task="debian_synopsis", source="sample",
      families=[grid.Family("Large", "autoregressive"), grid.Family("SpecDecode", "speculative")],
      n_examples=2, batch_size=1, max_new_tokens=6, n_latency_examples=1, latency_trials=1, temperatures=(0.0,),
      gammas=(2,), output=str(tmp_path / "results.jsonl"))
  # Batches of 1: the quality batches run the latency examples' program (batch 1), one compilation per
  # point instead of two.
  assert {setting.drafter for setting, _ in plan.sweep_settings(experiment, verifier="small", vocab_size=8192)} == {None, plan.FEATURE}
  records = {r["family"]: r for r in sweep.run(experiment, progress=False)}
  assert sorted(records) == ["Large", "SpecDecode"]
  assert records["SpecDecode"]["quality"] == records["Large"]["quality"]
  assert records["SpecDecode"]["counters"]["drafted"] > 0
  for family, message in [(grid.Family("Small", "autoregressive", model="drafter"), "decodes the drafter alone"),
                          (grid.Family("Cascade", "token_cascade", rule="chow"), "method token_cascade needs a drafter model")]:
    bad = dataclasses.replace(experiment, families=[family], output=str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match=message):
      sweep.run(bad, progress=False)
    assert not (tmp_path / "bad.jsonl").exists()


def test_a_grid_with_a_top_p_below_one_keeps_the_search_in_every_points_program(tmp_path):
  """Points at top-P = 1 and below share one program: the workload asks for the top-p search in all of
  them; a grid at top-P = 1 alone compiles none."""
  assert sweep.load_workload(smoke(tmp_path / "one.jsonl")).truncation is None
  assert sweep.load_workload(smoke(tmp_path / "two.jsonl", "Experiment.top_ps = [1.0, 0.9]")).truncation is True


def test_a_single_file_checkpoint_is_identified_by_its_content(tmp_path):
  """A GGUF file given as `ModelSource(path=…)`: its identity is its bytes (a directory's walk finds no file in
  it, which gave every single-file checkpoint one identity)."""
  from specdec.evaluation import results
  (tmp_path / "one").mkdir()
  (tmp_path / "two").mkdir()
  (tmp_path / "one" / "model.gguf").write_bytes(b"GGUF" + bytes(range(100)))
  (tmp_path / "two" / "model.gguf").write_bytes(b"GGUF" + bytes(range(1, 101)))
  (tmp_path / "renamed.gguf").write_bytes(b"GGUF" + bytes(range(100)))
  digests = [results.files_digest(tmp_path / name) for name in ("one/model.gguf", "two/model.gguf", "renamed.gguf")]
  assert digests[0] != digests[1] and digests[0] == digests[2]
