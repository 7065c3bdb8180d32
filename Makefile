# The README's two commands. Set-up is part of each: a missing or stale .venv is
# (re)built from pyproject.toml with every version pinned by requirements.lock.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/default
PYTEST_ARGS ?=

.PHONY: train test setup bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m ba_jax.main --config=configs/default.py --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
