"""The Python blocks of a docs page, executed: the page's worked examples are code the tests run."""

import pathlib
import re
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(page: str) -> list[str]:
  """The ```python blocks of `page` (a path relative to the repository root), in order."""
  return PYTHON_BLOCK.findall((REPO_ROOT / page).read_text())


def load(page: str) -> dict[str, Any]:
  """The names the page's Python blocks define, executed in order in one namespace."""
  namespace: dict[str, Any] = {"__name__": f"docs:{page}"}
  for block in blocks(page):
    exec(compile(block, str(REPO_ROOT / page), "exec"), namespace)
  return namespace
