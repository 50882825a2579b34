"""The shipped SentencePiece vocabulary (data/vocab/): T5's special ids, exact round trips of German and of
any UTF-8 text, a tokens-per-word rate close to the one measured when it was chosen, other models from a
path, clear errors, and the optional seqio adapter giving the same ids."""

import io
import shutil

import pytest
import sentencepiece as spm

from specdec.data import debian, tasks, vocab

GERMAN = ["Größenänderung für Übersetzungen", "Äpfel, Öl, Übermut — straße"]
ENGLISH = ["This package contains the development files for libfoo.",
           "Speculative decoding drafts 5 tokens, then verifies them in one call."]
ANY_UTF8 = ["Emoji 🙂🚀 and snowman ☃", "日本語のテキスト", "Кириллица и العربية",
            "naïve café, Øresund, Łódź"]


@pytest.fixture(scope="module")
def vocabulary() -> vocab.Vocabulary:
  return vocab.load_vocabulary()


def test_shipped_vocabulary_has_t5_special_ids(vocabulary):
  assert vocabulary.path == vocab.DEFAULT_VOCAB_PATH
  assert vocabulary.vocab_size == 8192
  assert (vocabulary.pad_id, vocabulary.eos_id, vocabulary.unk_id) == (0, 1, 2)
  ids = vocabulary.encode(ENGLISH[0])
  assert vocabulary.eos_id not in ids and vocabulary.pad_id not in ids  # no bos, eos appended by the caller


@pytest.mark.parametrize("text", GERMAN + ENGLISH)
def test_tokenizer_round_trips_german_umlauts_and_english(vocabulary, text):
  ids = vocabulary.encode(text)
  assert vocabulary.decode(ids) == text
  assert vocabulary.unk_id not in ids


def test_german_letters_are_pieces_not_bytes():
  processor = spm.SentencePieceProcessor(model_file=str(vocab.DEFAULT_VOCAB_PATH))
  for letter in "äöüÄÖÜß":
    ids = processor.EncodeAsIds(f"x{letter}x")
    assert not any(processor.IsByte(i) for i in ids), (letter, processor.IdToPiece(ids))


@pytest.mark.parametrize("text", ANY_UTF8)
def test_any_utf8_round_trips_by_byte_fallback(vocabulary, text):
  ids = vocabulary.encode(text)
  assert vocabulary.decode(ids) == text
  assert vocabulary.unk_id not in ids


def test_whitespace_is_normalised_like_t5(vocabulary):
  assert vocabulary.decode(vocabulary.encode("  first line\n\n  second\tline ")) == "first line second line"


def test_decode_stops_at_eos_skips_pad_and_reads_unknown_ids_as_unk(vocabulary):
  ids = vocabulary.encode("Größe")
  assert vocabulary.decode(ids + [vocabulary.eos_id] + vocabulary.encode("danach")) == "Größe"
  assert vocabulary.decode(ids + [vocabulary.pad_id] * 3) == "Größe"
  unk_text = vocabulary.decode([vocabulary.unk_id])
  assert vocabulary.decode(ids + [vocabulary.vocab_size + 5]) == "Größe" + unk_text


def test_sample_validation_text_round_trips_at_the_measured_rate(vocabulary):
  """Tokens per word on the shipped sample's validation text: 1.60 (en), 2.07 (de) when shipped; the
  full validation split gives 1.63 / 2.11 (data/vocab/README.md)."""
  texts = {"en": [r["text"] for r in debian.load("debian_lm", "validation", source="sample")],
           "de": [r["de"] for r in debian.load("debian_en_de", "validation", source="sample")
                  if r["unit"] != "sentence"]}
  bound = {"en": 1.8, "de": 2.3}
  for language, language_texts in texts.items():
    encoded = [vocabulary.encode(text) for text in language_texts]
    for text, ids in zip(language_texts, encoded):
      assert vocabulary.decode(ids) == " ".join(text.split())
    tokens_per_word = sum(map(len, encoded)) / sum(len(text.split()) for text in language_texts)
    assert 1.0 < tokens_per_word < bound[language], language


def test_any_sentencepiece_model_loads_from_a_path_with_its_own_ids(tmp_path):
  """A model with SentencePiece's default ids (unk 0, bos 1, eos 2, no pad), standing in for T5's file."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(ENGLISH * 10 + GERMAN * 10), model_writer=model, vocab_size=60,
      hard_vocab_limit=False, minloglevel=2)
  path = tmp_path / "other.model"
  path.write_bytes(model.getvalue())
  other = vocab.load_vocabulary(path)
  assert (other.unk_id, other.eos_id, other.pad_id, other.bos_id) == (0, 2, -1, 1)
  assert other.path == path and other.vocab_size <= 60
  assert other.decode(other.encode(GERMAN[0])) == GERMAN[0]
  # A vocabulary with <bos> (Gemma's) starts decoder-only prompts with it; T5's encoder inputs and the
  # shipped vocabulary (no bos) are unchanged.
  ids = other.encode(ENGLISH[0])
  prompts, lengths = tasks.prompt_batch([ENGLISH[0]], vocab=other)
  assert prompts[0, :lengths[0]].tolist() == [1] + ids
  prompts, lengths = tasks.prompt_batch([ENGLISH[0]], vocab=other, encoder_decoder=True)
  assert prompts[0, :lengths[0]].tolist() == ids
  prompt, _ = tasks.encode_example(tasks.get_task("debian_synopsis"), other, {"document": ENGLISH[0], "summary": "x"})
  assert prompt[0] == 1 and prompt.count(1) == 1
  shipped = vocab.load_vocabulary()
  assert shipped.bos_id is None and shipped.prompt_start == []


def test_missing_or_invalid_path_raises_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no SentencePiece model at .*nowhere.model.*gsutil cp"):
    vocab.load_vocabulary(tmp_path / "nowhere.model")
  not_a_model = tmp_path / "vocab.model"
  not_a_model.write_text("not a model")
  with pytest.raises(ValueError, match="is not a SentencePiece model"):
    vocab.load_vocabulary(not_a_model)


def test_seqio_adapter_encodes_the_same_ids(vocabulary, tmp_path):
  pytest.importorskip("seqio", reason="seqio is optional (`pip install seqio`, ~3 GB with TensorFlow)")
  import tensorflow as tf

  copied = tmp_path / "copy.model"
  shutil.copyfile(vocab.DEFAULT_VOCAB_PATH, copied)
  for path in (None, copied):
    seqio_vocabulary = vocab.seqio_vocabulary(path)
    assert seqio_vocabulary.vocab_size == vocabulary.vocab_size
    assert (seqio_vocabulary.pad_id, seqio_vocabulary.eos_id, seqio_vocabulary.unk_id) == (0, 1, 2)
  for text in GERMAN + ENGLISH + ANY_UTF8:
    ids = vocabulary.encode(text)
    assert seqio_vocabulary.encode(text) == ids
    assert seqio_vocabulary.encode_tf(tf.constant(text)).numpy().tolist() == ids
    assert seqio_vocabulary.decode(ids + [vocabulary.eos_id, 5]) == text
  assert vocab.seqio_vocabulary(extra_ids=100).vocab_size == vocabulary.vocab_size + 100
