# Quick start: `make demo` and `make test`. Both create .venv (if missing) and install pipeopt into it.
# TORCH picks the torch build: the default installs a CPU build from local disk on these machines;
# a GPU user can pass e.g. `make demo TORCH="torch==2.14.1 torchvision==0.29.1"`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipeopt-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The suite runs twice: as is, and under `python -O` (asserts stripped: nothing may validate with them).
test: $(STAMP)
	$(PY) -m pytest -q
	$(PY) -O -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) -m benchmarks.run all

clean:
	rm -rf $(VENV) pipeopt_reports .pytest_cache
