# The README's two commands. Set-up is part of each: a missing or stale .venv is
# (re)built from pyproject.toml with every version pinned by requirements.lock (the default
# end of the supported range: Python 3.11, jax 0.10.2). `make test-latest` does the same at
# the newest end (.venv-latest, Python 3.12, requirements-latest.lock).
# Nothing is compiled: the package is pure Python on JAX/XLA.
PYTHON ?= python3
# A Python 3.12 interpreter for the newest end (jax >= 0.11 needs 3.12)
PYTHON_LATEST ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/default
PYTEST_ARGS ?=
# Test processes in parallel (pytest-xdist); most of the suite's time is XLA compilation,
# which is single-threaded, so two workers on two cores take ~0.65x the serial time.
TEST_WORKERS ?= 2

.PHONY: train test setup setup-latest test-latest bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m ba_jax.main --config=configs/default.py --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The newest end of the supported range: the newest jax/flax/optax/orbax/chex/transformers,
# Python 3.12, no torch (PyPI's is a multi-GB CUDA build there): the tests that need torch
# are skipped one by one, and the summary's last line says how many.
VENV_LATEST := .venv-latest
PY_LATEST := $(VENV_LATEST)/bin/python
STAMP_LATEST := $(VENV_LATEST)/.installed

setup-latest: $(STAMP_LATEST)

$(STAMP_LATEST): pyproject.toml requirements-latest.lock
	test -x $(PY_LATEST) || $(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(PY_LATEST) -m pip install -q --disable-pip-version-check -c requirements-latest.lock -e '.[test]'
	touch $(STAMP_LATEST)

test-latest: $(STAMP_LATEST)
	$(PY_LATEST) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The small pure-Python wheels that benchmarks/device_check.sh installs on a GPU image that
# has jax, flax, optax, orbax-checkpoint, chex and transformers but no package registry
# (versions from requirements.lock): run on a connected machine, copy wheels/device along.
DEVICE_WHEELS := ml_collections
.PHONY: device-wheels

device-wheels:
	mkdir -p wheels/device
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  -d wheels/device $(foreach d,$(DEVICE_WHEELS),$$(grep -i '^$(d)==' requirements.lock))
	ls -l wheels/device

# The vLLM rollout engine's own environment (.venv-vllm, scripts/vllm.lock) and its tests;
# the engine process runs from .venv-vllm, the tests from .venv.
.PHONY: vllm test-vllm

vllm:
	bash scripts/setup_vllm.sh

test-vllm: $(STAMP) vllm
	$(PY) -m pytest -q tests_vllm $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VENV_LATEST) .venv-vllm runs .pytest_cache
