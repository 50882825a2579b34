"""Writes the Debian-description datasets (`specdec.data.debian`) as gzipped JSON lines.

Usage, after `apt-get -o Acquire::Languages=en,de update` (as root) has fetched the lists:
  python scripts/make_debian_sample.py                  # the fixed sample shipped in data/debian/
  python scripts/make_debian_sample.py --full --out outputs/debian   # everything; then
      specdec.data.load(dataset, split, source="outputs/debian")

Deterministic: the same apt lists give byte-identical files. The sample keeps, per dataset and split, the
records of the packages that come first in sha256(package) order, up to `SAMPLE_LIMITS` records, in their
original (package) order; the same packages are picked in every dataset. The README in the output
directory records the input lists, the command and the counts.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

from specdec import cli
from specdec.data import debian

SAMPLE_LIMITS = {  # records per split; train sizes keep data/debian/ at a few MB
    "debian_synopsis": {"train": 10_000, "validation": 500, "test": 1000},
    "debian_en_de": {"train": 15_000, "validation": 500, "test": 1000},
    "debian_lm": {"train": 20_000, "validation": 500, "test": 1000},
}

LICENCE = """\
Debian package descriptions are written by the maintainers of each package; the German translations by
the translators of the Debian Description Translation Project (DDTP, https://wiki.debian.org/DDTP). They
are distributed in the Debian archive (the `Translation-*` indices) with the packages they describe. This
project states no licence of its own for them: they are redistributed from the Debian archive for
research; see the DDTP and each package's copyright (`/usr/share/doc/<package>/copyright`, or
https://packages.debian.org) for the terms that apply."""


def select(records: list[dict], limit: int) -> list[dict]:
  """At most `limit` records, those of the packages first in sha256 order, kept in their given order."""
  def rank(i: int) -> tuple[bytes, int]:
    return hashlib.sha256(records[i]["package"].encode("utf-8")).digest(), i
  chosen = sorted(sorted(range(len(records)), key=rank)[:limit])
  return [records[i] for i in chosen]


def release_dates(apt_dir: Path, lists: list[Path]) -> list[str]:
  """'<suite InRelease file>: <Date>' for the releases the lists come from (which snapshot was read)."""
  lines = []
  for release in sorted({re.sub(r"_dists_([^_]+)_.*$", r"_dists_\1_InRelease", p.name) for p in lists}):
    path = apt_dir / release
    if path.is_file():
      date = next((line[5:].strip() for line in path.read_text(errors="replace").split("\n")
                   if line.startswith("Date:")), "no Date field")
      lines.append(f"{release}: {date}")
  return lines


def readme(args: argparse.Namespace, files: dict[str, list[Path]], full: dict, written: dict) -> str:
  """The output directory's README: what it holds, the source lists, the command, the counts, the licence."""
  apt_dir = Path(args.apt_dir)
  source = "'<this directory>'" if args.full else "'sample'"
  command = "python scripts/make_debian_sample.py"
  if args.apt_dir != debian.DEFAULT_APT_DIR:
    command += f" --apt_dir {args.apt_dir}"
  if args.full:
    command += " --full"
  if Path(args.out).resolve() != debian.SAMPLE_DIR:
    command += f" --out {args.out}"
  lines = [
      "# Debian package descriptions: synopsis, en-de and LM datasets",
      "",
      f"{'The full build' if args.full else 'A small fixed sample'} of the three datasets of "
      f"`specdec.data.debian` (read them with `specdec.data.load(dataset, split, source={source})`). Layout: "
      "`<dataset>/<split>.jsonl.gz`, one JSON record per line, UTF-8. Field meanings, filters, "
      "deduplication, the en-de alignment rule and the split rule are documented in "
      "`specdec/data/debian.py`.",
      "",
      "## Source",
      "",
      f"The apt lists in `{apt_dir}` (Debian, fetched with `apt-get -o Acquire::Languages=en,de update` "
      "as root), releases as of:",
      "",
      *[f"- {line}" for line in release_dates(apt_dir, files["en"] + files["de"])],
      "",
      "Lists read:",
      "",
      *[f"- `{p.name}`" for p in files["en"] + files["de"] + files["packages"]],
      "",
      "Regenerate (deterministic: the same lists give byte-identical files):",
      "",
      "```bash",
      command,
      "```",
      "",
      "## Counts",
      "",
      "| dataset | split | full build | in this directory |",
      "|---|---|---|---|",
  ]
  for dataset in debian.DATASETS:
    for split in debian.SPLITS:
      lines.append(f"| {dataset} | {split} | {len(full[dataset][split])} | {len(written[dataset][split])} |")
  if not args.full:
    limits = ", ".join(f"{d}: {'/'.join(str(n) for n in SAMPLE_LIMITS[d].values())}" for d in debian.DATASETS)
    lines += ["", "The sample keeps, per split, the records of the packages first in sha256(package) order "
              f"(the same packages in every dataset), up to {limits} (train/validation/test) records."]
  lines += ["", "## Licence", "", LICENCE, ""]
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--apt_dir", default=debian.DEFAULT_APT_DIR)
  parser.add_argument("--out", default=str(debian.SAMPLE_DIR))
  parser.add_argument("--full", action="store_true", help="write every record, not the sample")
  args = parser.parse_args()

  files = debian.list_files(args.apt_dir)
  full = {dataset: debian.build(dataset, args.apt_dir) for dataset in debian.DATASETS}
  written = {}
  for dataset, splits in full.items():
    written[dataset] = {}
    for split, records in splits.items():
      if not args.full:
        records = select(records, SAMPLE_LIMITS[dataset][split])
      written[dataset][split] = records
      debian.write_jsonl(records, debian.jsonl_path(args.out, dataset, split))
  Path(args.out, "README.md").write_text(readme(args, files, full, written), encoding="utf-8")
  for dataset in debian.DATASETS:
    print(dataset, {split: f"{len(written[dataset][split])}/{len(full[dataset][split])}"
                    for split in debian.SPLITS})
  print(f"wrote {args.out}")


if __name__ == "__main__":
  sys.exit(cli.run(lambda argv: main(), sys.argv[1:], "scripts/make_debian_sample.py"))
