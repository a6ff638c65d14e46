# Two commands on a fresh machine with only python3: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memsave-installed

.PHONY: demo test bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,bench]"
	$(PY) -m pip install -q --no-deps keras-hub==0.32.0
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks.depth --demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# Every benchmark behind the README's figures (about 17 minutes on 2 cores).
bench: $(STAMP)
	$(PY) -m benchmarks.depth
	$(PY) -m benchmarks.models
	$(PY) -m benchmarks.rewrite_speed
	$(PY) -m benchmarks.plan_speed
	$(PY) -m benchmarks.reversible
	$(PY) examples/unet.py
	$(PY) examples/keras_fit.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
