"""Decode programs compiled for TPU v4 on this CPU (libtpu's compile-only devices): what the TPU would run,
read from its optimized HLO, and `specdec-plan`'s report. Skipped, with the reason, where libtpu is not
installed (it has Linux x86-64 wheels only; the test extra installs it)."""

import json

import jax
import jax.numpy as jnp
import pytest

from specdec import models, sampling
from specdec.cli import plan as plan_cli
from specdec.evaluation import hlo, plan, tpu_programs, tpu_topology
from specdec.models import attention_kernel

if plan.libtpu_version() is None:
  pytest.skip("libtpu is not installed (pip install -c constraints.txt libtpu; Linux x86-64 only)",
              allow_module_level=True)

# 8 rows per chip of the (2, 2) mesh's data axis: a TPU tile's 8 sublanes, as in the plans of the papers' pairs.
BATCH, PROMPT, NEW, GAMMA = 16, 16, 32, 3
# Every dimension a multiple of TPU v4's 128 lanes (head_dim 128), so the chips store the weights unpadded and
# the Pallas kernel attends each device's head: a preset of the test's own, planned by `specdec-plan`.
LANES = dict(embed_dim=256, num_layers=2, num_heads=2, qkv_dim=256, hidden_dim=512)
VOCAB = 1536   # 768 per chip: 6 × 128 lanes, a factor no other array of the loop has (`plan.analyse_loop`)
ARGV = ["--topology", "v4-8", "--mesh", "2,2", "--drafter", "lanes", "--verifier", "lanes", "--vocab_size", str(VOCAB),
        "--gamma", str(GAMMA), "--batch_size", str(BATCH), "--prompt_width", str(PROMPT), "--max_new_tokens", str(NEW),
        "--acceptance", "0.5,0.9"]


@pytest.fixture
def lanes_preset(monkeypatch):
  monkeypatch.setitem(models.transformer.PRESETS, "lanes", LANES)


@pytest.fixture(scope="module")
def planned(tmp_path_factory, v4_8):
  """`specdec-plan` of a pair of LANES models on a v4-8's (2, 2) (data, model) mesh, compiled once for the
  module: (argv, what it returned, the folder it wrote)."""
  folder = tmp_path_factory.mktemp("plan")
  argv = ARGV + ["--cache_dir", str(folder / "cache"), "--output", str(folder / "plan.json")]
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(models.transformer.PRESETS, "lanes", LANES)
    return argv, plan_cli.main(argv), folder


def test_speculative_program_for_a_v4_mesh_is_the_tpu_program(planned, v4_8, monkeypatch):
  """The plan's decode program (sampling at T = 1 with the top-p search, as a sweep over top-P compiles it),
  read back from the plan's cache of compiled programs."""
  argv, written, folder = planned
  monkeypatch.setattr(tpu_programs, "_compile", lambda lowered: pytest.fail("not the plan's program"))
  [report] = written["plans"]
  setting = plan.Setting(verifier="lanes", drafter="lanes", vocab_size=VOCAB, params=(("gamma", GAMMA),),
                         batch_size=BATCH, prompt_width=PROMPT, max_new_tokens=NEW)
  facts = plan.decode_facts(setting, v4_8, (2, 2), cache=plan.ProgramCache(str(folder / "cache")))
  program = hlo.parse(facts["hlo"])
  # The TPU's top-p search (no loop) although this process's backend is the CPU: the decode loop and the
  # drafter's loop only. The CPU's search ("bisection") adds loops of its own (checked below).
  assert [loop.depth for loop in hlo.loops(program)] == [0, 1]
  # No cache-sized buffer copied inside the loops (the in-place cache holds on TPU), nor relayouted inside a
  # fusion: the caches are slot-major, [C, B, K·D], and attended by the Pallas kernel where they lie (one custom
  # call per layer and call; with XLA's attention dot, one relayout per K and V of each layer and verification).
  cache_length = report["cache_length"]
  per_layer = (BATCH // 2) * (2 // 2) * cache_length * 128
  for loop in hlo.loops(program):
    assert hlo.moves(program, per_layer, scope=loop, include_fused=True,
                     shape_filter=hlo.dims_contain(cache_length)) == []
  assert "tpu_custom_call" in facts["hlo"]
  # Each chip reads its share of the batch: the prompts enter as [B / data, L].
  parameters = [i for i in program.computations[program.entry] if i.op == "parameter"]
  prompt_shapes = {s.dims for i in parameters for s in i.shapes if s.dtype == "s32" and len(s.dims) == 2}
  assert prompt_shapes == {(BATCH // 2, PROMPT)}
  # Memory: the arguments are the weights' per-chip shares (and the small inputs), within 10 %.
  weights = report["pytrees"]["weights"]
  assert weights <= facts["memory"]["arguments"] <= 1.1 * weights


def test_a_cpu_top_p_search_would_show_as_loops(v4_8):
  """The loop count above can fail: the CPU's bisection search, compiled for the TPU, has loops of its own;
  the TPU's has none."""
  logits = jax.ShapeDtypeStruct((BATCH, GAMMA + 1, VOCAB), jnp.float32,
                                sharding=jax.sharding.SingleDeviceSharding(v4_8.devices[0]))
  for method, has_loops in (("bisection", True), ("top_k", False)):
    compiled = jax.jit(lambda x, method=method: sampling.transform(x, 1.0, 0.9, method=method)).lower(logits).compile()
    assert bool(hlo.loops(hlo.parse(compiled.as_text()))) == has_loops, method


def test_specdec_plan_writes_a_report_and_reuses_its_cache(planned, lanes_preset, monkeypatch):
  argv, written, folder = planned
  assert json.loads((folder / "plan.json").read_text()) == json.loads(json.dumps(written))
  [report] = written["plans"]
  table = (folder / "plan.md").read_text()
  assert "## Memory per chip" in table and "## Roofline tokens/s" in table and "in branches" in table
  assert report["program"]["fits"] and report["mesh"] == dict(data=2, model=2)
  assert set(report["calls"]) == {"verifier_step", "verifier_call", "verifier_prefill", "drafter_step",
                                  "drafter_prefill"}
  for name, call in report["calls"].items():
    assert call["flops"] > 0 and call["hbm_bytes"] > 0 and call["padding"] >= 1 and call["over_arguments"] >= 1
    assert call["collectives"]["all-reduce"]["count"] > 0    # a 'model' axis of 2: Megatron all-reduces
  for step in ("verifier_step", "drafter_step"):             # weights and cache read once, tiles unpadded
    assert report["calls"][step]["over_arguments"] < 1.1
  loops = report["program"]["loops"]
  assert [row["depth"] for row in loops] == [-1, 0, 1]
  # The top-p search's rare fallback (an exact search for a nucleus beyond the top-k candidates) lies in a
  # conditional's branch: its moves are counted apart from what every iteration runs.
  decode_loop = loops[1]
  assert decode_loop["block"]["in_branches"]["materialized"] <= decode_loop["block"]["materialized"]
  # Lean on every iteration: no cache carried between HBM and CMEM (`decoding.TPU_COMPILER_OPTIONS`), and at
  # most 2 moves of [B, γ + 1, V] arrays per block (`partitioning.gather_vocab` gathers the logits as the
  # output projection lays them out).
  for row in loops[1:]:
    assert row["cache"]["async"] == 0, row["cache"]
  block = decode_loop["block"]
  every_iteration = sum(block[kind] - block["in_branches"][kind] for kind in ("materialized", "fused", "async"))
  assert every_iteration <= 2, block
  speeds = report["speeds"]["speculative"]
  assert [row["acceptance"] for row in speeds] == [0.5, 0.9] and speeds[0]["speedup"] < speeds[1]["speedup"]
  # A re-run reads every analysis from the cache: nothing is compiled.
  monkeypatch.setattr(tpu_programs, "_compile", lambda lowered: pytest.fail("compiled again"))
  assert plan_cli.main(argv) == written


def test_a_multi_draft_plan_costs_k_drafts_and_their_tree(planned, v4_8, lanes_preset, tmp_path):
  """SpecTr with K = 2 drafts: the drafter's calls on K·B rows, the verifier's call on the K·γ + 1 tokens of
  their tree, and its blocks' speeds from them (against the speculative plan of the same pair)."""
  [speculative] = planned[1]["plans"]
  setting = plan.Setting(verifier="lanes", drafter="lanes", vocab_size=VOCAB, method="spectr",
                         params=(("gamma", GAMMA), ("num_drafts", 2)), batch_size=BATCH, prompt_width=PROMPT,
                         max_new_tokens=NEW)
  report = plan.plan(setting, v4_8, (2, 2), acceptances=(0.5, 0.9), cache=plan.ProgramCache(str(tmp_path)))
  flops = {name: report["calls"][name]["flops"] / speculative["calls"][name]["flops"]
           for name in ("drafter_step", "verifier_call", "verifier_step")}
  assert 1.8 < flops["drafter_step"] < 2.2                     # 2·B rows
  assert 1.5 < flops["verifier_call"] < 2.0                    # 2γ + 1 = 7 tokens instead of γ + 1 = 4
  assert flops["verifier_step"] == pytest.approx(1, rel=0.05)   # a longer cache: the tree's overhang
  calls, [slow, fast] = report["calls"], report["speeds"]["speculative"]
  draft = calls["drafter_step"]["roofline_us"]
  assert slow["block_us"] == pytest.approx(GAMMA * draft + calls["verifier_call"]["roofline_us"] + 0.5 ** GAMMA * draft)
  assert slow["speedup"] < fast["speedup"]


def test_a_multi_draft_loop_at_batch_1_copies_no_cache(lanes_preset):
  """SpecTr at batch 1 on one chip: the tree path's copy (`base.copy_slots`) updates the verifier's caches in
  place. With the gathered entries fused into the scatter, the TPU compiler copied every cache twice per block."""
  setting = plan.Setting(verifier="lanes", drafter="lanes", vocab_size=VOCAB, method="spectr",
                         params=(("gamma", GAMMA), ("num_drafts", 2)), batch_size=1, prompt_width=PROMPT,
                         max_new_tokens=NEW)
  topology = plan.topology("v4-1chip")
  facts = plan.decode_facts(setting, topology, (1, 1))
  drafter, verifier = plan.abstract_pair(setting, topology.devices[0])
  cache_length = plan.cache_length_of(setting, drafter, verifier)
  program = hlo.parse(facts["hlo"])
  for loop in hlo.loops(program):
    assert hlo.moves(program, cache_length * LANES["qkv_dim"], scope=loop, include_fused=True,
                     shape_filter=hlo.dims_contain(cache_length)) == []


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


def test_a_feature_drafters_draft_vocabulary_is_planned_by_its_size(tmp_path):
  """`--draft_vocabulary k` (FR-Spec): the head's step reads and scores k rows of the verifier's output layer, not
  all V; its re-read of a verified block (no logits) is the same program either way."""
  common = ["--topology", "v4-1chip", "--drafter", "feature", "--verifier", "tiny", "--vocab_size", "256", "--gamma",
            "2", "--batch_size", "1", "--prompt_width", "16", "--max_new_tokens", "16", "--acceptance", "0.5",
            "--cache_dir", str(tmp_path)]
  whole, = plan_cli.main(common)["plans"]
  drafts, = plan_cli.main(common + ["--draft_vocabulary", "32"])["plans"]
  assert drafts["setting"]["draft_vocabulary"] == 32 and "draft_vocabulary" not in whole["setting"]
  step, whole_step = drafts["calls"]["drafter_step"], whole["calls"]["drafter_step"]
  assert step["flops"] < whole_step["flops"] and step["hbm_bytes"] < whole_step["hbm_bytes"]
  assert drafts["calls"]["drafter_reread"]["hbm_bytes"] == whole["calls"]["drafter_reread"]["hbm_bytes"]
  with pytest.raises(ValueError, match=r"draft_vocabulary must lie in \[0, 256\]"):
    plan_cli.main(common + ["--draft_vocabulary", "257"])
  with pytest.raises(ValueError, match="a draft vocabulary \\(8 ids\\) is a feature drafter's"):
    plan_cli.main([*common[:2], "--drafter", "tiny", *common[4:], "--draft_vocabulary", "8"])


def test_a_long_prompts_prefill_compiles_for_a_chip(lanes_preset, v4_8):
  """A 2,048-token prefill of a model whose heads the Pallas kernel reads: a grid step of all its queries (a
  2,048 × 2,064 visible mask) exceeds the chip's scoped VMEM, which made libtpu refuse GSM8K's prefills; the
  kernel takes it in blocks of queries (`attention_kernel.query_block`), as it takes the decode steps whole."""
  setting = plan.Setting(verifier="lanes", drafter=None, vocab_size=VOCAB, method="autoregressive", params=(),
                         batch_size=1, prompt_width=2048, max_new_tokens=16)
  chip = v4_8.devices[0]
  _, model = plan.abstract_pair(setting, chip)
  heads = dict(key_heads=LANES["num_heads"], groups=1, head_dim=LANES["qkv_dim"] // LANES["num_heads"], itemsize=2,
               has_bias=False)
  assert attention_kernel.query_block(2048, 2064, **heads) < 2048
  prefill = plan.call_program(model, chip, batch_size=1, cache_length=2064, n=2048, prefill=True).compile()
  step = plan.call_program(model, chip, batch_size=1, cache_length=2064, n=1).compile()
  assert "tpu_custom_call" in prefill.as_text() and "tpu_custom_call" in step.as_text()
  # The widest call the budget lets the kernel take whole compiles within the chip's VMEM: the estimate is not
  # short.
  widest = max(n for n in range(1, 2049) if attention_kernel.query_block(n, 2064, **heads) == n)
  assert 64 <= widest < 2048
  call = plan.call_program(model, chip, batch_size=1, cache_length=2064, n=widest).compile()
  assert "tpu_custom_call" in call.as_text()
  # Its flops, as a plan reads them, count the kernel's attention (4 · n · C · D per query head and layer; more
  # than the rest of this call's).
  attention = 4 * LANES["num_heads"] * widest * 2064 * heads["head_dim"] * LANES["num_layers"]
  assert call.cost_analysis()["flops"] > attention
