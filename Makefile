# Quick start: `make demo` and `make test`. Both create .venv (if missing) and install pipeopt into it.
# TORCH picks the torch build: the default installs a CPU build from local disk on these machines;
# a GPU user can pass e.g. `make demo TORCH="torch==2.14.1 torchvision==0.29.1"`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipeopt-installed
# The DALI tests compare with torchvision, whose wheels here import only beside torch 2.14.1 (a CUDA build from
# local disk, ~5.5 GB; it runs on the CPU): they run in a second venv with DALI (~425 MB from PyPI) installed too.
VISION_VENV ?= .venv-vision
VISION      ?= torch==2.14.1 torchvision==0.29.1
DALI        ?= nvidia-dali-cuda120==2.4.0
VPY         := $(VISION_VENV)/bin/python
VISION_STAMP := $(VISION_VENV)/.pipeopt-installed
DALI_TESTS  := tests/dali tests/callbacks/test_dali.py

.PHONY: install browser demo test bench bench-dali clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

$(VISION_STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VISION_VENV)
	$(VPY) -m pip install -q $(VISION) $(DALI)
	$(VPY) -m pip install -q -e ".[dali,vision,test]"
	touch $(VISION_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The HTML report is checked in a real headless Chromium (Debian's package). Installed here when missing and
# possible (root with apt-get); otherwise that one test is skipped and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "chromium could not be installed: the browser test will be skipped"

# The suite runs twice: as is, and under `python -O` (asserts stripped: nothing may validate with them); there the
# DALI tests skip (no DALI, no torchvision) and say so. Then the DALI tests run where both are installed.
test: $(STAMP) $(VISION_STAMP) browser
	$(PY) -m pytest -q
	$(PY) -O -m pytest -q -p no:cacheprovider
	$(VPY) -m pytest -q -p no:cacheprovider $(DALI_TESTS)

bench: $(STAMP)
	$(PY) -m benchmarks.run all

bench-dali: $(VISION_STAMP)
	$(VPY) -m benchmarks.dali_decode

clean:
	rm -rf $(VENV) $(VISION_VENV) pipeopt_reports .pytest_cache
