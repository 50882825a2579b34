import os

# CPU unless `make test-device` asks for whatever backend JAX finds (tests/backends.py).
ON_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE") == "1"
if not ON_DEVICE:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def pytest_configure(config):
  if ON_DEVICE:
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    # Programs compiled by one device run are reused by the next (XLA:GPU compiles take seconds each).
    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "SPECDEC_TEST_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "jax")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


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
