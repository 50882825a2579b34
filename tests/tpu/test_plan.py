"""Decode programs compiled for TPU v4 on this CPU (libtpu's compile-only devices): what the TPU would run,
read from its optimized HLO, and `specdec-plan`'s report. Skipped, with the reason, where libtpu is not
installed (it has Linux x86-64 wheels only; the test extra installs it)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, models
from specdec.cli import plan as plan_cli
from specdec.evaluation import hlo, plan
from specdec.models import partitioning
from specdec.models.transformer import TransformerConfig, init

if plan.libtpu_version() is None:
  pytest.skip("libtpu is not installed (pip install -c constraints.txt libtpu; Linux x86-64 only)",
              allow_module_level=True)

BATCH, PROMPT, NEW, GAMMA = 4, 16, 32, 3
# Every dimension a multiple of TPU v4's 128 lanes (head_dim 128), so the chips store the weights unpadded.
CONFIG = dict(vocab_size=1024, max_len=128, emb_dim=256, num_layers=2, num_heads=2, qkv_dim=256, mlp_dim=512,
              dtype=jnp.bfloat16)


@pytest.fixture(scope="module")
def v4_8():
  return plan.topology("v4-8")


def _abstract_pair(target):
  build = lambda seed: jax.eval_shape(lambda: init(TransformerConfig(**CONFIG), jax.random.PRNGKey(seed)))
  return partitioning.abstract_model(build(1), target), partitioning.abstract_model(build(2), target)


def _compiled(target, **sampling):
  drafter, verifier = _abstract_pair(target)
  prompts = jax.ShapeDtypeStruct((BATCH, PROMPT), jnp.int32)
  lowered = decoding.lower(jax.random.PRNGKey(0), drafter, verifier, prompts, method="speculative",
                           max_new_tokens=NEW, eos_id=None, gamma=GAMMA, **sampling)
  return lowered.compile(), drafter, verifier


def test_speculative_program_for_a_v4_mesh_is_the_tpu_program(v4_8):
  mesh = partitioning.make_mesh(data=2, model=2, devices=v4_8.devices)
  compiled, drafter, verifier = _compiled(mesh, temperature=1.0, top_p=0.9)
  program = hlo.parse(compiled.as_text())
  # The TPU's top-p search (no loop) although this process's backend is the CPU: the decode loop and the
  # drafter's loop only. The CPU's search ("bisection") adds loops of its own (checked below).
  assert [loop.depth for loop in hlo.loops(program)] == [0, 1]
  # No cache-sized buffer copied inside the loops (the in-place cache holds on TPU), nor relayouted inside a
  # fusion: the caches are slot-major, [C, B, K·D], and attended by the Pallas kernel where they lie (one custom
  # call per layer and call; with XLA's attention dot, one relayout per K and V of each layer and verification).
  cache_length = decoding.required_cache_length(decoding.METHODS["speculative"], dict(gamma=GAMMA), verifier,
                                                decoding.as_drafter(drafter), PROMPT, NEW)
  per_layer = (BATCH // 2) * (2 // 2) * cache_length * 128
  for loop in hlo.loops(program):
    assert hlo.moves(program, per_layer, scope=loop, include_fused=True,
                     shape_filter=hlo.dims_contain(cache_length)) == []
  assert "tpu_custom_call" in compiled.as_text()
  # Each chip reads its share of the batch: the prompts enter as [B / data, L].
  parameters = [i for i in program.computations[program.entry] if i.op == "parameter"]
  prompt_shapes = {s.dims for i in parameters for s in i.shapes if s.dtype == "s32" and len(s.dims) == 2}
  assert prompt_shapes == {(BATCH // 2, PROMPT)}
  # Memory: the arguments are the weights' per-chip shares (and the small inputs), within 10 %.
  weights = plan.per_device_bytes([drafter.params, verifier.params])
  arguments = compiled.memory_analysis().argument_size_in_bytes
  assert weights <= arguments <= 1.1 * weights


def test_a_cpu_top_p_search_would_show_as_loops(v4_8):
  """The loop count above can fail: the CPU's bisection search, named explicitly, compiles loops of its own."""
  compiled, _, _ = _compiled(v4_8.devices[0], sampling=decoding.Sampling(temperature=1.0, top_p=0.9,
                                                                         top_p_method="bisection"))
  assert len(hlo.loops(hlo.parse(compiled.as_text()))) > 2


def test_specdec_plan_writes_a_report_and_reuses_its_cache(tmp_path, v4_8, monkeypatch, capsys):
  argv = ["--topology", "v4-8", "--mesh", "2,2", "--drafter", "tiny", "--verifier", "tiny", "--vocab_size", "256",
          "--gamma", "3", "--batch_size", "4", "--prompt_width", "16", "--max_new_tokens", "16",
          "--acceptance", "0.5,0.9", "--cache_dir", str(tmp_path / "cache"), "--output", str(tmp_path / "plan.json")]
  written = plan_cli.main(argv)
  assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(json.dumps(written))
  [report] = written["plans"]
  table = (tmp_path / "plan.md").read_text()
  assert "## Memory per chip" in table and "## Roofline tokens/s" in table
  assert report["program"]["fits"] and report["mesh"] == dict(data=2, model=2)
  assert set(report["calls"]) == {"verifier_step", "verifier_call", "verifier_prefill", "drafter_step",
                                  "drafter_prefill"}
  for call in report["calls"].values():
    assert call["flops"] > 0 and call["hbm_bytes"] > 0 and call["padding"] >= 1
    assert call["collectives"]["all-reduce"]["count"] > 0    # a 'model' axis of 2: Megatron all-reduces
  assert [row["depth"] for row in report["program"]["loops"]] == [-1, 0, 1]
  speeds = report["speeds"]["speculative"]
  assert [row["acceptance"] for row in speeds] == [0.5, 0.9] and speeds[0]["speedup"] < speeds[1]["speedup"]
  # A re-run reads every analysis from the cache: nothing is compiled.
  monkeypatch.setattr(plan, "_compile", lambda lowered: pytest.fail("compiled again"))
  assert plan_cli.main(argv) == written


@pytest.mark.parametrize("argv,message", [
    (["--topology", "v4-7"], "unknown TPU topology 'v4-7'; known: v4-1chip, v4-8"),
    (["--topology", "v4-8", "--mesh", "3,1"], r"mesh \(data=3, model=1\) must multiply to the 4 chips of v4-8"),
    (["--topology", "v4-8", "--mesh", "4,1", "--batch_size", "6"], "batch size 6 is not a multiple of the mesh's "
                                                                    "data axis \\(4\\)"),
    (["--topology", "v4-8", "--mesh", "x"], "--mesh must be DATA,MODEL"),
    (["--topology", "v4-8", "--acceptance", "1.5"], "--acceptance must be comma-separated numbers in"),
])
def test_bad_plans_are_one_line_naming_the_constraint(argv, message):
  with pytest.raises(ValueError, match=message):
    plan_cli.main(argv + ["--verifier", "tiny", "--drafter", "tiny", "--vocab_size", "256"])


def test_without_libtpu_it_says_how_to_install(monkeypatch):
  monkeypatch.setattr(plan, "libtpu_version", lambda: None)
  with pytest.raises(ImportError, match="pip install -c constraints.txt libtpu"):
    plan.topology("v4-8")


def test_a_feature_drafter_is_planned_with_its_head_step_and_reread(tmp_path):
  """`--drafter feature`: EAGLE's head over the verifier, its drafting step (the head and the verifier's
  output layer) and its re-read of a verified block each compiled alone, in the block's cost."""
  written = plan_cli.main(["--topology", "v4-1chip", "--drafter", "feature", "--verifier", "tiny", "--vocab_size",
                           "256", "--gamma", "3", "--batch_size", "2", "--prompt_width", "16", "--max_new_tokens", "16",
                           "--acceptance", "0.5", "--cache_dir", str(tmp_path)])
  [report] = written["plans"]
  assert report["program"]["fits"]
  calls = report["calls"]
  assert set(calls) == {"verifier_step", "verifier_call", "verifier_prefill", "drafter_step", "drafter_reread"}
  [row] = report["speeds"]["speculative"]
  assert row["block_us"] == pytest.approx(3 * calls["drafter_step"]["roofline_us"] + calls["verifier_call"]["roofline_us"]
                                          + calls["drafter_reread"]["roofline_us"])
