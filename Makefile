# Quick start: `make demo` and `make test`. Both create .venv (if missing) and install pipeopt into it.
# TORCH picks the torch build: the default is torch 2.13.0's CPU build; a GPU user can pass e.g.
# `make demo TORCH="torch==2.14.1 torchvision==0.29.1"`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipeopt-installed
# The DALI tests compare with torchvision, whose released wheels import only beside the torch release they were built
# for: they run in a second venv with torch 2.14.1 (a CUDA build, ~5.5 GB; it runs on the CPU), torchvision 0.29.1
# and DALI (~425 MB).
VISION_VENV ?= .venv-vision
VISION      ?= torch==2.14.1 torchvision==0.29.1
DALI        ?= nvidia-dali-cuda120==2.4.0
VPY         := $(VISION_VENV)/bin/python
VISION_STAMP := $(VISION_VENV)/.pipeopt-installed
VISION_TESTS := tests/dali tests/callbacks/test_dali.py tests/apply/test_sample_cache_vision.py

.PHONY: install browser demo test test-repeat test-lightning bench bench-dali bench-cache clean

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

# The suite, then the DALI and torchvision tests where both are installed (in .venv they skip and say so). That no
# pipeopt code validates with `assert` (which `python -O` strips) is checked statically by tests/test_package.py.
test: $(STAMP) $(VISION_STAMP) browser
	$(PY) -m ruff check pipeopt tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m pytest -q
	$(VPY) -m pytest -q -p no:cacheprovider $(VISION_TESTS)

# `make test` N times on this clone, one line per run, then "P passed, F failed" (logs in .test-repeat/).
# LOAD=1 keeps one CPU core busy with another process for the whole time, as a shared CI machine might.
N    ?= 5
LOAD ?= 0
test-repeat: $(STAMP) $(VISION_STAMP) browser
	@bash tests/repeat.sh $(N) $(LOAD)

# Lightning's own tests (a CPU subset) with PipeOpt attached to every Trainer, observe-only and with the default
# groups; prints the tests that fail only with PipeOpt. Not part of `make test`: Lightning's test sources are not on
# PyPI. LIGHTNING_TESTS is the tests/ folder of a Lightning-AI/pytorch-lightning checkout, e.g. from
#   git clone https://github.com/Lightning-AI/pytorch-lightning && git -C pytorch-lightning checkout 2.6.5
LIGHTNING_TESTS   ?=
LIGHTNING_VERSION ?= 2.6.6
LVENV             ?= .venv-lightning
LIGHTNING_STAMP   := $(LVENV)/.pipeopt-installed
$(LIGHTNING_STAMP): pyproject.toml Makefile
	test -x $(LVENV)/bin/python || $(PYTHON) -m venv $(LVENV)
	$(LVENV)/bin/python -m pip install -q $(TORCH)
	$(LVENV)/bin/python -m pip install -q -e . "lightning==$(LIGHTNING_VERSION)" pytest pytest-timeout jsonargparse \
	  cloudpickle psutil scikit-learn tensorboard
	touch $(LIGHTNING_STAMP)

test-lightning: $(LIGHTNING_STAMP)
	@test -n "$(LIGHTNING_TESTS)" || { echo "make test-lightning LIGHTNING_TESTS=<the tests/ folder of a Lightning checkout>"; exit 2; }
	$(LVENV)/bin/python tests/lightning/run_suite.py $(LIGHTNING_TESTS) --out benchmarks/results/lightning_suite.json

bench: $(STAMP)
	$(PY) -m benchmarks.run all

bench-dali: $(VISION_STAMP)
	$(VPY) -m benchmarks.dali_decode

# The sample cache against the best DataLoader and the compute-only ceiling: storage scenarios in .venv, the
# ImageFolder ones (torchvision, DALI) in .venv-vision; one results file. Then what reading the kept store costs a
# step in a plain training loop (benchmarks/results/store_read.json).
bench-cache: $(STAMP) $(VISION_STAMP)
	$(PY) -m benchmarks.sample_cache --scenarios storage_latency storage_latency_high
	$(PY) -m benchmarks.store_read
	$(VPY) -m benchmarks.sample_cache --scenarios validation_chain imagefolder_decode imagefolder_decode_long

clean:
	rm -rf $(VENV) $(VISION_VENV) $(LVENV) pipeopt_reports .pytest_cache .test-repeat
