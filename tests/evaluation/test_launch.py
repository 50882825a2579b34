"""scripts/launch.py: the Cloud TPU launch of the paper's T5 experiments as a plan of gcloud / gsutil commands;
`--dry_run` prints it and runs nothing."""

import importlib.util
import pathlib
import shlex
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
WMT = "configs/experiments/paper_t5_wmt.gin"


def _launch():
  spec = importlib.util.spec_from_file_location("launch_script", REPO_ROOT / "scripts" / "launch.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module   # its dataclass looks its module up
  spec.loader.exec_module(module)
  return module


launch = _launch()


def test_dry_run_prints_every_stage_in_order_and_runs_nothing(capsys, monkeypatch):
  monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: pytest.fail("--dry_run ran a command"))
  commands = launch.main([f"--config={WMT}", "--tpu=v4-32", "--bucket=gs://my-bucket/exp/", "--dry_run"])
  printed = capsys.readouterr().out.splitlines()
  assert [line for line in printed if not line.startswith("# ")] == [c.shell() for c in commands]
  stages = [c.stage for c in commands]
  assert stages == sorted(stages, key=launch.STAGES.index) and set(stages) == set(launch.STAGES)
  create, *_ = commands
  assert create.argv[:6] == ("gcloud", "compute", "tpus", "tpu-vm", "create", "specdec-wmt")
  assert "--accelerator-type=v4-32" in create.argv and "--zone" in create.argv
  on_workers = [c for c in commands if "ssh" in c.argv]
  assert on_workers and all("--worker=all" in c.argv for c in on_workers)
  scripts = " ".join(c.argv[-1] for c in on_workers)
  assert "pip install -c constraints.txt -e '.[seqio]'" in scripts
  assert "gs://t5-data/pretrained_models/t5x/t5_1_1_small/checkpoint_1000000" in scripts
  assert "--gin_file=configs/train/paper_t5_large.gin --gin_file=configs/train/paper_task_wmt.gin" in scripts
  assert f"scripts/sweep.py --multihost --gin_file={WMT}" in scripts
  assert "gs://my-bucket/exp/results/wmt/" in scripts            # the bucket's trailing slash is dropped
  assert "train.model_dir = 'gs://my-bucket/exp/runs/wmt/large'" in scripts   # one directory for every host
  for command in commands:                                      # each printed line parses back to its argv
    assert tuple(shlex.split(command.shell())) == command.argv


def test_one_stage_and_the_xl_verifier():
  args = launch.parse_args([f"--config={WMT}", "--tpu=v5p-64", "--bucket=gs://bkt", "--stage=finetune",
                            "--verifier=xl", "--name=mine"])
  commands = launch.plan(args)
  assert {c.stage for c in commands} == {"finetune"} and all("mine" in c.argv for c in commands)
  assert "configs/train/paper_t5_xl.gin" in commands[1].argv[-1]


@pytest.mark.parametrize("flag, message", [
    ("--tpu=v9-8", "unknown TPU type 'v9-8'"),
    ("--bucket=my-bucket", "--bucket must be a gs:// path"),
    ("--config=configs/experiments/nope.gin", "does not exist"),
    ("--config=configs/experiments/smoke.gin", "must be a configs/experiments/paper_t5_<task>.gin"),
])
def test_bad_flags_are_refused_naming_them(flag, message, capsys):
  good = {"--config": f"--config={WMT}", "--tpu": "--tpu=v4-8", "--bucket": "--bucket=gs://bkt"}
  good[flag.split("=")[0]] = flag
  with pytest.raises(SystemExit):
    launch.parse_args(list(good.values()))
  assert message in capsys.readouterr().err


GEMMA = "configs/experiments/paper_gemma_2b_27b_gsm8k.gin"


def test_gemma_launch_sizes_the_host_mesh_for_the_27b_verifier_and_skips_finetuning(capsys, monkeypatch):
  monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: pytest.fail("--dry_run ran a command"))
  commands = launch.main([f"--config={GEMMA}", "--tpu=v5p-8", "--bucket=gs://my-bucket", "--dry_run",
                          "--no-compile_sizing"])
  assert "mesh (2, 2) per host at batch 64" in capsys.readouterr().out
  assert {c.stage for c in commands} == set(launch.STAGES) - {"finetune"}
  scripts = " ".join(c.argv[-1] for c in commands if "ssh" in c.argv)
  assert "gs://my-bucket/checkpoints/gemma-2-27b-it checkpoints/" in scripts
  assert f'--gin_file={GEMMA} --gin_bindings="Experiment.mesh_shape = (2, 2)"' in scripts
  # Each host holds both models: weights / model axis + caches / chips must fit 75 % of a chip.
  sizing = launch.size_mesh("v5p-8", "27b", 2048 + 320 + 2, 64)
  weights, caches, _ = launch.gemma_pair_bytes("27b", 2048 + 320 + 2, 64)
  assert 27e9 < weights / 2 < 31e9   # ≈ 2.6 B + 27.2 B parameters, bf16
  assert sizing.per_chip_bytes == weights // 2 + caches // 4 <= sizing.usable_bytes
  # the pairs load in bfloat16 (configs/pairs/gemma2_*.gin); in float32 only a (1, 4) mesh would hold them
  assert launch.gemma_sizing(launch.parse_args([f"--config={GEMMA}", "--tpu=v5p-8", "--bucket=gs://bkt",
                                                "--no-compile_sizing"])) == sizing
  assert launch.size_mesh("v5p-8", "27b", 2048 + 320 + 2, 64, bytes_per_value=4).mesh == (1, 4)
  with pytest.raises(ValueError, match="give a multiple of 2"):
    launch.size_mesh("v6e-8", "27b", 2048 + 320 + 2, 63)
  with pytest.raises(ValueError, match="does not fit a v4-8 host .* lower --batch_size"):
    launch.size_mesh("v4-8", "27b", 2048 + 320 + 2, 64)
  assert launch.size_mesh("v4-8", "27b", 2048 + 320 + 2, 32).mesh == (1, 4)


def test_gemma_host_mesh_is_sized_from_the_compiled_program(monkeypatch):
  """`compiled_sizing` takes the widest 'data' axis whose program libtpu accepts, skips meshes whose weights
  alone exceed a chip, and refuses in one line naming the fix when none fits. What libtpu answers is faked
  here (a Gemma compile takes minutes); tests/tpu/ compiles real programs."""
  from specdec.evaluation import plan
  fake = plan.Topology("v4-8", plan.CHIPS["v4"], tuple(range(4)))
  monkeypatch.setattr(plan, "libtpu_version", lambda: "test")
  monkeypatch.setattr(plan, "topology", lambda name: fake)
  asked = []

  def answer(fits_from_model):
    def decode_facts(setting, topology, mesh, **_):
      asked.append((setting.method, setting.gamma, setting.batch_size, setting.prompt_width, mesh))
      return (dict(fits=True, memory=dict(total=30 << 30)) if mesh[1] >= fits_from_model
              else dict(fits=False, required_bytes=49 << 30))
    return decode_facts

  args = launch.parse_args([f"--config={GEMMA}", "--tpu=v4-8", "--bucket=gs://bkt", "--batch_size=32"])
  monkeypatch.setattr(plan, "decode_facts", answer(fits_from_model=4))
  sizing = launch.gemma_sizing(args)
  assert sizing.compiled and sizing.mesh == (1, 4) and sizing.per_chip_bytes == 30 << 30
  assert "the compiled program needs 30.00 GiB per chip" in sizing.describe()
  # The sweep's speculative program (γ = 1 in the GSM8K config) at the batch and the task's budgets; the
  # (4, 1) mesh is not compiled: the 27B's weights alone exceed a chip.
  assert asked == [("speculative", 1, 32, 2048, (2, 2)), ("speculative", 1, 32, 2048, (1, 4))]
  monkeypatch.setattr(plan, "decode_facts", answer(fits_from_model=8))
  with pytest.raises(ValueError, match=r"does not fit a v4-8 host .*\(2, 2\): 49.0 GiB.* lower --batch_size \(e.g. 16\)"):
    launch.gemma_sizing(args)
