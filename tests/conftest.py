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


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
  """Frees every compiled program after each test module. XLA:CPU maps 3 memory regions per compiled
  object (a decode loop: ~840), kept while JAX caches the program; one long pytest process of a few
  hundred compilations reached Linux's vm.max_map_count (65,530) and segfaulted while compiling."""
  yield
  import jax
  jax.clear_caches()
