"""The command-line tools as a new user meets them (specdec.cli): options from the method registry, one-line
errors with exit status 2, per-prompt randomness, --output, timing and the persistent compilation cache.

Decoding runs use tiny random-weight exports (conftest.py: fast to compile); in-process runs pass --no_cache
so the test process's compilations stay out of any persistent cache."""

import importlib.metadata
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from specdec import cli, decoding
from specdec.cli import generate, plot, registry
from specdec.data import shipped
from tests.commands import ENV, REPO_ROOT, command

SHIPPED = shipped.path("data", "models")


def _args(pair, *extra):
  return ["--drafter", pair[0], "--verifier", pair[1], "--no_cache", "--max_new_tokens", "6", *extra]


def _error(argv, capsys, main=generate.main, prog=generate.PROG) -> str:
  """The one line a user error prints (exit status 2)."""
  assert cli.run(main, argv, prog) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
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


def test_the_help_example_works_from_any_directory(tmp_path, monkeypatch):
  """The example of --help named data/models/… paths, which do not exist outside the checkout."""
  monkeypatch.chdir(tmp_path)
  example = generate.__doc__.split("\n\n")[1].split()
  for role in ("--drafter", "--verifier"):
    name = example[example.index(role) + 1]
    assert "/" not in name and os.path.isdir(generate._model_directory(name, role[2:]))


def test_options_whose_default_is_none_parse_and_max_gram_has_its_gate(pair):
  """`--model_drafts 0` failed ("invalid NoneType value"); Max-Gram's gate had no option."""
  records = generate.main(_args(pair, "--prompt", "hello world", "--method", "cs_drafting", "--model_drafts", "0",
                                "--gate", "2", "--temperature", "0"))
  assert records[0]["counters"]["drafter_calls"] == 0   # Max-Gram alone
  with pytest.raises(ValueError, match=r"gate .* must lie in \[0, 8\]; got 9$"):   # the int as given, not [9.0]
    generate.main(_args(pair, "--prompt", "x", "--method", "cs_drafting", "--gate", "9"))


def test_specdec_pp_finds_the_drafters_head_or_names_the_shipped_drafter_that_has_one(pair, tmp_path):
  records = generate.main(_args(pair, "--prompt", "hello world", "--method", "specdec_pp", "--temperature", "0"))
  assert records[0]["counters"]["generated"] > 0
  with_head = [d.parent.name for d in SHIPPED.glob("*/acceptance_head")]
  assert with_head == ["debian_drafter_distilled"]
  for extra in (["--head", str(tmp_path)], ["--drafter", "debian_drafter"]):
    with pytest.raises(FileNotFoundError, match="needs the drafter's acceptance head: .* holds no acceptance_head/; "
                                                "the shipped debian_drafter_distilled has one"):
      generate.main(_args(pair, "--prompt", "x", "--method", "specdec_pp", *extra))


def test_autoregressive_ignores_a_drafter_with_a_note(pair, capsys):
  records = generate.main(_args(pair, "--prompt", "hello", "--method", "autoregressive", "--temperature", "0"))
  assert records[0]["run"]["drafter"] is None and records[0]["counters"]["drafter_calls"] == 0
  assert ("specdec-generate: note: --drafter ignored: --method autoregressive decodes with the verifier alone"
          in capsys.readouterr().err)


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "x", "--rule", "opt", "--alpha", "1.5"], "alpha (rule 'opt') must lie in [0.0, 1.0); got 1.5"),
    (["--prompt", "x", "--method", "spectr", "--num_drafts", "0"], "must lie in [1, inf]; got 0"),
    (["--prompt", ""], "--prompt number 1 is empty"),
    (["--prompt", "x", "--method", "autoregressive", "--gamma", "3"],
     "--gamma is not a parameter of --method autoregressive"),
    (["--prompt", "word " * 300, "--task", "debian_synopsis"], "longer than task debian_synopsis's input budget"),
    (["--prompt", " ", "--task", "debian_synopsis"], "is empty"),
    (["--prompt", "x", "--truncate"], "--truncate cuts prompts to a task's input budget: it needs --task"),
    (["--prompt", "x", "--output", "no/such/dir/out.jsonl"], "--output no/such/dir/out.jsonl: no such directory"),
    (["--prompt", "x", "--cache_dir", "/tmp/c"], "--cache_dir and --no_cache contradict each other"),
])
def test_user_errors_are_one_line_naming_the_parameter(pair, capsys, extra, message):
  assert message in _error(_args(pair, *extra), capsys)


@pytest.mark.parametrize("extra, message", [
    (["--top_p", "0"], "argument --top_p: must be a float in (0, 1]; got 0"),
    (["--max_new_tokens", "0"], "argument --max_new_tokens: must be an int >= 1; got 0"),
    (["--batch_size", "0"], "argument --batch_size: must be an int >= 1; got 0"),
    (["--gamma", "2.5"], "argument --gamma: invalid int value: '2.5'"),
    (["--no_such_option"], "unrecognized arguments: --no_such_option"),
])
def test_argument_errors_are_one_line_without_the_usage_block(pair, capsys, extra, message):
  with pytest.raises(SystemExit) as exit:
    generate.main(_args(pair, "--prompt", "x", *extra))
  assert exit.value.code == 2
  err = capsys.readouterr().err
  assert err == f"specdec-generate: error: {message} (--help for the options)\n"


def test_file_errors_name_the_option_and_the_file(pair, tmp_path, capsys):
  latin = tmp_path / "latin1.txt"
  latin.write_bytes("café au lait\n".encode("latin-1"))
  assert f"--input {latin} is not UTF-8 text (byte 0xe9 at offset 3)" in _error(_args(pair, "--input", str(latin)),
                                                                               capsys)
  blank = tmp_path / "blank.txt"
  blank.write_text("\n  \n\n")
  assert f"--input {blank} holds no prompt" in _error(_args(pair, "--input", str(blank)), capsys)
  assert f"--input {tmp_path} is a directory" in _error(_args(pair, "--input", str(tmp_path)), capsys)
  assert f"--input {tmp_path}/none.txt: no such file" in _error(_args(pair, "--input", f"{tmp_path}/none.txt"), capsys)
  assert f"--output {tmp_path} is a directory" in _error(_args(pair, "--prompt", "x", "--output", str(tmp_path)),
                                                         capsys)
  assert "--verifier nowhere: no such model directory" in _error(
      ["--verifier", "nowhere", "--prompt", "x", "--no_cache"], capsys)


def test_an_unwritable_output_file_is_named(pair, tmp_path, capsys):
  unwritable = tmp_path / "read_only.jsonl"
  unwritable.write_text("")
  unwritable.chmod(0o444)
  if os.access(unwritable, os.W_OK):   # root writes anyway; a read-only file system does not
    unwritable = pathlib.Path("/proc/sys/kernel/osrelease")   # read-only to root too
    if not unwritable.exists() or os.access(unwritable, os.W_OK):
      pytest.skip("no file here is unwritable to this user")
  assert f"--output {unwritable}: {unwritable} is not writable" in _error(
      _args(pair, "--prompt", "x", "--output", str(unwritable)), capsys)


def test_input_dash_reads_stdin(pair, monkeypatch):
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("one\n\ntwo\n".encode())))
  records = generate.main(_args(pair, "--input", "-", "--batch_size", "2", "--temperature", "0"))
  assert [r["prompt"] for r in records] == ["one", "two"]


def test_debug_shows_the_traceback(pair):
  with pytest.raises(ValueError, match="--prompt number 1 is empty"):
    cli.run(generate.main, _args(pair, "--prompt", "", "--debug"), generate.PROG)


@pytest.mark.parametrize("extra, message", [(["--alpha", "1.5", "--rule", "opt", "--prompt", "x"], "alpha"),
                                            # after the shipped models are found by name from another directory
                                            (["--task", "debian_synopsis", "--prompt", "word " * 300], "longer")])
def test_the_command_exits_2_with_one_line_and_no_traceback(extra, message, tmp_path):
  result = subprocess.run(command("generate", "--verifier", "debian_verifier", "--drafter", "debian_drafter",
                                  "--no_cache", *extra), capture_output=True, text=True, env=ENV, cwd=tmp_path)
  assert result.returncode == 2
  assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr
  assert message in result.stderr


def test_argument_errors_exit_before_jax_is_imported(tmp_path):
  """Every check the arguments alone decide runs before JAX (3-9 s) is imported."""
  (tmp_path / "folder").mkdir()
  cases = [["--verifier", "debian_verifier", "--prompt", "x", "--top_p", "2"],
           ["--verifier", "debian_verifier", "--prompt", "x", "--method", "autoregressive", "--gamma", "3"],
           ["--verifier", "debian_verifier", "--input", str(tmp_path / "folder")],
           ["--verifier", "debian_verifier", "--prompt", "x", "--output", str(tmp_path / "no" / "x.jsonl")],
           ["--verifier", "nowhere", "--prompt", "x"],
           ["--verifier", "debian_verifier", "--method", "specdec_pp", "--drafter", "debian_drafter", "--prompt", "x"],
           ["--verifier", "debian_verifier", "--drafter", "debian_drafter", "--prompt", "x", "--alpha", "1.5",
            "--rule", "chow"],
           ["--verifier", "debian_verifier", "--drafter", "debian_drafter", "--prompt", "x", "--rule", "fancy"],
           ["--verifier", "debian_verifier", "--drafter", "debian_drafter", "--prompt", "x", "--gamma", "0"],
           ["--verifier", "debian_verifier", "--drafter", "debian_drafter", "--prompt", "x", "--method",
            "cs_drafting", "--gamma", "3", "--model_drafts", "4"]]
  program = ("import sys; from specdec import cli; from specdec.cli import generate\n"
             f"for argv in {cases!r}:\n"
             "  try:\n    assert cli.run(generate.main, argv, 'g') == 2\n"
             "  except SystemExit as e:\n    assert e.code == 2\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'orbax')))")
  result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=ENV, cwd=tmp_path)
  assert result.returncode == 0 and result.stdout.strip() == "[]", (result.stdout, result.stderr)
  assert result.stderr.count("\n") == len(cases), result.stderr


def test_a_prompt_samples_the_same_alone_and_as_the_second_line_of_a_file(pair, tmp_path):
  """T = 1, --seed 7: a row's draws depend on the seed and its text, not its place or the batch size."""
  prompt = "A tool to convert images."
  alone = tmp_path / "alone.jsonl"
  generate.main(_args(pair, "--prompt", prompt, "--seed", "7", "--output", str(alone)))
  lines = tmp_path / "input.txt"
  lines.write_text(f"A library for parsing JSON.\n{prompt}\n")
  both = tmp_path / "both.jsonl"
  generate.main(_args(pair, "--input", str(lines), "--seed", "7", "--batch_size", "2", "--output", str(both)))
  first, = [json.loads(line) for line in alone.read_text().splitlines()]
  second = [json.loads(line) for line in both.read_text().splitlines()][1]
  assert second["prompt"] == prompt and second["tokens"] == first["tokens"] and second["text"] == first["text"]
  # A repeated prompt is another draw (its occurrence count is part of its id).
  assert len(set(generate.row_ids([prompt, prompt, "other"]).tolist())) == 3


def test_each_output_line_records_the_run_and_its_own_tokens_and_time(pair, tmp_path):
  path = tmp_path / "out.jsonl"
  texts = ["one", "two", "three"]
  (tmp_path / "in.txt").write_text("\n".join(texts))
  generate.main(_args(pair, "--input", str(tmp_path / "in.txt"), "--batch_size", "2", "--method", "token_cascade",
                      "--alpha", "0.3", "--temperature", "0.5", "--top_k", "20", "--seed", "3", "--output", str(path)))
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert not (tmp_path / "out.jsonl.partial").exists()
  for record in records:
    assert set(record) == {"prompt", "text", "tokens", "new_tokens", "seconds", "batch", "counters",
                           "unknown_characters", "run"}
    assert record["new_tokens"] == len(record["tokens"]) and record["seconds"] > 0
    assert set(record["counters"]) == set(decoding.common.STAT_NAMES)
    assert record["run"] == {
        "method": "token_cascade", "params": {"rule": "chow", "alpha": 0.3},
        "sampling": {"temperature": 0.5, "top_p": 1.0, "top_k": 20}, "seed": 3, "max_new_tokens": 6, "eos_id": 1,
        "task": None, "truncate": False, "drafter": pair[0], "head": None, "verifier": pair[1], "vocab": None,
        "chat": False}
  # rows decoded together share their batch's time
  assert [r["batch"] for r in records] == [0, 0, 2] and records[0]["seconds"] == records[1]["seconds"]


def test_an_existing_output_is_untouched_by_a_run_that_fails(pair, tmp_path, capsys):
  path = tmp_path / "out.jsonl"
  path.write_text("precious\n")
  corrupt = tmp_path / "corrupt"
  shutil.copytree(pair[1], corrupt)
  for file in (corrupt / "params").rglob("*"):
    if file.is_file():
      file.write_bytes(b"\0" * 7)
  for argv in (["--prompt", "word " * 300, "--task", "debian_synopsis"],           # a user error before decoding
               ["--prompt", "x", "--verifier", str(tmp_path / "nowhere")],         # a bad model path
               ["--prompt", "x", "--verifier", str(corrupt)]):                      # a corrupt model
    assert cli.run(generate.main, _args(pair, "--output", str(path), *argv), generate.PROG) == 2
    assert path.read_text() == "precious\n" and not (tmp_path / "out.jsonl.partial").exists()
  assert "error" in capsys.readouterr().err


def test_a_prompt_the_vocabulary_cannot_spell_gets_one_warning(pair, capsys):
  records = generate.main(_args(pair, "--prompt", "café 😀 漢字", "--prompt", "plain", "--temperature", "0"))
  err = [line for line in capsys.readouterr().err.splitlines() if "vocabulary" in line]
  assert err == ["specdec-generate: warning: 4 characters of 1 prompt are not in the vocabulary and became unknown "
                 "(byte) tokens, which the models rarely saw: é 😀 漢 字"]
  assert [r["unknown_characters"] for r in records] == [4, 0]


def test_summary_and_compare_report_time_and_speed_up(pair, capsys):
  generate.main(_args(pair, "--prompt", "hello", "--prompt", "world", "--temperature", "0", "--compare"))
  out = capsys.readouterr().out
  assert "speculative: 2 prompts," in out and " tokens/s, " in out and "compile " in out and "decode " in out
  assert "verifier alone:" in out and "speed-up of speculative (ms/token, decode only): " in out


def test_an_input_over_one_batch_shows_progress_with_tokens_per_second(pair, tmp_path, capsys):
  (tmp_path / "in.txt").write_text("one\ntwo\nthree\n")
  records = generate.main(_args(pair, "--input", str(tmp_path / "in.txt"), "--batch_size", "2", "--temperature", "0"))
  assert [r["prompt"] for r in records] == ["one", "two", "three"]
  err = capsys.readouterr().err
  assert "speculative: 100%" in err and "3/3" in err and " tokens/s" in err
  generate.main(_args(pair, "--prompt", "one", "--temperature", "0"))
  assert "tokens/s" not in capsys.readouterr().err   # one batch: no bar


def test_input_lines_decode_in_order_over_several_batches(pair, tmp_path):
  texts = ["one", "two", "three"]
  path = tmp_path / "three.txt"
  path.write_text("\n".join(texts) + "\n")
  records = generate.main(_args(pair, "--input", str(path), "--batch_size", "2", "--temperature", "0"))
  assert [r["prompt"] for r in records] == texts
  single = generate.main(_args(pair, "--prompt", "three", "--temperature", "0"))
  np.testing.assert_array_equal(records[2]["tokens"], single[0]["tokens"])


def test_prompt_sets_share_one_width_and_one_batch_shape():
  assert generate.prompt_width(40, 224, lambda width: True) == 224   # a task: its input budget
  assert generate.prompt_width(40, None, lambda width: True) == 64    # else a power of two
  assert generate.prompt_width(5, None, lambda width: True) == 32
  assert generate.prompt_width(40, 224, lambda width: width <= 100) == 64   # no room for the budget
  assert generate.prompt_width(70, None, lambda width: width <= 100) == 96   # nor a power of two: a multiple of 32
  assert [len(rows) for rows in generate.batch_rows(5, 4)] == [4, 4] and generate.batch_rows(5, 4)[1].tolist() == [
      4, 4, 4, 4]
  assert [rows.tolist() for rows in generate.batch_rows(1, 8)] == [[0]]


def test_another_prompt_set_temperature_or_alpha_takes_every_program_from_the_cache(pair, tmp_path):
  """The compiled programs' shapes do not depend on the prompts (width: the task's budget; rows: the batch
  size) and T, top-p and α are traced: a rerun with other values compiles nothing (top-p below 1 in both
  runs: a program holds the top-p search only where top_p < 1, `Sampling.truncation`)."""
  base = ["--drafter", pair[0], "--verifier", pair[1], "--task", "debian_synopsis", "--max_new_tokens", "4",
          "--cache_dir", str(tmp_path / "cache"), "--method", "token_cascade"]
  runs = [["--prompt", "a tool", "--prompt", "a library", "--alpha", "0.1", "--temperature", "0", "--top_p", "0.95"],
          ["--prompt", "an image editor for the desktop with layers and filters", "--prompt", "x", "--prompt", "y",
           "--alpha", "0.7", "--temperature", "0.8", "--top_p", "0.9", "--seed", "5"]]
  summaries = [subprocess.run(command("generate", *base, *extra), capture_output=True, text=True, check=True,
                              env=ENV).stdout.strip().splitlines()[-1] for extra in runs]
  assert " (0 of " in summaries[0]
  hits, total = summaries[1].split(" programs from the cache")[0].split("(")[-1].split(" of ")
  assert hits == total and int(total) > 0, summaries


def test_console_scripts_registry_and_shipped_files_are_found(monkeypatch, tmp_path):
  installed = {e.name: e for e in importlib.metadata.entry_points(group="console_scripts") if e.name.startswith("specdec")}
  assert sorted(installed) == ["specdec-bench", "specdec-generate", "specdec-plan", "specdec-plot", "specdec-sweep",
                             "specdec-train"]
  for name, entry in installed.items():
    assert entry.value == f"specdec.cli.{name[len('specdec-'):]}:console" and callable(entry.load())
  assert shipped.find("debian_verifier", "data/models") == str(REPO_ROOT / "data" / "models" / "debian_verifier")
  assert shipped.find("no_such_model", "data/models") == "no_such_model"
  # An installed package finds them under <prefix>/share/specdec, or wherever $SPECDEC_ROOT says.
  monkeypatch.setenv(shipped.ENV, str(tmp_path))
  assert shipped.path("data", "vocab") == tmp_path / "data" / "vocab"


def test_the_registrys_bounds_check_what_each_parameters_check_checks():
  """registry.check_params (before JAX) accepts and refuses the values Param.validate does, at and beside
  every bound of every parameter of every method, for each rule it takes."""
  from specdec import decoding
  for method in decoding.METHODS.values():
    for param in method.params:
      rules = next((p.choices for p in method.params if p.name == "rule"), [None])
      for rule in rules:
        context = {"rule": rule} if rule else {}
        defaults = method.resolve(context)
        bounds = param.bounds_for(defaults) if param.bounds is not None else None
        if param.value_type not in (int, float):
          continue
        edges = [0, 1, 2, 8, 9] if bounds is None else [bounds.lo, defaults[bounds.hi] if isinstance(bounds.hi, str)
                                                          else bounds.hi]
        probes = {value + shift for value in edges if value == value and abs(value) != float("inf")
                  for shift in (-1, -0.5, -1e-6, 0, 1e-6, 0.5, 1)}
        probes = sorted(param.value_type(v) for v in probes if param.value_type is float or float(v).is_integer())
        for value in probes:
          given = {**context, param.name: value}
          try:
            method.resolve(given)
            accepted = True
          except ValueError:
            accepted = False
          try:
            registry.check_params(method.name, given)
            early = True
          except ValueError:
            early = False
          assert early == accepted, (method.name, param.name, rule, value)


def test_the_registry_file_is_the_registries():
  """registry.json (the options before JAX is imported) equals the live registries; after adding a method,
  a parameter or a task: `python -m specdec.cli.registry`."""
  assert registry.PATH.read_text() == registry.text(registry.current()), "run `python -m specdec.cli.registry`"


@pytest.mark.parametrize("name, argv, message", [
    ("sweep", ["--gin_file=no/such.gin"], "--gin_file no/such.gin: no such file (looked in the working"),
    ("plot", ["--results=no/such.jsonl"], "--results no/such.jsonl: no such file"),
    ("train", ["--gin_file=no/such.gin"], "--gin_file no/such.gin: no such file (looked in the working"),
])
def test_every_command_reports_user_errors_in_one_line(name, argv, message, capsys):
  module = __import__(f"specdec.cli.{name}", fromlist=["main"])
  assert message in _error(argv, capsys, module.main, f"specdec-{name}")


def test_plot_names_the_file_and_line_that_is_not_text(tmp_path, capsys):
  results = tmp_path / "results.jsonl"
  results.write_bytes(b'{"a": 1}\n{"b": 2}\n\x89PNG\r\n\x1a\n')
  assert f"{results}:3 is not UTF-8 text (byte 0x89)" in _error([f"--results={results}"], capsys, plot.main,
                                                                  plot.PROG)
  assert f"--results {tmp_path} is a directory" in _error([f"--results={tmp_path}"], capsys, plot.main, plot.PROG)


def test_an_all_zero_quality_plot_has_a_readable_axis(tmp_path, monkeypatch):
  """ROUGE-2 of 0 everywhere (random models) drew a quality axis 1e-17 wide, labelled "1e-17"."""
  from specdec.evaluation import pareto
  records = [json.loads(line) for line in (REPO_ROOT / "experiments/cascades_synopsis_pilot/results.jsonl").open()]
  for record in records:
    record["quality"], record["quality_interval"] = 0.0, [0.0, 0.0]
  results = tmp_path / "results.jsonl"
  results.write_text("".join(json.dumps(record) + "\n" for record in records))
  figures = []
  monkeypatch.setattr(pareto.plt, "close", figures.append)
  plot.main([f"--results={results}"])
  for figure in figures:
    for ax in figure.axes:
      if ax.get_visible():
        low, high = ax.get_ylim()
        assert high - low > 0.05 and ax.yaxis.get_offset_text().get_text() == "", (low, high)


def test_sweep_and_train_find_the_shipped_configs_from_another_directory_without_error_lines(tmp_path, monkeypatch,
                                                                                             caplog):
  """From outside the clone gin logged `ERROR:root:Path not found: configs/…` for each include."""
  import gin
  from specdec.cli import sweep, train
  monkeypatch.chdir(tmp_path)
  experiment = sweep.parse_experiment(["configs/experiments/quickstart.gin"], [])
  assert experiment.task == "debian_synopsis"
  gin.clear_config()
  try:
    train.parse_gin(["configs/train/tiny_synthetic.gin"], [])
    assert gin.query_parameter("train.preset") == "tiny"
  finally:
    gin.clear_config()
  assert not [r for r in caplog.records if "Path not found" in r.getMessage()]


@pytest.mark.parametrize("name", ["smollm2_eagle", "debian_feature_head", "tiny_feature_head"])
def test_the_feature_head_configs_bind_the_recipes_parameters(name):
  import gin
  from specdec.cli import train
  gin.clear_config()
  try:
    train.parse_gin([f"configs/train/{name}.gin"], [])   # a binding of a parameter the recipe lacks raises
    assert gin.query_parameter("specdec_train.recipe") == "feature_head"
  finally:
    gin.clear_config()


def test_the_quickstart_installs_only_what_it_runs():
  """No test extra (TensorFlow, torch, transformers, seqio: 4.3 GB) for `make quickstart`."""
  makefile = (REPO_ROOT / "Makefile").read_text()
  rule = makefile.split("$(QUICKSTART_STAMP): ")[1].split("\n\n")[0]
  assert "pip install" in rule and "-e .\n" in rule and "[" not in rule.split("pip install")[1]
  setup = (REPO_ROOT / "setup.py").read_text()
  requires = setup.split("install_requires=[")[1].split("]")[0]
  for heavy in ("tensorflow", "torch", "transformers", "seqio"):
    assert heavy not in requires


def test_hugging_face_gemma2_directories_decode_as_models(tmp_path):
  """--drafter / --verifier take save_pretrained directories: a Gemma 2 pair written by transformers decodes
  greedily to the verifier's own greedy tokens."""
  import torch
  import transformers
  from tests.commands import VOCAB
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


def test_specdec_plan_without_libtpu_says_in_one_line_how_to_install_it(monkeypatch, capsys):
  from specdec.cli import plan as plan_cli
  from specdec.evaluation import tpu_topology
  monkeypatch.setattr(tpu_topology, "libtpu_version", lambda: None)
  argv = ["--topology", "v4-8", "--verifier", "tiny", "--drafter", "tiny", "--vocab_size", "256"]
  assert cli.run(plan_cli.main, argv, "specdec-plan") == 2
  [line] = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("specdec-plan: error: compiling for TPU needs libtpu") and "'.[tpu-plan]'" in line


def test_the_deferred_counter_is_printed_for_deferral_rules_only(capsys):
  record = {"prompt": "p", "text": "t", "counters": dict.fromkeys(decoding.common.STAT_NAMES, 1),
            "run": {"params": {"rule": "spec"}}}
  generate._print_record(record)
  assert "deferred" not in capsys.readouterr().out
  record["run"]["params"]["rule"] = "chow"
  generate._print_record(record)
  assert "deferred=1" in capsys.readouterr().out


def test_specdec_train_says_where_its_checkpoints_went_and_that_it_exported_nothing(tmp_path, capsys):
  import gin
  from specdec.cli import train
  try:
    train.main(["--gin_file=configs/train/tiny_synthetic.gin", "--gin_bindings=train.num_steps = 2",
                f"--gin_bindings=train.model_dir = '{tmp_path}'", "--gin_bindings=train.log_every = 1"])
  finally:
    gin.clear_config()
  out = capsys.readouterr().out
  assert f"checkpoints and config.gin in {tmp_path}" in out and "not exported: export.path is not set" in out


def test_every_specdec_plan_option_says_what_it_is():
  from specdec.cli import plan as plan_cli
  silent = [action.option_strings for action in plan_cli._parser()._actions if not action.help]
  assert not silent
