# The README's two commands. Set-up is part of each: a missing or stale .venv is
# (re)built from pyproject.toml with every version pinned by requirements.lock.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Optional native CPU kernel (ba_jax/native); without a C++ compiler the XLA path is used.
NATIVE := ba_jax/native/_decode_attention.so
WORKDIR ?= runs/default
PYTEST_ARGS ?=
# Test processes in parallel (pytest-xdist); most of the suite's time is XLA compilation,
# which is single-threaded, so two workers on two cores take ~0.65x the serial time.
TEST_WORKERS ?= 2

.PHONY: train test setup bench clean

setup: $(STAMP) $(NATIVE)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]'
	touch $(STAMP)

$(NATIVE): ba_jax/native/decode_attention.cc ba_jax/native/matmul_amx.cc ba_jax/native/attention.cc ba_jax/native/attention_amx.cc ba_jax/native/elementwise.cc ba_jax/native/simd.h ba_jax/native/parallel.h ba_jax/native/attention.h ba_jax/native/amx.h ba_jax/native/buffers.h $(STAMP)
	$(PY) -m ba_jax.native build

train: $(STAMP) $(NATIVE)
	$(PY) -m ba_jax.main --config=configs/default.py --workdir=$(WORKDIR)

test: $(STAMP) $(NATIVE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache $(NATIVE)
