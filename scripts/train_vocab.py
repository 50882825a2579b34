"""Trains the shared English+German SentencePiece vocabulary shipped in data/vocab/.

Usage, after `apt-get -o Acquire::Languages=en,de update` (as root) has fetched the lists:
  python scripts/train_vocab.py                             # data/vocab/debian_en_de_8192.{model,vocab}
  python scripts/train_vocab.py --compare 4096 16384 32768  # also measures other sizes (not written)

Corpus: the train splits of `specdec.data.debian` only (validation and test text is never seen): the
synopsis task's documents and summaries, the LM paragraphs, and both sides of the en-de pairs
(synopsis and paragraph units; sentence units are pieces of those paragraphs). Texts are split into
lines and each distinct line is one SentencePiece sentence, so a paragraph shared by several datasets
counts once. Without apt lists it falls back to the shipped sample, with a warning.

Settings follow T5's vocabulary (unigram, nmt_nfkc, pad 0 / eos 1 / unk 2, no bos) plus byte fallback,
so German umlauts and ß are pieces and any other character still encodes (as UTF-8 bytes). Deterministic:
fixed seed and thread count (SentencePiece's EM sums per thread), the model written from memory (no
path in it); the same lists give byte-identical files. Prints tokens per word on the validation split
(English: debian_lm, German: the German side of debian_en_de) for each size.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import sentencepiece as spm

from specdec import cli
from specdec.data import debian, vocab

SEED = 0  # SentencePiece samples sentences with it once the corpus outgrows input_sentence_size
TRAINER_OPTIONS = dict(
    model_type="unigram",
    # Characters of the corpus by frequency: the top 0.99995 of occurrences are Latin letters, digits,
    # ASCII and typographic punctuation (— “ ” ’); the rest (~170 of ~280 distinct: CJK, Greek,
    # accented letters seen a few times) fall back to UTF-8 bytes rather than taking pieces. German
    # letters are pieces whatever their count (capital Ö occurs 39 times in the train text).
    character_coverage=0.99995,
    required_chars="äöüÄÖÜß",
    byte_fallback=True,
    normalization_rule_name="nmt_nfkc",
    pad_id=0, eos_id=1, unk_id=2, bos_id=-1,  # T5's ids
    input_sentence_size=2_000_000,  # above the ~190k distinct lines of the full corpus: all are used
    num_threads=2,  # part of the result: EM's expected counts are summed per thread
    minloglevel=1,
)
ENGLISH_FIELDS = {"debian_synopsis": ("document", "summary"), "debian_lm": ("text",),
                  "debian_en_de": ("en",)}


def distinct_lines(texts: list[str]) -> list[str]:
  """The non-empty lines of `texts`, stripped, each kept once in first-seen order."""
  return list(dict.fromkeys(line.strip() for text in texts for line in text.split("\n") if line.strip()))


def training_texts(source: str, apt_dir: str) -> dict[str, list[str]]:
  """{'en': [...], 'de': [...]} texts of the train splits."""
  texts: dict[str, list[str]] = {"en": [], "de": []}
  for dataset, fields in ENGLISH_FIELDS.items():
    for record in debian.load(dataset, "train", source=source, apt_dir=apt_dir):
      if record.get("unit") == "sentence":
        continue
      texts["en"] += [record[field] for field in fields]
      if dataset == "debian_en_de":
        texts["de"].append(record["de"])
  return texts


def validation_texts(source: str, apt_dir: str) -> dict[str, list[str]]:
  """{'en': LM paragraphs, 'de': German synopses and paragraphs} of the validation splits."""
  en_de = debian.load("debian_en_de", "validation", source=source, apt_dir=apt_dir)
  return {"en": [r["text"] for r in debian.load("debian_lm", "validation", source=source, apt_dir=apt_dir)],
          "de": [r["de"] for r in en_de if r["unit"] != "sentence"]}


def train(lines: list[str], vocab_size: int) -> bytes:
  """The serialized SentencePiece model trained on `lines`."""
  spm.set_random_generator_seed(SEED)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                 **TRAINER_OPTIONS)
  return model.getvalue()


def vocab_listing(model: bytes) -> str:
  """The `.vocab` file SentencePiece writes beside a model: one `piece<TAB>score` line per id."""
  processor = spm.SentencePieceProcessor(model_proto=model)
  return "".join(f"{processor.IdToPiece(i)}\t{processor.GetScore(i):g}\n"
                 for i in range(processor.GetPieceSize()))


def measure(model: bytes, texts: list[str]) -> tuple[float, float]:
  """(tokens per whitespace-separated word, share of tokens that are byte-fallback pieces) over `texts`."""
  processor = spm.SentencePieceProcessor(model_proto=model)
  ids = [i for piece_ids in processor.EncodeAsIds(texts) for i in piece_ids]
  words = sum(len(text.split()) for text in texts)
  return len(ids) / words, sum(processor.IsByte(i) for i in ids) / len(ids)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab_size", type=int, default=8192, help="size of the model written")
  parser.add_argument("--compare", type=int, nargs="*", default=[], help="further sizes to measure only")
  parser.add_argument("--out", default=str(vocab.DEFAULT_VOCAB_PATH.parent))
  parser.add_argument("--source", default="auto", help="'apt', 'sample' or 'auto' (see debian.load)")
  parser.add_argument("--apt_dir", default=debian.DEFAULT_APT_DIR)
  args = parser.parse_args()

  train_texts = training_texts(args.source, args.apt_dir)
  lines = distinct_lines(train_texts["en"] + train_texts["de"])
  held_out = validation_texts(args.source, args.apt_dir)
  words = {language: sum(len(t.split()) for t in texts) for language, texts in train_texts.items()}
  print(f"train: {len(lines)} distinct lines, {sum(len(line.split()) for line in lines)} words "
        f"(before line deduplication: en {words['en']}, de {words['de']} words)")
  print(f"validation: en {len(held_out['en'])} texts, de {len(held_out['de'])} texts")

  prefix = Path(args.out) / f"debian_en_de_{args.vocab_size}"
  print("| vocab size | tokens/word en | tokens/word de | byte-fallback tokens en / de | train s |")
  print("|---|---|---|---|---|")
  for vocab_size in sorted({args.vocab_size, *args.compare}):
    start = time.perf_counter()
    model = train(lines, vocab_size)
    seconds = time.perf_counter() - start
    (en, en_bytes), (de, de_bytes) = measure(model, held_out["en"]), measure(model, held_out["de"])
    print(f"| {vocab_size} | {en:.3f} | {de:.3f} | {en_bytes:.3%} / {de_bytes:.3%} | {seconds:.0f} |")
    if vocab_size == args.vocab_size:
      prefix.parent.mkdir(parents=True, exist_ok=True)
      prefix.with_suffix(".model").write_bytes(model)
      prefix.with_suffix(".vocab").write_text(vocab_listing(model), encoding="utf-8")
  print(f"wrote {prefix}.model and {prefix}.vocab")


if __name__ == "__main__":
  sys.exit(cli.run(lambda argv: main(), sys.argv[1:], "scripts/train_vocab.py"))
