"""Debian-description datasets: exact records on a hand-written apt-list fixture, the shipped sample,
and the errors a user without apt lists sees.

The fixture (tests/fixtures/apt_lists) holds: a description shared by two packages (alpha-theme,
beta-theme: one md5), a transitional package (oldkilo), a paragraph break and verbatim lines (kilo), a
German translation joined on md5 with equal paragraphs (kilo, alpha-theme) and with unequal ones
(kilo-doc), English without German (vale), a stale German stanza, a -security list repeating a stanza,
a library and its -dev package with one document (libvale1, libvale-dev), and a Packages list that maps
gir1.2-vale-1.0 to its source package vale. Groups: vale -> test, kilo and zinnia -> validation.
"""

import gzip
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import data
from specdec.data import debian

FIXTURE = Path(__file__).parents[1] / "fixtures" / "apt_lists"
REPO = Path(__file__).parents[2]

KILO_P1 = "Kilo is a small text editor for the terminal. It has syntax highlighting and incremental search."
KILO_P2 = "Supported languages:\n* C and C++\n* Python"
KILO_P3 = "The editor keeps no backup files, e.g. when saving. Files are written in place."
PASTEL = "Pastel is an icon theme with soft colours and scalable icons for all common desktop environments."
VALE = "Vale checks prose against style guides. The library parses Markdown and reports rule violations."
GIR = ("This package contains introspection data for libvale, so that Vale can be used from languages such "
       "as Python and JavaScript.")

EXPECTED = {
    "debian_synopsis": {
        "train": [
            {"package": "alpha-theme", "document": PASTEL + "\n\nWebsite: https://example.org/pastel",
             "summary": "Pastel icon theme for desktops"},
        ],
        "validation": [
            {"package": "kilo", "document": f"{KILO_P1}\n\n{KILO_P2}\n\n{KILO_P3}",
             "summary": "Small text editor for the terminal"},
            {"package": "kilo-doc", "document": KILO_P1 + "\n\nThis package contains the manual.",
             "summary": "Small text editor for the terminal (documentation)"},
        ],
        "test": [  # libvale1 has libvale-dev's document: dropped; zinnia has 7 words: dropped
            {"package": "gir1.2-vale-1.0", "document": GIR,
             "summary": "GObject introspection data for the Vale library"},
            {"package": "libvale-dev", "document": VALE,
             "summary": "Prose style checking library (development files)"},
            {"package": "vale", "document": VALE + "\n\nThis package contains the vale command.",
             "summary": "Command-line linter for prose"},
        ],
    },
    "debian_en_de": {
        "train": [  # the second paragraph (a URL) is the same in German: dropped
            {"package": "alpha-theme", "en": "Pastel icon theme for desktops",
             "de": "Pastell-Symbolthema für Arbeitsumgebungen", "unit": "synopsis"},
            {"package": "alpha-theme", "en": PASTEL,
             "de": "Pastel ist ein Symbolthema mit sanften Farben und skalierbaren Symbolen für alle "
                   "gängigen Arbeitsumgebungen.", "unit": "paragraph"},
        ],
        "validation": [
            {"package": "kilo", "en": "Small text editor for the terminal",
             "de": "Kleiner Texteditor für das Terminal", "unit": "synopsis"},
            {"package": "kilo", "en": KILO_P1,
             "de": "Kilo ist ein kleiner Texteditor für das Terminal. Er bietet Syntaxhervorhebung und "
                   "inkrementelle Suche.", "unit": "paragraph"},
            {"package": "kilo", "en": "Kilo is a small text editor for the terminal.",
             "de": "Kilo ist ein kleiner Texteditor für das Terminal.", "unit": "sentence"},
            {"package": "kilo", "en": "It has syntax highlighting and incremental search.",
             "de": "Er bietet Syntaxhervorhebung und inkrementelle Suche.", "unit": "sentence"},
            # Verbatim lines: a paragraph pair, never split into sentences.
            {"package": "kilo", "en": KILO_P2, "de": "Unterstützte Sprachen:\n* C und C++\n* Python",
             "unit": "paragraph"},
            # 2 English sentences, 3 German ("z. B." does not end one): the paragraph pair only.
            {"package": "kilo", "en": KILO_P3,
             "de": "Der Editor legt keine Sicherungsdateien an, z. B. beim Speichern. Dateien werden direkt "
                   "überschrieben. Das spart Platz.", "unit": "paragraph"},
            # 2 English paragraphs, 1 German: the synopsis pair only.
            {"package": "kilo-doc", "en": "Small text editor for the terminal (documentation)",
             "de": "Kleiner Texteditor für das Terminal (Dokumentation)", "unit": "synopsis"},
        ],
        "test": [],  # vale has no German translation
    },
    "debian_lm": {
        "train": [{"package": "alpha-theme", "text": PASTEL}],  # "Website: <url>" has 2 words: dropped
        "validation": [
            {"package": "kilo", "text": KILO_P1},
            {"package": "kilo", "text": KILO_P2},
            {"package": "kilo", "text": KILO_P3},
            # kilo-doc's first paragraph is kilo's: dropped.
            {"package": "kilo-doc", "text": "This package contains the manual."},
            {"package": "zinnia", "text": "Zinnia recognises handwritten characters from pen strokes."},
        ],
        "test": [
            {"package": "gir1.2-vale-1.0", "text": GIR},
            {"package": "libvale-dev", "text": VALE},
            {"package": "vale", "text": "This package contains the vale command."},
        ],
    },
}


@pytest.mark.parametrize("dataset", debian.DATASETS)
def test_fixture_builds_exact_records(dataset):
  assert debian.build(dataset, FIXTURE) == EXPECTED[dataset]


def test_description_layout_paragraphs_and_verbatim_lines():
  value = ("Synopsis here \n First wrapped\n line.\n .\n Items:\n  * one\n    - nested\n .\n .\n"
           " Last.")
  assert debian.parse_description(value) == (
      "Synopsis here", ("First wrapped line.", "Items:\n* one\n  - nested", "Last."))


def test_sentences_break_at_capitals_not_after_abbreviations_or_initials():
  assert debian.split_sentences("Reads PNG, e.g. From disk. Writes JPEG! Is it fast? Yes.") == [
      "Reads PNG, e.g. From disk.", "Writes JPEG!", "Is it fast?", "Yes."]
  assert debian.split_sentences("Liest z. B. PNG. Schreibt J. R. R. Tolkien. foo. bar ist klein.") == [
      "Liest z. B. PNG.", "Schreibt J. R. R. Tolkien. foo. bar ist klein."]
  assert debian.split_sentences("Converts Ipe 5 files. Ipe 6. Then") == [
      "Converts Ipe 5 files.", "Ipe 6.", "Then"]


def test_related_packages_share_a_group_and_so_a_split():
  assert {debian.group_of(n) for n in ["vale", "libvale1", "libvale-dev", "libvale-1.2-dev", "vale-doc",
                                       "vale-common", "libvale1-dbg"]} == {"vale"}
  assert debian.group_of("python3-kilo") == debian.group_of("python-kilo") == "python-kilo"
  assert debian.group_of("gcc-12") == debian.group_of("gcc-13") == "gcc"
  assert debian.group_of("2048") == "2048"
  assert debian.split_of("vale") == "test" and debian.split_of("kilo") == "validation"
  # Without the Packages list gir1.2-vale-1.0 would form its own group, which hashes to train.
  assert debian.split_of(debian.group_of("gir1.2-vale-1.0")) == "train"


def test_split_proportions_over_many_groups():
  counts = {split: 0 for split in debian.SPLITS}
  for i in range(20_000):
    counts[debian.split_of(f"package{i}")] += 1
  assert abs(counts["train"] / 20_000 - 0.90) < 0.01
  assert abs(counts["validation"] / 20_000 - 0.05) < 0.005 and abs(counts["test"] / 20_000 - 0.05) < 0.005


def test_length_filters():
  long_doc = " ".join(["word"] * 401)
  ten = "One two three four five six seven eight nine ten."
  english = {
      "a": debian.Description("long", "a", "A long one", (long_doc,)),
      "b": debian.Description("one-word", "b", "Tool", (ten,)),
      "c": debian.Description("ok", "c", "A fine tool", (ten,)),
  }
  # The 401-word document and the one-word synopsis are dropped; so is the 401-word paragraph.
  assert sum(debian.build_synopsis(english, {}).values(), []) == [
      {"package": "ok", "document": ten, "summary": "A fine tool"}]
  assert sum(debian.build_lm(english, {}).values(), []) == [{"package": "ok", "text": ten}]
  german = {"c": debian.Description("ok", "c", "Ein feines Werkzeug", ("Eins.",))}  # ratio 5/50 < 0.5
  assert sum(debian.build_en_de(english, german, {}).values(), []) == [
      {"package": "ok", "en": "A fine tool", "de": "Ein feines Werkzeug", "unit": "synopsis"}]


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".xz", lzma.compress), (".lz4", None)])
def test_compressed_lists_give_the_same_records(tmp_path, suffix, compress):
  if compress is None:
    compress = pytest.importorskip("lz4.frame").compress
  for path in FIXTURE.iterdir():
    (tmp_path / (path.name + suffix)).write_bytes(compress(path.read_bytes()))
  assert debian.build("debian_en_de", tmp_path) == EXPECTED["debian_en_de"]


def test_missing_apt_lists_explain_how_to_fetch_them(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"apt-get -o Acquire::Languages=en,de update"):
    data.load("debian_lm", "train", source="apt", apt_dir=tmp_path / "nowhere")
  with pytest.warns(UserWarning, match=r"apt-get -o Acquire::Languages=en,de update.*shipped sample"):
    records = data.load("debian_lm", "validation", source="auto", apt_dir=tmp_path)
  assert records == data.load("debian_lm", "validation", source="sample")
  shutil.copy(next(FIXTURE.glob("*_stable_main_i18n_Translation-en")), tmp_path)
  with pytest.raises(FileNotFoundError, match="no Translation-de lists"):
    data.load("debian_en_de", "train", source="apt", apt_dir=tmp_path)
  assert data.load("debian_lm", "validation", source="apt", apt_dir=tmp_path)[0]["package"] == "kilo"


def test_unknown_dataset_or_split_lists_the_choices():
  with pytest.raises(ValueError, match="debian_synopsis, debian_en_de, debian_lm"):
    data.load("wmt14", "train")
  with pytest.raises(ValueError, match="train, validation, test"):
    data.load("debian_lm", "dev")


def test_script_output_is_deterministic_and_loads_back_utf8(tmp_path):
  out = tmp_path / "out"
  command = [sys.executable, str(REPO / "scripts" / "make_debian_sample.py"), "--apt_dir", str(FIXTURE),
             "--out", str(out)]
  subprocess.run(command, check=True, capture_output=True, cwd=REPO)
  first = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
  subprocess.run(command, check=True, capture_output=True, cwd=REPO)
  assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == first
  assert len(first) == 10  # 3 datasets x 3 splits + README.md
  loaded = data.load("debian_en_de", "validation", source=out)
  assert loaded == EXPECTED["debian_en_de"]["validation"]
  assert "überschrieben".encode() in gzip.decompress(first[Path("debian_en_de/validation.jsonl.gz")])


def test_shipped_sample_loads_with_sane_counts():
  fields = {"debian_synopsis": {"package", "document", "summary"},
            "debian_en_de": {"package", "en", "de", "unit"}, "debian_lm": {"package", "text"}}
  for dataset in debian.DATASETS:
    splits = {split: data.load(dataset, split, source="sample") for split in debian.SPLITS}
    assert 5_000 <= len(splits["train"]) <= 20_000, dataset
    assert 300 <= len(splits["validation"]) <= 1000 and 500 <= len(splits["test"]) <= 1000, dataset
    for records in splits.values():
      assert all(set(r) == fields[dataset] and all(isinstance(v, str) and v for v in r.values())
                 for r in records)
    packages = {split: {r["package"] for r in records} for split, records in splits.items()}
    assert not packages["train"] & packages["test"] and not packages["train"] & packages["validation"]
  en_de = data.load("debian_en_de", "test", source="sample")
  assert {r["unit"] for r in en_de} == {"synopsis", "paragraph", "sentence"}
  assert any(ch in r["de"] for r in en_de for ch in "äöüÄÖÜß")
