# Two entry points for a fresh machine (Debian, Python 3.11):
#   make demo   - build .venv, run a local cluster (chief, 2 workers, 2 PS,
#                 evaluator) training the CTR example on generated data.
#   make test   - build .venv, run the whole test suite.
# Both create their virtual environments themselves.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= runs/demo
DEMO_STEPS ?= 300

.PHONY: demo test test-fast test-cluster env clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[tf215,test]"
	touch $@

env: $(VENV)/.installed

demo: $(VENV)/.installed
	rm -rf $(DEMO_DIR)
	$(PY) -m tf_psplugin.launch --workers 2 --ps 2 --evaluator -- \
		$(PY) keras_examples/ctr.py --model_dir $(DEMO_DIR) --train_steps $(DEMO_STEPS)

test: $(VENV)/.installed
	$(PY) -m pytest -ra -p no:cacheprovider tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest -ra -p no:cacheprovider tests/unit

test-cluster: $(VENV)/.installed
	$(PY) -m pytest -ra -p no:cacheprovider tests/cluster

clean:
	rm -rf $(VENV) .venv-* runs *.egg-info
