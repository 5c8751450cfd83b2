# Quick start: `make demo` and `make test`. Both create .venv (if missing) and install pipeopt into it.
# TORCH picks the torch build: the default installs a CPU build from local disk on these machines;
# a GPU user can pass e.g. `make demo TORCH="torch==2.14.1 torchvision==0.29.1"`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipeopt-installed

.PHONY: install browser demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The HTML report is checked in a real headless Chromium (Debian's package). Installed here when missing and
# possible (root with apt-get); otherwise that one test is skipped and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "chromium could not be installed: the browser test will be skipped"

# The suite runs twice: as is, and under `python -O` (asserts stripped: nothing may validate with them).
test: $(STAMP) browser
	$(PY) -m pytest -q
	$(PY) -O -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) -m benchmarks.run all

clean:
	rm -rf $(VENV) pipeopt_reports .pytest_cache
