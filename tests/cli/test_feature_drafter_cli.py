"""The feature drafter from the command line: `specdec-train` trains a head for an exported verifier
(configs/train/tiny_feature_head.gin), and `specdec-generate --drafter <its directory>` decodes with it
under every method that takes any drafter; a head for another verifier, or a method that needs a drafter
model, is one line naming both."""

import gin
import pytest

from specdec import cli, models
from specdec.cli import generate, train
from specdec.decoding.feature_drafter import FeatureDrafter
from specdec.training import exports, save_params
from tests.commands import VOCAB


@pytest.fixture(scope="module")
def head(pair, tmp_path_factory):
  """(the head's directory, the verifier it was trained for): a 4-step head from the tiny recipe."""
  out = tmp_path_factory.mktemp("head") / "tiny_eagle"
  gin.clear_config()
  try:
    path = train.main(["--gin_file", "configs/train/tiny_feature_head.gin",
                       "--gin_bindings", f"train_feature_head.verifier = '{pair[1]}'",
                       "--gin_bindings", f"train_feature_head.out = '{out}'"])
  finally:
    gin.clear_config()
  assert path == str(out / "feature_head")
  return str(out), pair[1]


def test_the_recipe_writes_a_head_with_its_training_record(head):
  import json
  import pathlib
  record = json.loads((pathlib.Path(head[0]) / "feature_head" / "head.json").read_text())["training"]
  assert record["steps"] == 4 and record["command"].startswith("specdec-train --gin_file")
  assert set(record["validation"]) >= {"regression", "classification", "top1_agreement", "tokens"}
  assert record["classification_weight"] == 0.1 and record["regression_weight"] == 1.0


def test_load_drafter_reads_the_head_over_the_verifier(head):
  from specdec.training import load_model
  verifier = load_model(head[1])
  drafter = exports.load_drafter(head[0], verifier)
  assert isinstance(drafter, FeatureDrafter) and drafter.verifier is verifier
  assert not isinstance(exports.load_drafter(head[1], verifier), FeatureDrafter)


@pytest.mark.parametrize("method, extra", [("speculative", ["--gamma", "3"]),
                                           ("speculative", ["--rule", "opt", "--alpha", "0.2"]),
                                           ("bild", ["--fallback_alpha", "1"])])
def test_generate_decodes_with_the_feature_drafter(head, method, extra, capsys):
  argv = ["--drafter", head[0], "--verifier", head[1], "--no_cache", "--max_new_tokens", "6", "--method", method,
          "--temperature", "0", "--prompt", "a small tool", *extra]
  records = generate.main(argv)
  greedy = generate.main(["--verifier", head[1], "--no_cache", "--max_new_tokens", "6", "--method",
                          "autoregressive", "--temperature", "0", "--prompt", "a small tool"])
  if method == "speculative" and "--rule" not in extra:   # lossless: the verifier's greedy output
    assert records[0]["tokens"] == greedy[0]["tokens"]
  assert records[0]["counters"]["drafted"] > 0


def test_a_method_that_needs_a_drafter_model_names_the_feature_drafter(head, capsys):
  argv = ["--drafter", head[0], "--verifier", head[1], "--no_cache", "--method", "seq_cascade", "--prompt", "x"]
  assert cli.run(generate.main, argv, generate.PROG) == 2
  line = capsys.readouterr().err.strip()
  assert "is a feature drafter" in line and "method seq_cascade needs a drafter model" in line, line


def test_a_head_for_another_verifier_is_refused_naming_the_directory(head, tmp_path, capsys):
  other = tmp_path / "other"
  save_params(str(other), models.build("tiny", vocab_size=VOCAB, seed=7, max_length=256), preset="tiny")
  argv = ["--drafter", head[0], "--verifier", str(other), "--no_cache", "--prompt", "x"]
  assert cli.run(generate.main, argv, generate.PROG) == 2
  line = capsys.readouterr().err.strip()
  assert head[0] in line and "trained for the verifier with output layer" in line, line
  assert len(line.splitlines()) == 1


def test_the_recipe_names_a_missing_verifier(tmp_path, capsys):
  argv = ["--gin_file", "configs/train/tiny_feature_head.gin",
          "--gin_bindings", f"train_feature_head.verifier = '{tmp_path / 'none'}'",
          "--gin_bindings", f"train_feature_head.out = '{tmp_path / 'out'}'"]
  gin.clear_config()
  try:
    assert cli.run(train.main, argv, train.PROG) == 2
  finally:
    gin.clear_config()
  assert str(tmp_path / "none") in capsys.readouterr().err

