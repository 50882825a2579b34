"""Debian package descriptions as three local text tasks (no network needed).

Source: the `Translation-en` and `Translation-de` apt lists (`apt-get -o Acquire::Languages=en,de
update`), deb822 stanzas with `Package`, `Description-md5` and `Description-en` / `Description-de`. A
description's first line is the synopsis; continuation lines form the long description, where " ." is a
paragraph break, lines with one leading space are wrapped text (joined with spaces) and lines with two or
more are verbatim (kept on their own line, minus those two spaces). Paragraphs are joined by a blank line.

Merging: every list file in the directory is read (main, -updates, -security; lz4, gz, xz or plain) and
descriptions are keyed by `Description-md5`; a description shared by several packages is kept once, under
the smallest package name (a package whose description differs between lists keeps both; the
deduplication below then drops the repeated text). Every dataset drops descriptions whose synopsis says
"transitional" or "dummy" (upgrade shims that describe no software). Records come in package-name order.

Datasets (each text unit appears once per dataset: later duplicates of its normalised text, NFKC +
casefold + collapsed whitespace, are dropped, so identical text never lands in two splits):
- `debian_synopsis` {package, document, summary}: long description -> synopsis (XSum-like). Kept when the
  document has 10-400 words (shorter ones say nothing a synopsis does not; 400 words ~ T5's 512 tokens)
  and the summary 2-25 words. Deduplicated on the document: an identical document with two synopses
  (e.g. a library and its -dev package) is an ill-posed pair, the first package keeps it.
- `debian_en_de` {package, en, de, unit}: the German file's `Description-md5` is the md5 of the English
  description it translates, so German joins English on it (German stanzas without an English match are
  stale and dropped). Units, in order: the synopsis pair; when both sides have the same number of
  paragraphs (DDTP translates paragraph by paragraph), each paragraph pair; within such a paragraph,
  when neither side has verbatim lines (translators re-wrap lists) and both split into the same number
  (>= 2) of sentences (`split_sentences`), the i-th sentence pairs with the i-th as a `sentence` unit
  (two thirds of multi-sentence paragraphs agree; where they do not, the translator split or merged
  sentences). A pair is dropped when the German equals the English (untranslated, a URL), when the
  character-length ratio de/en is outside [0.5, 3] (misaligned), or when the English has more than 400
  words. Deduplicated on the English text.
- `debian_lm` {package, text}: English text for language modelling (LM1B-like), one example per
  paragraph. Paragraphs are the self-contained unit the descriptions are written in (LM1B's examples are
  single sentences; ours average ~40 words), and deduplicating paragraphs rather than whole descriptions
  removes the boilerplate ("This package contains the development files.") that thousands of descriptions
  share. Kept with 3-400 words. Synopses are not included (they are the targets of `debian_synopsis`).

Splits: train / validation / test = 90 / 5 / 5 by a stable hash (sha256) of the package's group, the
normalised name of its source package (`group_of`). The source package comes from the `Packages` lists in
the same directory where present (`Source:` field), else the binary name is used. 5% is what the
smallest task needs: on bookworm the en-de test split gets ~680 translated descriptions, ~1080 paragraph
pairs (2451 pairs in all), enough for BLEU; 1% would leave ~200 paragraphs. The same assignment serves all
three datasets, so no dataset's test package is trained on through another.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import unicodedata
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from specdec.data import shipped

DATASETS = ("debian_synopsis", "debian_en_de", "debian_lm")
SPLITS = ("train", "validation", "test")
DEFAULT_APT_DIR = "/var/lib/apt/lists"
SAMPLE_DIR = shipped.path("data", "debian")
FETCH_HINT = ("fetch them as root with `apt-get -o Acquire::Languages=en,de update`, or pass "
              "source='sample' for the small sample shipped in data/debian/")

SPLIT_PERCENT = {"train": 90, "validation": 5, "test": 5}
SYNOPSIS_DOCUMENT_WORDS = (10, 400)
SYNOPSIS_SUMMARY_WORDS = (2, 25)
LM_WORDS = (3, 400)
EN_DE_MAX_WORDS = 400
EN_DE_LENGTH_RATIO = (0.5, 3.0)

_TRIVIAL_SYNOPSIS = re.compile(r"\b(transitional|dummy)\b", re.IGNORECASE)
_TRANSLATION_FILE = re.compile(r"_i18n_Translation-(en|de)(\.lz4|\.gz|\.xz)?$")
_PACKAGES_FILE = re.compile(r"_binary-[^_]+_Packages(\.lz4|\.gz|\.xz)?$")
_GROUP_SUFFIXES = ("-dev", "-doc", "-docs", "-dbg", "-dbgsym", "-common", "-data", "-bin", "-utils",
                   "-tools", "-examples", "-runtime")
# Abbreviations (lower case, without the final period) after which a period does not end a sentence.
_ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf approx incl esp resp dr mr mrs ms no nr vol fig "
    "z.b d.h u.a bzw usw ca evtl ggf inkl bspw sog vgl bzgl u.u o.ä".split())
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[\"'„“(\[]?[A-ZÄÖÜ0-9])")


@dataclasses.dataclass(frozen=True)
class Description:
  """One description as parsed from a Translation list."""
  package: str
  md5: str
  synopsis: str
  paragraphs: tuple[str, ...]


# ---------------------------------------------------------------------------------------------------
# Reading apt lists.


def read_text(path: str | os.PathLike) -> str:
  """The UTF-8 text of an apt list, decompressing lz4, gzip or xz by their magic bytes."""
  data = Path(path).read_bytes()
  if data.startswith(b"\x04\x22\x4d\x18"):
    try:
      import lz4.frame  # optional: only lz4-compressed lists need it
    except ImportError as e:
      raise ImportError(f"{path} is lz4-compressed: `pip install lz4` to read it") from e
    data = lz4.frame.decompress(data)
  elif data.startswith(b"\x1f\x8b"):
    data = gzip.decompress(data)
  elif data.startswith(b"\xfd7zXZ\x00"):
    data = lzma.decompress(data)
  return data.decode("utf-8")


def parse_deb822(text: str) -> Iterator[dict[str, str]]:
  """Stanzas of a deb822 file as {field: value}; continuation lines are kept, after a newline, as is."""
  for block in re.split(r"\n[ \t]*\n", text):
    stanza: dict[str, str] = {}
    field = None
    for line in block.split("\n"):
      if line.startswith((" ", "\t")) and field is not None:
        stanza[field] += "\n" + line
      elif ":" in line:
        field, _, value = line.partition(":")
        stanza[field] = value.strip()
    if stanza:
      yield stanza


def parse_description(value: str) -> tuple[str, tuple[str, ...]]:
  """A Description field -> (synopsis, paragraphs); see the module docstring for the layout rules."""
  synopsis, *lines = value.split("\n")
  paragraphs: list[list[str]] = [[]]
  wrapped = False  # whether the current line of the paragraph is wrapped text that may continue
  for line in lines:
    if line.strip() == ".":
      paragraphs.append([])
      wrapped = False
    elif line.startswith("  "):
      paragraphs[-1].append(line[2:].rstrip())
      wrapped = False
    elif line.strip():
      if wrapped:
        paragraphs[-1][-1] += " " + line.strip()
      else:
        paragraphs[-1].append(line.strip())
      wrapped = True
  return synopsis.strip(), tuple("\n".join(p) for p in paragraphs if p)


def read_descriptions(paths: Iterable[str | os.PathLike], language: str) -> dict[str, Description]:
  """{Description-md5: Description} over all files; a shared description keeps the smallest name."""
  found: dict[str, Description] = {}
  for path in paths:
    for stanza in parse_deb822(read_text(path)):
      package, md5 = stanza.get("Package"), stanza.get("Description-md5")
      value = stanza.get(f"Description-{language}")
      if not (package and md5 and value):
        continue
      if md5 in found and found[md5].package <= package:
        continue
      synopsis, paragraphs = parse_description(value)
      found[md5] = Description(package, md5, synopsis, paragraphs)
  return found


def read_sources(paths: Iterable[str | os.PathLike]) -> dict[str, str]:
  """{binary package: source package} from `Packages` lists (a missing `Source:` means the same name)."""
  sources: dict[str, str] = {}
  for path in paths:
    package = None
    for line in read_text(path).split("\n"):
      if line.startswith("Package:"):
        package = line[8:].strip()
        sources.setdefault(package, package)
      elif line.startswith("Source:") and package is not None:
        sources[package] = line[7:].split("(")[0].strip()  # "Source: foo (1.2-3)" after binNMUs
  return sources


def list_files(apt_dir: str | os.PathLike) -> dict[str, list[Path]]:
  """The Translation-en, Translation-de and Packages lists in `apt_dir`, sorted by name."""
  files: dict[str, list[Path]] = {"en": [], "de": [], "packages": []}
  root = Path(apt_dir)
  if root.is_dir():
    for path in sorted(root.iterdir()):
      if not path.is_file():
        continue
      if m := _TRANSLATION_FILE.search(path.name):
        files[m.group(1)].append(path)
      elif _PACKAGES_FILE.search(path.name):
        files["packages"].append(path)
  return files


# ---------------------------------------------------------------------------------------------------
# Splits, text rules.


def group_of(package: str) -> str:
  """The name that decides a package's split: related packages (libfoo1, libfoo-dev, foo-doc,
  python3-foo and python-foo, gcc-12 and gcc-13) share it.

  Rule: lower-case; each run of digits, '.', '+' or '~' becomes '-' (versions, sonames); collapse and
  trim '-'; strip the suffixes `_GROUP_SUFFIXES` repeatedly; strip a leading "lib". An empty result
  (e.g. "2048") falls back to the name itself.
  """
  name = re.sub(r"[0-9.+~]+", "-", package.lower())
  name = re.sub(r"-+", "-", name).strip("-")
  stripped = True
  while stripped:
    stripped = False
    for suffix in _GROUP_SUFFIXES:
      if name.endswith(suffix) and len(name) > len(suffix):
        name, stripped = name[:-len(suffix)], True
  if name.startswith("lib") and len(name) > 3:
    name = name[3:]
  return name.strip("-") or package


def split_of(group: str) -> str:
  """train / validation / test by the first 8 bytes of sha256(group), in `SPLIT_PERCENT` proportions."""
  bucket = int.from_bytes(hashlib.sha256(group.encode("utf-8")).digest()[:8], "big") % 100
  for split, percent in SPLIT_PERCENT.items():
    if bucket < percent:
      return split
    bucket -= percent
  raise AssertionError("SPLIT_PERCENT must sum to 100")


def normalise(text: str) -> str:
  """The key under which two texts count as duplicates: NFKC, casefolded, whitespace collapsed."""
  return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def split_sentences(text: str) -> list[str]:
  """Sentences of wrapped text.

  A sentence ends at '.', '!' or '?' followed by whitespace and an upper-case letter, digit or opening
  quote, unless the word before the period is a single letter (initials, "z. B.") or in
  `_ABBREVIATIONS`. Lower-case starts (package names) do not break: "foo. libbar is" stays one
  sentence, the same on both sides of a translation.
  """
  pieces = _SENTENCE_BREAK.split(" ".join(text.split()))
  sentences = [pieces[0]]
  for piece in pieces[1:]:
    last_word = sentences[-1].rsplit(None, 1)[-1].rstrip(".").lower()
    if (len(last_word) == 1 and last_word.isalpha()) or last_word in _ABBREVIATIONS:
      sentences[-1] += " " + piece
    else:
      sentences.append(piece)
  return [s for s in sentences if s]


def _words(text: str) -> int:
  return len(text.split())


def _kept(descriptions: dict[str, Description]) -> list[Description]:
  """Descriptions in package order, without transitional / dummy packages."""
  ordered = sorted(descriptions.values(), key=lambda d: (d.package, d.md5))
  return [d for d in ordered if not _TRIVIAL_SYNOPSIS.search(d.synopsis)]


# ---------------------------------------------------------------------------------------------------
# Builders: parsed lists -> {split: [record]}.


class _Splitter:
  """Assigns records to splits, dropping later duplicates of a normalised key."""

  def __init__(self, sources: dict[str, str]):
    self.sources = sources
    self.seen: set[str] = set()
    self.records: dict[str, list[dict]] = {split: [] for split in SPLITS}

  def add(self, key: str, record: dict) -> None:
    key = normalise(key)
    if key in self.seen:
      return
    self.seen.add(key)
    package = record["package"]
    self.records[split_of(group_of(self.sources.get(package, package)))].append(record)


def build_synopsis(english: dict[str, Description], sources: dict[str, str]) -> dict[str, list[dict]]:
  """debian_synopsis records {package, document, summary} per split."""
  splitter = _Splitter(sources)
  lo, hi = SYNOPSIS_DOCUMENT_WORDS
  s_lo, s_hi = SYNOPSIS_SUMMARY_WORDS
  for d in _kept(english):
    document = "\n\n".join(d.paragraphs)
    if lo <= _words(document) <= hi and s_lo <= _words(d.synopsis) <= s_hi:
      splitter.add(document, {"package": d.package, "document": document, "summary": d.synopsis})
  return splitter.records


def build_lm(english: dict[str, Description], sources: dict[str, str]) -> dict[str, list[dict]]:
  """debian_lm records {package, text} per split, one per paragraph."""
  splitter = _Splitter(sources)
  for d in _kept(english):
    for paragraph in d.paragraphs:
      if LM_WORDS[0] <= _words(paragraph) <= LM_WORDS[1]:
        splitter.add(paragraph, {"package": d.package, "text": paragraph})
  return splitter.records


def aligned_units(en: Description, de: Description) -> Iterator[tuple[str, str, str]]:
  """(unit, en, de) pairs of one translated description, before filtering; see the module docstring."""
  yield "synopsis", en.synopsis, de.synopsis
  if len(en.paragraphs) != len(de.paragraphs):
    return
  for en_paragraph, de_paragraph in zip(en.paragraphs, de.paragraphs):
    yield "paragraph", en_paragraph, de_paragraph
    if "\n" in en_paragraph or "\n" in de_paragraph:
      continue  # verbatim lines (lists, code): translators re-wrap and reorder them
    en_sentences, de_sentences = split_sentences(en_paragraph), split_sentences(de_paragraph)
    if len(en_sentences) == len(de_sentences) >= 2:
      for en_sentence, de_sentence in zip(en_sentences, de_sentences):
        yield "sentence", en_sentence, de_sentence


def build_en_de(english: dict[str, Description], german: dict[str, Description],
                sources: dict[str, str]) -> dict[str, list[dict]]:
  """debian_en_de records {package, en, de, unit} per split, German joined to English on md5."""
  splitter = _Splitter(sources)
  lo, hi = EN_DE_LENGTH_RATIO
  for en in _kept(english):
    de = german.get(en.md5)
    if de is None:
      continue
    for unit, en_text, de_text in aligned_units(en, de):
      if (normalise(en_text) != normalise(de_text) and _words(en_text) <= EN_DE_MAX_WORDS
          and lo <= len(de_text) / len(en_text) <= hi):
        splitter.add(en_text, {"package": en.package, "en": en_text, "de": de_text, "unit": unit})
  return splitter.records


def build(dataset: str, apt_dir: str | os.PathLike = DEFAULT_APT_DIR) -> dict[str, list[dict]]:
  """All splits of one dataset, built from the apt lists in `apt_dir`."""
  check_choice("dataset", dataset, DATASETS)
  files = list_files(apt_dir)
  needed = ["en", "de"] if dataset == "debian_en_de" else ["en"]
  missing = [f"Translation-{language}" for language in needed if not files[language]]
  if missing:
    raise FileNotFoundError(f"no {' or '.join(missing)} lists in {apt_dir}: {FETCH_HINT}")
  english = read_descriptions(files["en"], "en")
  sources = read_sources(files["packages"])
  if dataset == "debian_synopsis":
    return build_synopsis(english, sources)
  if dataset == "debian_lm":
    return build_lm(english, sources)
  return build_en_de(english, read_descriptions(files["de"], "de"), sources)


# ---------------------------------------------------------------------------------------------------
# JSONL files and the public reader.


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> None:
  """Gzipped JSON lines, UTF-8, byte-identical for identical records (no timestamp or name in the header)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  buffer = io.BytesIO()
  with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
    for record in records:
      f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
  path.write_bytes(buffer.getvalue())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """Records of a file written by `write_jsonl`."""
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def jsonl_path(root: str | os.PathLike, dataset: str, split: str) -> Path:
  """Where a dataset split lives under a directory of JSONL files (the shipped sample's layout)."""
  return Path(root) / dataset / f"{split}.jsonl.gz"


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
  """Raises ValueError naming `name` and the `choices` when `value` is not one of them."""
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")


def _stamp(apt_dir: str | os.PathLike) -> tuple:
  """Identifies the current apt lists, so a rebuilt cache entry follows an `apt-get update`."""
  return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size)
               for paths in list_files(apt_dir).values() for p in paths)


@functools.lru_cache(maxsize=3)
def _build_cached(dataset: str, apt_dir: str, stamp: tuple) -> dict[str, list[dict]]:
  del stamp  # part of the cache key only
  return build(dataset, apt_dir)


def load(dataset: str, split: str, *, source: str | os.PathLike = "auto",
         apt_dir: str | os.PathLike = DEFAULT_APT_DIR) -> list[dict]:
  """Records of one dataset split.

  `dataset` in `DATASETS`, `split` in `SPLITS`. `source`: 'apt' builds from the lists in `apt_dir` (a
  full build is cached per process); 'sample' reads the small sample shipped in
  data/debian/; 'auto' is 'apt' when the lists are there and otherwise the sample, with a warning; any
  other value is a directory of `<dataset>/<split>.jsonl.gz` files, e.g. a full build written by
  `scripts/make_debian_sample.py --full`. Records: debian_synopsis {package, document, summary};
  debian_en_de {package, en, de, unit in 'synopsis' | 'paragraph' | 'sentence'}; debian_lm {package, text}.
  """
  check_choice("dataset", dataset, DATASETS)
  check_choice("split", split, SPLITS)
  if source in ("apt", "auto"):
    try:
      records = _build_cached(dataset, str(apt_dir), _stamp(apt_dir))[split]
      return [dict(r) for r in records]
    except FileNotFoundError as e:
      if source == "apt":
        raise
      warnings.warn(f"{e}; using the shipped sample in {SAMPLE_DIR} instead", stacklevel=2)
    source = "sample"
  root = SAMPLE_DIR if source == "sample" else Path(source)
  path = jsonl_path(root, dataset, split)
  if not path.is_file():
    raise FileNotFoundError(f"{path} does not exist: write it with `python scripts/make_debian_sample.py"
                            f"{'' if source == 'sample' else ' --full --out ' + str(root)}`")
  return read_jsonl(path)
