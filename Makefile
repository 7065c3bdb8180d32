# The README's two commands. Set-up is part of each: a missing or stale .venv is
# (re)built from pyproject.toml with every version pinned by requirements.lock.
# Nothing is compiled: the package is pure Python on JAX/XLA.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/default
PYTEST_ARGS ?=
# Test processes in parallel (pytest-xdist); most of the suite's time is XLA compilation,
# which is single-threaded, so two workers on two cores take ~0.65x the serial time.
TEST_WORKERS ?= 2

.PHONY: train test setup bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m ba_jax.main --config=configs/default.py --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The vLLM rollout engine's own environment (.venv-vllm, scripts/vllm.lock) and its tests;
# the engine process runs from .venv-vllm, the tests from .venv.
.PHONY: vllm test-vllm

vllm:
	bash scripts/setup_vllm.sh

test-vllm: $(STAMP) vllm
	$(PY) -m pytest -q tests_vllm $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-vllm runs .pytest_cache
