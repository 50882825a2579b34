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

# Several pytest processes, each over one layer's tests: XLA:CPU segfaulted twice while compiling late in
# one long process that had run hundreds of compilations (after orbax/tensorstore and tqdm threads had
# started); fresh processes keep each one's compilation count small. Checkpoint tests (orbax) run last.
TEST_GROUPS := \
  "tests/test_sampling.py tests/test_targets.py tests/test_verify.py tests/test_spectr.py tests/test_tree.py tests/test_theory.py" \
  "tests/test_transformer.py tests/test_decoding.py tests/test_decoding_laws.py tests/test_registry.py tests/test_drafters.py" \
  "tests/test_cs_drafting.py tests/test_specdec_pp.py tests/test_multi_draft.py" \
  "tests/test_debian_data.py tests/test_vocab.py tests/test_tasks.py tests/test_seqio_tasks.py tests/test_metrics.py tests/test_pareto.py tests/test_sweep.py" \
  "tests/test_training.py tests/test_t5.py"
test: $(STAMP)
	@covered=$$(echo $(TEST_GROUPS) | tr ' ' '\n' | sort); all=$$(ls tests/test_*.py | sort); \
	  if [ "$$covered" != "$$all" ]; then echo "Makefile TEST_GROUPS must list every tests/test_*.py"; exit 1; fi
	@for group in $(TEST_GROUPS); do \
	  echo "== pytest $$group"; JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q $$group || exit 1; done

test-slow: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -m slow --run-slow tests

quickstart: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/quickstart.py

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/bench_verify.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
