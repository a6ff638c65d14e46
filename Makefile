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
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks.depth --demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m benchmarks.depth

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
