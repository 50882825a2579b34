import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--run-slow"):
    return
  skip = pytest.mark.skip(reason="slow: run with `make test-slow`")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)
