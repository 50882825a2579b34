"""Self-distillation data and cached features for a feature head (training/self_distill.py,
training/feature_cache.py), on a tiny Llama and a character vocabulary: prompts of every kind, the verifier's
answers, resumption after an interruption, feature shards equal to the verifier's own, and a head trained from
them."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import models
from specdec.training import feature_cache, feature_head, self_distill

V = 96


class CharVocabulary:
  """Characters as ids (printable ASCII from 32; id 1 is EOS), with a ChatML-like template."""
  eos_id, pad_id, prompt_start, chat_template = 1, 0, [], "chatml"

  def encode(self, text):
    return [2 + (ord(c) - 32) % (V - 2) for c in text]

  def decode(self, ids):
    return "".join(chr(32 + i - 2) for i in ids if i >= 2)

  def format_chat(self, messages):
    return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"

  def chat_prompt(self, text):
    return self.prompt_start + self.encode(self.format_chat([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def verifier():
  return models.build("llama_tiny", vocab_size=V, seed=0, max_length=1024)


def _run(out, verifier, n=12):
  self_distill.write_prompts(str(out), verifier, CharVocabulary(), n=n, batch_size=4, source="sample",
                             self_written_tokens=8, log=lambda _: None)
  return self_distill.write_responses(str(out), verifier, CharVocabulary(), n=n, batch_size=4, max_new_tokens=8,
                                      log=lambda _: None)


def test_prompts_of_every_kind_are_answered_and_an_interrupted_run_resumes(tmp_path, verifier):
  whole = _run(tmp_path / "whole", verifier, n=len(self_distill.MIX) + 3)
  kinds = [r["kind"] for r in whole]
  assert set(kinds) == set(self_distill.KINDS) and [r["id"] for r in whole] == list(range(len(whole)))
  assert {r["temperature"] for r in whole} == {0.0, 1.0}
  assert all(r["response_ids"] and CharVocabulary.eos_id not in r["response_ids"] for r in whole)
  # Interrupted: the responses file holds one whole batch and half a line of the next.
  cut = tmp_path / "cut"
  _run(cut, verifier, n=len(self_distill.MIX) + 3)
  lines = (cut / self_distill.RESPONSES).read_text().splitlines(keepends=True)
  (cut / self_distill.RESPONSES).write_text("".join(lines[:4]) + lines[4][:10])
  resumed = self_distill.write_responses(str(cut), verifier, CharVocabulary(), batch_size=4, max_new_tokens=8,
                                         log=lambda _: None)
  assert resumed == whole
  assert [json.loads(line) for line in (cut / self_distill.RESPONSES).read_text().splitlines()] == whole


def test_a_corpus_seeds_a_fresh_run_which_goes_on_after_it(tmp_path, verifier):
  whole = _run(tmp_path / "whole", verifier, n=12)
  _run(tmp_path / "first", verifier, n=8)
  corpus = tmp_path / "corpus"
  assert self_distill.export_corpus(str(tmp_path / "first"), str(corpus)) == [
      str(corpus / (self_distill.PROMPTS + ".gz")), str(corpus / (self_distill.RESPONSES + ".gz"))]
  assert self_distill.seed_from(str(corpus), str(tmp_path / "second")) == 8
  assert _run(tmp_path / "second", verifier, n=12) == whole   # the corpus' 8, then 4 more as a whole run writes
  assert _run(tmp_path / "second", verifier, n=5) == whole[:5]
  assert self_distill.seed_from(str(corpus), str(tmp_path / "second")) == 12   # a run under way is left as it is
  os.remove(corpus / (self_distill.RESPONSES + ".gz"))
  with pytest.raises(FileNotFoundError, match="responses.jsonl.gz"):
    self_distill.seed_from(str(corpus), str(tmp_path / "third"))
  with pytest.raises(ValueError, match="corpus 'smollm2' seeds self-distilled data only; data is 'debian'"):
    feature_head.train_and_save(verifier="no-such-model", out=str(tmp_path / "head"), data="debian", corpus="smollm2")


def test_the_shipped_corpus_is_what_the_recipe_draws_and_other_seeds_are_refused(tmp_path, monkeypatch):
  import gin
  from specdec.cli import train
  from specdec.data import shipped
  gin.clear_config()
  try:
    train.parse_gin(["configs/train/smollm2_eagle.gin"], [])
    settings = {name: gin.query_parameter(f"train_feature_head.{name}") for name in ("corpus", "source", "prompts")}
  finally:
    gin.clear_config()
  out = str(tmp_path / "seeded")
  answered = self_distill.seed_from(str(shipped.path("data", "self_distilled", settings["corpus"])), out)
  assert answered >= settings["prompts"]   # the recipe's answers are all shipped: it writes none
  # No prompt is left to write, so no verifier is called; the corpus' templated prompts are the ones drawn here.
  prompts = self_distill.write_prompts(out, None, None, n=answered, source=settings["source"], log=lambda _: None)
  responses = [json.loads(line) for line in open(os.path.join(out, self_distill.RESPONSES))]
  assert [p["id"] for p in prompts] == [r["id"] for r in responses] == list(range(answered))
  assert all(r["response_ids"] and r["kind"] == p["kind"] for p, r in zip(prompts, responses))
  seeds = self_distill._seeds()
  seeds["concepts"] = seeds["concepts"][::-1]
  monkeypatch.setattr(self_distill, "_seeds", lambda: seeds)
  with pytest.raises(ValueError, match="prompt 4 is not the one seed 0"):   # prompt 4: the first explanation
    self_distill.write_prompts(out, None, None, n=answered, source=settings["source"], log=lambda _: None)


def test_cached_features_are_the_verifiers_and_train_a_head(tmp_path, verifier):
  responses = _run(tmp_path, verifier, n=16)
  paths = feature_cache.write_features(str(tmp_path), verifier, responses, max_length=256, batch_size=4,
                                       log=lambda _: None)
  assert feature_cache.write_features(str(tmp_path), verifier, responses, log=lambda _: None) == paths   # kept
  shards = feature_cache.load_shards(paths)
  tokens, weights = shards[0]["tokens"], shards[0]["weights"]
  first = responses[0]
  assert weights[0, len(first["prompt_ids"]) - 1] == 1 and weights[0, len(first["prompt_ids"]) - 2] == 0
  _, hidden = verifier.logits(jnp.asarray(tokens[:2]), return_hidden=True)
  for row in range(2):   # each row's real positions (the padding's features are not kept)
    length = np.flatnonzero(weights[row])[-1] + 1
    np.testing.assert_allclose(shards[0]["features"][row, :length], np.asarray(hidden)[row, :length], rtol=2e-3,
                               atol=2e-3)
  batches = feature_cache.cached_batches(shards, batch_size=4, seed=0)
  epoch = [next(batches) for _ in range(4)]   # 16 rows: one epoch, every response token once, padding cut
  assert sum(b["weights"].sum() for b in epoch) == sum(shard["weights"].sum() for shard in shards)
  for b in epoch:
    length = max((np.flatnonzero(row)[-1] + 1 for row in b["weights"] if row.any()), default=1)
    assert b["inputs"].shape[1] == min(-(-length // feature_cache.WIDTH_STEP) * feature_cache.WIDTH_STEP,
                                       tokens.shape[1])
  batch = epoch[0]
  head = feature_head.init(verifier, jax.random.PRNGKey(0)).with_draft_vocabulary(np.arange(0, V, 2))
  cached = feature_head.losses(head.params, head, verifier, batch["inputs"], batch["weights"], None, 0.0,
                               batch["features"])
  computed = feature_head.losses(head.params, head, verifier, batch["inputs"], batch["weights"], None, 0.0)
  for name in ("regression", "classification"):
    np.testing.assert_allclose(cached[name], computed[name], rtol=1e-2)
  # EAGLE-3's training-time test: pass 1 is the loss above, pass 2 (the second draft) adds 0.8 of its own.
  unrolled = feature_head.losses(head.params, head, verifier, batch["inputs"], batch["weights"], None, 0.0,
                                 batch["features"], unroll=2)
  np.testing.assert_allclose(unrolled["top1_agreement"], cached["top1_agreement"])
  assert unrolled["regression"] > cached["regression"] and 0 <= unrolled["top1_agreement_2"] <= cached["tokens"]
  before = feature_head.evaluate(head, verifier, [batch])
  trained, record = feature_head.train(verifier, batches, steps=60, learning_rate=3e-3, warmup_steps=5,
                                       draft_ids=np.arange(0, V, 2), unroll=2, log_every=1000, held_out=[batch],
                                       eval_every=25, log=lambda _: None)
  after = feature_head.evaluate(trained, verifier, [batch])
  assert [step for step, _ in record["held_out_curve"]] == [25, 50, 60]
  assert record["held_out_curve"][-1][1] == pytest.approx(after["top1_agreement"])
  assert record["draft_vocabulary"] == V // 2 and record["unroll"] == 2 and trained.draft_ids.shape == (V // 2,)
  assert after["classification"] < before["classification"] and after["regression"] < before["regression"]


def test_fused_features_are_cached_apart_and_train_a_head_that_reads_them(tmp_path, verifier):
  """EAGLE-3's fused features: layer 0's output beside the last hidden state, in features_l0/ (the plain cache
  is kept as it is); a head reading them trains (its second draft, reading its own first, through the training-time
  test) and records the layers it reads."""
  responses = _run(tmp_path, verifier, n=8)
  fused = verifier.with_feature_layers((0,))
  plain = feature_cache.load_shards(feature_cache.write_features(str(tmp_path), verifier, responses,
                                                                 log=lambda _: None))
  paths = feature_cache.write_features(str(tmp_path), fused, responses, log=lambda _: None)
  assert all(os.path.basename(os.path.dirname(path)) == "features_l0" for path in paths)
  shards = feature_cache.load_shards(paths)
  e = verifier.hidden_size
  assert shards[0]["features"].shape[-1] == 2 * e
  np.testing.assert_array_equal(shards[0]["features"][..., e:], plain[0]["features"])
  batch = next(feature_cache.cached_batches(shards, batch_size=4, seed=0))
  head = feature_head.init(verifier, jax.random.PRNGKey(0), feature_layers=(0,))
  cached = feature_head.losses(head.params, head, fused, batch["inputs"], batch["weights"], None, 0.0,
                               batch["features"], unroll=2)
  computed = feature_head.losses(head.params, head, fused, batch["inputs"], batch["weights"], None, 0.0, unroll=2)
  for name in ("regression", "classification"):
    np.testing.assert_allclose(cached[name], computed[name], rtol=1e-2)
  before = feature_head.evaluate(head, fused, [batch], unroll=2)
  trained, record = feature_head.train(fused, feature_cache.cached_batches(shards, batch_size=4, seed=1), steps=40,
                                       learning_rate=3e-3, warmup_steps=5, unroll=2, feature_layers=(0,),
                                       log_every=1000, log=lambda _: None)
  after = feature_head.evaluate(trained, fused, [batch], unroll=2)
  assert record["feature_layers"] == [0] and trained.config.feature_layers == (0,)
  assert after["classification"] < before["classification"] and after["regression"] < before["regression"]
  saved = feature_head.load_head(os.path.dirname(feature_head.save_head(str(tmp_path / "head"), trained, record)))
  assert saved.config.feature_layers == (0,)
  np.testing.assert_array_equal(saved.params["reduce"]["kernel"], trained.params["reduce"]["kernel"])


def test_a_grown_run_rewrites_the_last_shard_and_too_few_rows_are_refused(tmp_path, verifier):
  responses = _run(tmp_path, verifier, n=8)
  first = feature_cache.write_features(str(tmp_path), verifier, responses[:5], log=lambda _: None)
  assert feature_cache.load_shards(first)[0]["tokens"].shape[0] == 5
  grown = feature_cache.load_shards(feature_cache.write_features(str(tmp_path), verifier, responses,
                                                                 log=lambda _: None))
  assert grown[0]["tokens"].shape[0] == 8
  with pytest.raises(ValueError, match="8 rows make no batch of 16"):
    next(feature_cache.cached_batches(grown, batch_size=16))


def test_an_interrupted_head_training_resumes_from_its_checkpoint(tmp_path, verifier):
  responses = _run(tmp_path, verifier, n=16)
  shards = feature_cache.load_shards(feature_cache.write_features(str(tmp_path), verifier, responses,
                                                                  log=lambda _: None))
  settings = dict(steps=6, learning_rate=3e-3, warmup_steps=2, save_every=3, log_every=1000, log=lambda _: None)
  whole, _ = feature_head.train(verifier, feature_cache.cached_batches(shards, batch_size=4), **settings,
                                checkpoint_dir=str(tmp_path / "whole"))

  def stopping(batches, after):
    for step, batch in enumerate(batches):
      if step == after:
        raise KeyboardInterrupt
      yield batch
  with pytest.raises(KeyboardInterrupt):
    feature_head.train(verifier, stopping(feature_cache.cached_batches(shards, batch_size=4), 4), **settings,
                       checkpoint_dir=str(tmp_path / "cut"))
  resumed, _ = feature_head.train(verifier, feature_cache.cached_batches(shards, batch_size=4), **settings,
                                  checkpoint_dir=str(tmp_path / "cut"))
  jax.tree.map(np.testing.assert_array_equal, resumed.params, whole.params)
