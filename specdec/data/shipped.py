"""Where the shipped files are: `data/` (vocabulary, Debian sample, trained pair) and `configs/` of a
checkout, or the copies `pip install .` puts under `<prefix>/share/specdec/` (setup.py's data_files; the
prefix of the environment, or the user base after `pip install --user`).
$SPECDEC_ROOT, a folder holding `data/` and `configs/`, overrides both."""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

ENV = "SPECDEC_ROOT"
_MARKER = ("data", "vocab", "debian_en_de_8192.model")


def root() -> Path:
  """The folder holding the shipped `data/` and `configs/`."""
  if os.environ.get(ENV):
    return Path(os.environ[ENV])
  checkout = Path(__file__).resolve().parents[2]
  prefixes = (sys.prefix, sysconfig.get_path("data"), site.USER_BASE or "")
  installed = [Path(prefix) / "share" / "specdec" for prefix in prefixes if prefix]
  return next((place for place in (checkout, *installed) if place.joinpath(*_MARKER).is_file()), checkout)


def path(*parts: str) -> Path:
  """A shipped file or folder, e.g. path("data", "models", "debian_verifier")."""
  return root().joinpath(*parts)


def find(path_or_name: str, folder: str) -> str:
  """`path_or_name` itself if it exists (relative to the working directory), else the shipped
  `<root>/<folder>/<path_or_name>` if that exists (e.g. find("debian_verifier", "data/models")), else
  `path_or_name` unchanged, for the caller's own error."""
  if os.path.exists(path_or_name):
    return path_or_name
  shipped = root() / folder / path_or_name
  return str(shipped) if shipped.exists() else path_or_name
