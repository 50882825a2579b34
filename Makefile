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

# Several pytest processes, each over one layer's tests, two at a time (scripts/run_tests.py; the machine
# CI uses has 2 cores). XLA:CPU segfaulted while compiling late in one long process: every compiled
# program it keeps maps ~3 memory regions per compiled object, and a few hundred programs reach Linux's
# vm.max_map_count (65,530). tests/conftest.py frees compiled programs after each module; fresh processes
# per layer keep the count low too. Groups start in this order, longest first.
# SPMD tests on 8 fake CPU devices, in a process of their own (the flag must be set before JAX starts).
SHARDED_TESTS := tests/test_sharding.py
TEST_GROUPS := \
  "tests/test_transformer.py tests/test_decoding.py tests/test_decoding_laws.py tests/test_registry.py tests/test_drafters.py" \
  "tests/test_cs_drafting.py tests/test_specdec_pp.py tests/test_multi_draft.py" \
  "tests/test_training.py tests/test_t5.py tests/test_hf_export.py" \
  "$(SHARDED_TESTS)" \
  "tests/test_sampling.py tests/test_targets.py tests/test_verify.py tests/test_spectr.py tests/test_tree.py tests/test_theory.py tests/test_compiled.py tests/test_cli.py tests/test_rng.py" \
  "tests/test_debian_data.py tests/test_vocab.py tests/test_tasks.py tests/test_seqio_tasks.py tests/test_metrics.py tests/test_pareto.py tests/test_recorded.py tests/test_sweep.py tests/test_launch.py"
TEST_JOBS ?= 2

test: $(STAMP)
	@covered=$$(echo $(TEST_GROUPS) | tr ' ' '\n' | sort); all=$$(ls tests/test_*.py | sort); \
	  if [ "$$covered" != "$$all" ]; then echo "Makefile TEST_GROUPS must list every tests/test_*.py"; exit 1; fi
	$(BIN)/python scripts/run_tests.py --jobs $(TEST_JOBS) --sharded "$(SHARDED_TESTS)" $(TEST_GROUPS)

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
