"""The command-line tools as a new user meets them (specdec.cli): options from the method registry, one-line
errors with exit status 2, per-prompt randomness, --output, timing and the persistent compilation cache.

Decoding runs use tiny random-weight exports (fast to compile); in-process runs pass --no_cache so the
test process's compilations stay out of any persistent cache."""

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from specdec import cli, decoding, models
from specdec.cli import generate
from specdec.data import load_vocabulary, shipped
from specdec.models.acceptance_head import HeadConfig, init_head
from specdec.training import acceptance, save_params

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = load_vocabulary().vocab_size


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """Random tiny drafter (with an acceptance head) and verifier exports: (drafter dir, verifier dir)."""
  root = tmp_path_factory.mktemp("pair")
  drafter = models.build("tiny", vocab_size=VOCAB, seed=1, max_length=256)
  save_params(str(root / "drafter"), drafter, preset="tiny")
  acceptance.save_head(str(root / "drafter"), init_head(HeadConfig(drafter.config.emb_dim, depth=1),
                                                        jax.random.PRNGKey(0)))
  save_params(str(root / "verifier"), models.build("tiny", vocab_size=VOCAB, seed=2, max_length=256), preset="tiny")
  return str(root / "drafter"), str(root / "verifier")


def _args(pair, *extra):
  return ["--drafter", pair[0], "--verifier", pair[1], "--no_cache", "--max_new_tokens", "6", *extra]


def _error(argv, capsys) -> str:
  """The one line a user error prints (exit status 2)."""
  assert cli.run(generate.main, argv, generate.PROG) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("specdec-generate: error: "), err
  return err[0]


def test_help_gives_each_method_parameter_its_meaning_range_and_defaults(capsys):
  with pytest.raises(SystemExit):
    generate.main(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  for name in decoding.methods.all_param_names():
    assert f"--{name} " in text
  # `rule` has two defaults: before, --help said it defaults to 'chow' for every method.
  assert "[default 'spec': speculative, oracle_cascade]" in text and "[default 'chow': token_cascade]" in text
  assert "[0, 8] (0: always) [default 0: cs_drafting]" in text   # --gate
  assert "T >= 0; 0 is greedy (default: 1.0" in text              # the CLI's T is generate's


def test_options_whose_default_is_none_parse_and_max_gram_has_its_gate(pair):
  """`--model_drafts 0` failed ("invalid NoneType value"); Max-Gram's gate had no option."""
  records = generate.main(_args(pair, "--prompt", "hello world", "--method", "cs_drafting", "--model_drafts", "0",
                                "--gate", "2", "--temperature", "0"))
  assert records[0]["counters"]["drafter_calls"] == 0   # Max-Gram alone
  with pytest.raises(ValueError, match=r"gate .* must lie in \[0, 8\]"):
    generate.main(_args(pair, "--prompt", "x", "--method", "cs_drafting", "--gate", "9"))


def test_specdec_pp_finds_the_drafters_head(pair, tmp_path):
  records = generate.main(_args(pair, "--prompt", "hello world", "--method", "specdec_pp", "--temperature", "0"))
  assert records[0]["counters"]["generated"] > 0
  with pytest.raises(FileNotFoundError, match="needs the drafter's acceptance head.*--head DIR"):
    generate.main(_args(pair, "--prompt", "x", "--method", "specdec_pp", "--head", str(tmp_path)))


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "x", "--rule", "opt", "--alpha", "1.5"], "alpha (rule 'opt') must lie in [0.0, 1.0); got"),
    (["--prompt", ""], "--prompt number 1 is empty"),
    (["--prompt", "x", "--method", "autoregressive", "--gamma", "3"],
     "--gamma is not a parameter of --method autoregressive"),
    (["--prompt", "x", "--method", "autoregressive"], "--drafter is not used by --method autoregressive"),
    (["--prompt", "word " * 300, "--task", "debian_synopsis"], "longer than task debian_synopsis's input budget"),
    (["--prompt", " ", "--task", "debian_synopsis"], "is empty"),
    (["--prompt", "x", "--top_p", "0"], "top_p"),
    (["--prompt", "x", "--max_new_tokens", "0"], "max_new_tokens must be an int >= 1; got 0"),
    (["--prompt", "x", "--truncate"], "--truncate cuts prompts to a task's input budget: it needs --task"),
    (["--prompt", "x", "--output", "no/such/dir/out.jsonl"], "no/such/dir/out.jsonl"),
    (["--prompt", "x", "--cache_dir", "/tmp/c"], "--cache_dir and --no_cache contradict each other"),
])
def test_user_errors_are_one_line_naming_the_parameter(pair, capsys, extra, message):
  assert message in _error(_args(pair, *extra), capsys)


def test_file_errors_name_the_file(pair, tmp_path, capsys):
  latin = tmp_path / "latin1.txt"
  latin.write_bytes("café au lait\n".encode("latin-1"))
  assert f"--input {latin} is not UTF-8 text (byte 0xe9 at offset 3)" in _error(_args(pair, "--input", str(latin)),
                                                                               capsys)
  blank = tmp_path / "blank.txt"
  blank.write_text("\n  \n\n")
  assert f"--input {blank} holds no prompt" in _error(_args(pair, "--input", str(blank)), capsys)
  assert "--verifier nowhere: no such model directory" in _error(
      ["--verifier", "nowhere", "--prompt", "x", "--no_cache"], capsys)


def test_debug_shows_the_traceback(pair):
  with pytest.raises(ValueError, match="--prompt number 1 is empty"):
    cli.run(generate.main, _args(pair, "--prompt", "", "--debug"), generate.PROG)


@pytest.mark.parametrize("extra, message", [(["--alpha", "1.5", "--rule", "opt", "--prompt", "x"], "alpha"),
                                            # after the shipped models are found by name from another directory
                                            (["--task", "debian_synopsis", "--prompt", "word " * 300], "longer")])
def test_the_command_exits_2_with_one_line_and_no_traceback(extra, message, tmp_path):
  result = subprocess.run([sys.executable, "-m", "specdec.cli.generate", "--verifier", "debian_verifier",
                           "--drafter", "debian_drafter", "--no_cache", *extra],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=tmp_path)
  assert result.returncode == 2
  assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr
  assert message in result.stderr


def test_a_prompt_samples_the_same_alone_and_as_the_second_line_of_a_file(pair, tmp_path):
  """T = 1, --seed 7: a row's draws depend on the seed and its text, not its place or the batch size."""
  prompt = "A tool to convert images."
  alone = tmp_path / "alone.jsonl"
  generate.main(_args(pair, "--prompt", prompt, "--seed", "7", "--output", str(alone)))
  lines = tmp_path / "input.txt"
  lines.write_text(f"A library for parsing JSON.\n{prompt}\n")
  both = tmp_path / "both.jsonl"
  generate.main(_args(pair, "--input", str(lines), "--seed", "7", "--output", str(both)))
  first, = [json.loads(line) for line in alone.read_text().splitlines()]
  second = [json.loads(line) for line in both.read_text().splitlines()][1]
  assert second["prompt"] == prompt and second["tokens"] == first["tokens"] and second["text"] == first["text"]
  assert set(first) == {"prompt", "text", "tokens", "counters", "ms_per_token"}
  assert set(first["counters"]) == set(decoding.common.STAT_NAMES) and first["ms_per_token"] > 0
  # A repeated prompt is another draw (its occurrence count is part of its id).
  assert len(set(generate.row_ids([prompt, prompt, "other"]).tolist())) == 3


def test_summary_and_compare_report_time_and_speed_up(pair, capsys):
  generate.main(_args(pair, "--prompt", "hello", "--prompt", "world", "--temperature", "0",
                      "--compare"))
  out = capsys.readouterr().out
  assert "speculative: 2 prompts," in out and " tokens/s, " in out and "compile " in out and "decode " in out
  assert "verifier alone:" in out and "speed-up of speculative (ms/token, decode only): " in out


def test_a_second_identical_call_takes_every_program_from_the_cache(pair, tmp_path):
  argv = [sys.executable, "-m", "specdec.cli.generate", "--drafter", pair[0], "--verifier", pair[1],
          "--prompt", "hello", "--max_new_tokens", "4", "--cache_dir", str(tmp_path / "cache")]
  runs = [subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
          for _ in range(2)]
  summaries = [run.stdout.strip().splitlines()[-1] for run in runs]
  assert " (0 of " in summaries[0]
  requests = summaries[1].split(" programs from the cache")[0].split("(")[-1]
  hits, total = requests.split(" of ")
  assert hits == total and int(total) > 0, summaries


def test_console_scripts_and_shipped_files_are_found(monkeypatch, tmp_path):
  installed = {e.name: e for e in importlib.metadata.entry_points(group="console_scripts") if e.name.startswith("specdec")}
  assert sorted(installed) == ["specdec-generate", "specdec-plot", "specdec-sweep", "specdec-train"]
  for name, entry in installed.items():
    assert entry.value == f"specdec.cli.{name[len('specdec-'):]}:console" and callable(entry.load())
  assert shipped.find("debian_verifier", "data/models") == str(REPO_ROOT / "data" / "models" / "debian_verifier")
  assert shipped.find("no_such_model", "data/models") == "no_such_model"
  # An installed package finds them under <prefix>/share/specdec, or wherever $SPECDEC_ROOT says.
  monkeypatch.setenv(shipped.ENV, str(tmp_path))
  assert shipped.path("data", "vocab") == tmp_path / "data" / "vocab"


def test_input_lines_decode_in_order_over_several_batches(pair, tmp_path):
  texts = ["one", "two", "three"]
  path = tmp_path / "three.txt"
  path.write_text("\n".join(texts) + "\n")
  records = generate.main(_args(pair, "--input", str(path), "--batch_size", "2", "--temperature", "0"))
  assert [r["prompt"] for r in records] == texts
  single = generate.main(_args(pair, "--prompt", "three", "--temperature", "0"))
  np.testing.assert_array_equal(records[2]["tokens"], single[0]["tokens"])


@pytest.mark.parametrize("name, argv, message", [
    ("sweep", ["--gin_file=no/such.gin"], "Unable to open file: no/such.gin"),
    ("plot", ["--results=no/such.jsonl"], "no such file: no/such.jsonl"),
    ("train", ["--gin_file=no/such.gin"], "Unable to open file: no/such.gin"),
])
def test_every_command_reports_user_errors_in_one_line(name, argv, message, capsys):
  module = __import__(f"specdec.cli.{name}", fromlist=["main"])
  assert cli.run(module.main, argv, f"specdec-{name}") == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"specdec-{name}: error: ") and message in err[0], err


def test_hugging_face_gemma2_directories_decode_as_models(tmp_path):
  """--drafter / --verifier take save_pretrained directories: a Gemma 2 pair written by transformers decodes
  greedily to the verifier's own greedy tokens."""
  import torch
  import transformers
  for name, seed in (("drafter", 0), ("verifier", 1)):
    torch.manual_seed(seed)
    transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=128, sliding_window=4,
        query_pre_attn_scalar=8)).save_pretrained(tmp_path / name)
  common = ["--verifier", str(tmp_path / "verifier"), "--no_cache", "--max_new_tokens", "8", "--no_eos",
            "--temperature", "0", "--prompt", "a tool that converts images"]
  alone = generate.main(common + ["--method", "autoregressive"])
  speculative = generate.main(common + ["--drafter", str(tmp_path / "drafter"), "--method", "speculative"])
  assert speculative[0]["tokens"] == alone[0]["tokens"] and len(alone[0]["tokens"]) == 8
