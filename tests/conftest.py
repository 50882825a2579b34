import os

# CPU unless `make test-device` asks for whatever backend JAX finds (tests/backends.py).
ON_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE") == "1"
if not ON_DEVICE:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


# JAX's persistent compilation cache: on a device `.cache/jax` (programs compiled by one device run are reused
# by the next: XLA:GPU compiles take seconds each); on the CPU only the directory scripts/run_tests.py makes
# for one run and hands to all its groups, so that a decode loop compiled by one test module is read back,
# not compiled again, by the later modules and groups that run it (`release_compiled_programs` drops it from
# memory). A plain `pytest` compiles everything.
CACHE_ENV = "SPECDEC_TEST_CACHE"
_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "looked up",
                 "/jax/compilation_cache/cache_hits": "read back"}
_cache_counts = dict.fromkeys(_CACHE_EVENTS.values(), 0)


def pytest_configure(config):
  default = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "jax") if ON_DEVICE else None
  cache_dir = os.environ.get(CACHE_ENV, default)
  if ON_DEVICE or cache_dir:
    import jax
  if ON_DEVICE:
    jax.config.update("jax_default_matmul_precision", "highest")
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)   # small programs too

    def count(event, **_):
      if event in _CACHE_EVENTS:
        _cache_counts[_CACHE_EVENTS[event]] += 1
    jax.monitoring.register_event_listener(count)


def pytest_terminal_summary(terminalreporter):
  if _cache_counts["looked up"]:
    terminalreporter.write_line("persistent compilation cache: {read back} of {looked up} programs read back, "
                                "not compiled".format(**_cache_counts))


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


@pytest.fixture(scope="session")
def v4_8():
  """The 4 compile-only chips of a TPU v4-8 (`plan.topology`: libtpu compiles for them on this CPU, without a
  TPU); skips the tests that ask for them, saying why, where libtpu is not installed or cannot make them."""
  from specdec.evaluation import plan
  try:
    return plan.topology("v4-8")
  except Exception as error:  # noqa: BLE001 - any libtpu failure means no TPU compiles here
    pytest.skip(f"no TPU v4 topology from libtpu: {error}")
