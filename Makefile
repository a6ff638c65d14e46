# Two commands on a fresh machine with only python3: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memsave-installed

.PHONY: demo test test-fast test-all bench docs clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,bench,xla]"
	$(PY) -m pip install -q --no-deps keras-hub==0.32.0
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks.depth --demo

# Two workers: CI has 2 cores. oneDNN's fusions are on by default on most x86
# servers and off on others: the suite runs with them forced on, and the
# float32 conv and real-model cases (marker both_onednn) again with them off.
ONEDNN_ON := TF_ENABLE_ONEDNN_OPTS=1
ONEDNN_OFF := TF_ENABLE_ONEDNN_OPTS=0

# CI: a third as many random graphs as make test-all (hypothesis profile "quick").
test: $(STAMP)
	HYPOTHESIS_PROFILE=quick $(ONEDNN_ON) $(PY) -m pytest -q -n 2 -m "not slow" tests
	HYPOTHESIS_PROFILE=quick $(ONEDNN_OFF) $(PY) -m pytest -q -n 2 -m "both_onednn and not slow" tests

# Everything, the slow real-model cases included (see docs/testing.md for times).
test-all: $(STAMP)
	$(ONEDNN_ON) $(PY) -m pytest -q -n 2 tests
	$(ONEDNN_OFF) $(PY) -m pytest -q -n 2 -m both_onednn tests

# For development: without the real-model conformance suite and the tests
# marked heavy (oneDNN on; CI runs them all with `make test`).
test-fast: $(STAMP)
	$(ONEDNN_ON) $(PY) -m pytest -q -n 2 -m "not real_models and not slow and not heavy" tests

# Every benchmark behind the README's figures (about 25 minutes on 2 cores).
bench: $(STAMP)
	$(PY) -m benchmarks.depth
	$(PY) -m benchmarks.models
	$(PY) -m benchmarks.rewrite_speed
	$(PY) -m benchmarks.plan_speed
	$(PY) -m benchmarks.op_rates
	$(PY) -m benchmarks.reversible
	$(PY) -m benchmarks.xla
	$(PY) examples/unet.py
	$(PY) examples/keras_fit.py

# Copy benchmarks/results/*.md into the tables of README.md and docs/*.md.
docs:
	$(PYTHON) -m benchmarks.tables

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
