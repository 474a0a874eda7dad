# Two entry points for a fresh machine (Debian, Python 3.11):
#   make demo   - build .venv, run a local cluster (chief, 2 workers, 2 PS,
#                 evaluator) training the CTR example on generated data.
#   make test   - build .venv (TF 2.15) and .venv-tflatest (newest TF 2.x with
#                 tf-keras), run the whole suite in the first and everything
#                 but tf215_only tests in the second. Fails if either fails.
# Both create their virtual environments themselves.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LATEST_VENV ?= .venv-tflatest
LATEST_PY := $(LATEST_VENV)/bin/python
DEMO_DIR ?= runs/demo
DEMO_STEPS ?= 1500
PYTEST := -m pytest -ra -p no:cacheprovider --durations=40
# Extra pytest arguments for both runs, e.g. make test PYTEST_ARGS="-x -k examples".
PYTEST_ARGS ?=

# What the newest-TF environment runs: the Keras path. Tests marked
# tf215_only (e.g. the Estimator cluster tests: tf.estimator is gone since
# TF 2.16) are deselected; tests that need tf.estimator skip themselves there,
# and the Estimator's clear ImportError on new TF is checked for real.
LATEST_SELECT := -m "not tf215_only and not full_product"
# What the TF 2.15 run leaves out: the composition suite's full product
# (tests/cluster/test_composition.py, ~40 min), run by make test-composition-full.
TF215_SELECT := -m "not full_product"
# Known failures on the newest TF: one --deselect per test, each with its
# reason. Keep it empty.
LATEST_DESELECT ?=

.PHONY: demo test test-tf215 test-tflatest test-composition-full test-fast test-cluster env env-tflatest host-tools clean

$(VENV)/.installed: setup.cfg pyproject.toml
	@start=$$SECONDS; set -ex; \
	$(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -e ".[tf215,test]"; \
	touch $@; set +x; echo "make: $(VENV) (TF 2.15) installed in $$((SECONDS - start)) s"

# The newest TF 2.x tested, with tf-keras of the same minor version. CI uses
# the CPU-only wheel like .venv does (the `tensorflow` wheel prints CUDA-stub
# lines on every import, which the launcher's and the config CLI's output
# tests rightly reject). tf-keras declares a dependency on the `tensorflow`
# distribution, which would install the full wheel over tensorflow-cpu, hence
# --no-deps (tensorflow-cpu provides the same `tensorflow` package). Keep the
# versions in step with setup.cfg's [tflatest] extra. tf-keras and TensorBoard
# follow TensorFlow's minor version (TFLATEST=2.21.0 -> tf-keras==2.21.*).
TFLATEST ?= 2.21.0
TFLATEST_MINOR := $(basename $(TFLATEST))

$(LATEST_VENV)/.installed: setup.cfg pyproject.toml
	@start=$$SECONDS; set -ex; \
	$(PYTHON) -m venv $(LATEST_VENV); \
	$(LATEST_PY) -m pip install -q --upgrade pip; \
	$(LATEST_PY) -m pip install -q "tensorflow-cpu==$(TFLATEST)" \
		"tensorboard==$(TFLATEST_MINOR).*"; \
	$(LATEST_PY) -m pip install -q --no-deps "tf-keras==$(TFLATEST_MINOR).*"; \
	$(LATEST_PY) -m pip install -q -e ".[test]"; \
	touch $@; set +x; echo "make: $(LATEST_VENV) (TF $(TFLATEST)) installed in $$((SECONDS - start)) s"

env: $(VENV)/.installed

env-tflatest: $(LATEST_VENV)/.installed

# The emulated-host tests and `benchmarks.run --network` need iproute2's `ip`
# and `tc` (and root, which CI has): installed from Debian's packages if absent.
host-tools:
	@command -v ip >/dev/null && command -v tc >/dev/null || { \
		echo "make: installing iproute2 (ip, tc) for the emulated-host tests"; \
		apt-get install -y -q iproute2 || { apt-get update -q && apt-get install -y -q iproute2; }; }

demo: $(VENV)/.installed
	rm -rf $(DEMO_DIR)
	$(PY) -m tf_psplugin.launch --workers 2 --ps 2 --evaluator -- \
		$(PY) keras_examples/ctr.py --model_dir $(DEMO_DIR) --train_steps $(DEMO_STEPS)

# Both environments (built side by side), then both runs side by side: each
# writes its own log under $(TEST_LOG_DIR), printed whole when it ends, with
# a line of progress every $(TEST_HEARTBEAT) s meanwhile. Part of a cluster
# test's time is TF start-up, port waits and RPC latency rather than CPU, so
# side by side the two runs take less than one after the other (measured in
# docs/versions.md; the gain is modest on 2 cores). TEST_PARALLEL=0 runs them
# one after the other. The exit status is nonzero if either run failed.
TEST_PARALLEL ?= 1
TEST_LOG_DIR ?= runs/test-logs
TEST_HEARTBEAT ?= 300

test: host-tools
	@start=$$SECONDS; $(MAKE) --no-print-directory -j2 env env-tflatest || exit 1; \
	echo "== make test: environments ready in $$((SECONDS - start)) s"
	@if [ "$(TEST_PARALLEL)" = 0 ]; then \
		status=0; \
		$(MAKE) --no-print-directory test-tf215 || status=1; \
		$(MAKE) --no-print-directory test-tflatest || status=1; \
	else \
		start=$$SECONDS; mkdir -p $(TEST_LOG_DIR); \
		echo "== make test: TF 2.15 and newest-TF runs side by side, logs in $(TEST_LOG_DIR)/"; \
		$(MAKE) --no-print-directory test-tf215 > $(TEST_LOG_DIR)/tf215.log 2>&1 & p1=$$!; \
		$(MAKE) --no-print-directory test-tflatest > $(TEST_LOG_DIR)/tflatest.log 2>&1 & p2=$$!; \
		( while sleep $(TEST_HEARTBEAT); do \
			for run in tf215 tflatest; do \
				echo "   $$((SECONDS - start)) s $$run: $$(grep -ao '[0-9]*%]' $(TEST_LOG_DIR)/$$run.log | tail -1)"; \
			done; done ) & beat=$$!; \
		wait $$p1; s1=$$?; wait $$p2; s2=$$?; kill $$beat 2>/dev/null; wait $$beat 2>/dev/null; \
		cat $(TEST_LOG_DIR)/tf215.log $(TEST_LOG_DIR)/tflatest.log; \
		echo "== make test: both runs in $$((SECONDS - start)) s (TF 2.15 exit $$s1, newest TF exit $$s2)"; \
		status=0; [ $$s1 -eq 0 ] && [ $$s2 -eq 0 ] || status=1; \
	fi; \
	if [ $$status -ne 0 ]; then echo "make test: FAILED (see the runs above)"; fi; \
	exit $$status

# TF 2.15: every test (Keras, Estimator, launcher, config). TF_USE_LEGACY_KERAS
# is forced off: on 2.15 it would make tf.keras look for the tf-keras package.
test-tf215: $(VENV)/.installed
	@echo "== make test: TF 2.15 ($(VENV)), whole suite"
	@start=$$SECONDS; TF_USE_LEGACY_KERAS=0 $(PY) $(PYTEST) $(TF215_SELECT) $(PYTEST_ARGS) tests; code=$$?; \
	echo "== TF 2.15 run: exit $$code in $$((SECONDS - start)) s"; exit $$code

# Newest TF 2.x + tf-keras, with TF_USE_LEGACY_KERAS=1: the Keras path.
test-tflatest: $(LATEST_VENV)/.installed
	@echo "== make test: newest TF ($(LATEST_VENV), TF_USE_LEGACY_KERAS=1), Keras path"
	@start=$$SECONDS; TF_USE_LEGACY_KERAS=1 $(LATEST_PY) $(PYTEST) $(LATEST_SELECT) \
		$(LATEST_DESELECT) $(PYTEST_ARGS) tests; code=$$?; \
	echo "== newest-TF run: exit $$code in $$((SECONDS - start)) s"; exit $$code

# The composition suite's full product (stacking x optimizer x mode x
# situation, 100 cells per stacking) on both TF versions: about 80 minutes.
test-composition-full: $(VENV)/.installed $(LATEST_VENV)/.installed
	TF_USE_LEGACY_KERAS=0 $(PY) $(PYTEST) -m full_product tests/cluster/test_composition.py
	TF_USE_LEGACY_KERAS=1 $(LATEST_PY) $(PYTEST) -m full_product tests/cluster/test_composition.py

test-fast: $(VENV)/.installed
	TF_USE_LEGACY_KERAS=0 $(PY) $(PYTEST) tests/unit

test-cluster: $(VENV)/.installed
	TF_USE_LEGACY_KERAS=0 $(PY) $(PYTEST) tests/cluster

clean:
	rm -rf $(VENV) .venv-* runs *.egg-info
