# `make test` and `make quickstart` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: test test-slow quickstart bench clean tiny-e2e

$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

# One pytest process per folder of tests/ (found, not listed), two at a time: scripts/run_tests.py. XLA:CPU
# segfaulted while compiling late in one long process (every compiled program maps ~3 memory regions per
# compiled object, and a few hundred programs reach Linux's vm.max_map_count, 65,530): tests/conftest.py
# frees compiled programs after each module, and fresh processes per folder keep the count low too.
TEST_JOBS ?= 2

test: $(STAMP)
	$(BIN)/python scripts/run_tests.py --jobs $(TEST_JOBS)

test-slow: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -m slow --run-slow tests

quickstart: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/quickstart.py

# Whatever backend JAX finds (CPU, GPU, TPU): experiments/backend_<backend>/results.{json,md}.
bench: $(STAMP)
	$(BIN)/python scripts/bench_backend.py

clean:
	rm -rf $(VENV) outputs .pytest_cache

# The paper's T5 path end to end on this CPU in a few minutes: fine-tune a T5 drafter and verifier on a
# (data, model) mesh, sweep them, plot (outputs/paper_t5_tiny/). Cloud TPU: scripts/launch.py (README).
tiny-e2e: $(STAMP)
	rm -rf outputs/paper_t5_tiny
	for role in drafter:t5_tiny verifier:t5_mini; do name=$${role%%:*}; preset=$${role##*:}; \
	  JAX_PLATFORMS=cpu $(BIN)/python scripts/train.py --gin_file=configs/train/paper_t5_tiny.gin \
	    --gin_bindings="train.preset = '$$preset'" --gin_bindings="train.model_dir = 'outputs/paper_t5_tiny/$$name'" \
	    --gin_bindings="export.path = 'outputs/paper_t5_tiny/export/$$name'" || exit 1; done
	JAX_PLATFORMS=cpu $(BIN)/python scripts/sweep.py --gin_file=configs/experiments/paper_t5_tiny.gin
	JAX_PLATFORMS=cpu $(BIN)/python scripts/plot.py --results=outputs/paper_t5_tiny/results.jsonl
