# `make test` and `make quickstart` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: test test-slow quickstart bench clean

$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The checkpoint tests (training, T5 import) run in their own process: orbax/tensorstore keep thread
# pools alive afterwards, and one XLA:CPU segfault was seen compiling a later test in the same process.
CHECKPOINT_TESTS := tests/test_training.py tests/test_t5.py
test: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q tests $(addprefix --ignore=,$(CHECKPOINT_TESTS))
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q $(CHECKPOINT_TESTS)

test-slow: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -m slow --run-slow tests

quickstart: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/quickstart.py

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/bench_verify.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
