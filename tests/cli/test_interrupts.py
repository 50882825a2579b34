"""Ctrl-C as a user presses it, in each command's own process: one line saying what was kept and how to
resume, exit status 130, no traceback and no crash, and every file whole (issue 50: a traceback, a 0-byte
--output, and a sweep dying with SIGSEGV after Ctrl-C while XLA compiled)."""

import json
import pathlib
import shutil
import subprocess

from specdec.cli import generate
from specdec.evaluation.results import RECORD_KEYS, read_results
from tests.commands import ENV, REPO_ROOT, command, interrupt, interrupted_line


def _lines(path: pathlib.Path) -> list[dict]:
  """The records of a JSON-lines file, every line whole."""
  text = path.read_text()
  assert text.endswith("\n"), text[-200:]
  return [json.loads(line) for line in text.splitlines()]


def test_generate_interrupted_while_compiling_leaves_the_output_as_it_was(tmp_path):
  """The shipped pair compiles for tens of seconds: Ctrl-C then ends the command within a second or two."""
  output = tmp_path / "out.jsonl"
  output.write_text("earlier results\n")
  (tmp_path / "in.txt").write_text("a tool\na library\na game\n")
  argv = command("generate", "--drafter", "debian_drafter", "--verifier", "debian_verifier", "--task",
                 "debian_synopsis", "--no_cache", "--input", str(tmp_path / "in.txt"), "--batch_size", "2",
                 "--output", str(output))
  result, seconds = interrupt(argv, lambda err: "0/3" in err, cwd=tmp_path)   # the bar, before the first batch
  line = interrupted_line(result, "specdec-generate")
  assert line.endswith(f"no prompt was finished; {output} is as it was"), line
  assert seconds < 10, seconds
  assert output.read_text() == "earlier results\n" and not (tmp_path / "out.jsonl.partial").exists()


def test_generate_interrupted_while_decoding_keeps_every_finished_prompt_and_resumes(pair, tmp_path):
  output, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
  output.write_text("earlier results\n")
  texts = [f"prompt number {i}" for i in range(60)]
  (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
  argv = command("generate", "--drafter", pair[0], "--verifier", pair[1], "--cache_dir", str(tmp_path / "cache"),
                 "--input", str(tmp_path / "in.txt"), "--batch_size", "1", "--max_new_tokens", "8", "--no_eos",
                 "--seed", "3", "--output", str(output))
  result, _ = interrupt(argv, lambda err: partial.exists() and partial.read_text().count("\n") >= 2)
  line = interrupted_line(result, "specdec-generate")
  kept = _lines(partial)
  assert line.endswith(f"{len(kept)} of 60 prompts kept in {partial} ({output} is written once all are done); "
                       f"rerun the same command to decode the other {60 - len(kept)}"), line
  assert 2 <= len(kept) < 60 and [r["prompt"] for r in kept] == texts[:len(kept)]
  assert output.read_text() == "earlier results\n"

  resumed = subprocess.run(argv, capture_output=True, text=True, env=ENV)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resuming: {len(kept)} of 60 prompts are already in {partial}" in resumed.stderr
  records = _lines(output)
  assert [r["prompt"] for r in records] == texts and records[:len(kept)] == kept and not partial.exists()
  # A prompt decoded after the resume draws as in an uninterrupted run (its randomness: seed and text).
  alone = generate.main(["--drafter", pair[0], "--verifier", pair[1], "--no_cache", "--prompt", texts[-1],
                         "--max_new_tokens", "8", "--no_eos", "--seed", "3"])
  assert alone[0]["tokens"] == records[-1]["tokens"]


def test_sweep_interrupted_keeps_its_finished_points_whole(tmp_path):
  output = tmp_path / "results.jsonl"
  argv = command("sweep", "--gin_file=configs/experiments/smoke.gin", f"--gin_bindings=Experiment.output = '{output}'")
  result, _ = interrupt(argv, lambda err: output.exists() and output.read_text().count("\n") >= 1, cwd=tmp_path)
  line = interrupted_line(result, "specdec-sweep")
  records = _lines(output)
  finished = "1 finished point is" if len(records) == 1 else f"{len(records)} finished points are"
  assert line.endswith(f"{finished} in {output}; the same command resumes (finished points are skipped)"), line
  assert all(set(RECORD_KEYS) <= set(record) for record in records)
  assert len(read_results(output)) == len(records)
  assert "Path not found" not in result.stderr   # run from outside the checkout


def test_train_interrupted_keeps_its_checkpoints(tmp_path):
  model_dir = tmp_path / "model"
  argv = command("train", "--gin_file=configs/train/tiny_synthetic.gin",
                 f"--gin_bindings=train.model_dir = '{model_dir}'", "--gin_bindings=train.num_steps = 100000",
                 "--gin_bindings=train.save_every = 20", "--gin_bindings=train.log_every = 10")
  result, _ = interrupt(argv, lambda err: (model_dir / "20").is_dir(), cwd=tmp_path)
  line = interrupted_line(result, "specdec-train")
  assert f"checkpoints in {model_dir} are kept (latest: step " in line and "the same command resumes from it" in line
  assert "Path not found" not in result.stderr


def test_plot_interrupted_leaves_the_previous_figures_whole(tmp_path):
  results = tmp_path / "results.jsonl"
  shutil.copy(REPO_ROOT / "experiments" / "cascades_synopsis" / "results.jsonl", results)
  (tmp_path / "pareto.png").write_bytes(b"the previous figure")
  argv = command("plot", f"--results={results}")
  result, _ = interrupt(argv, lambda err: any(tmp_path.glob(".plot-*")), cwd=tmp_path)   # while drawing
  line = interrupted_line(result, "specdec-plot")
  assert line.endswith(f"no figure or table was written (those in {tmp_path} are as they were); the same command "
                       "writes them"), line
  assert (tmp_path / "pareto.png").read_bytes() == b"the previous figure" and not list(tmp_path.glob(".plot-*"))
