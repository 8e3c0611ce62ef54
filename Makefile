# bertjax developer commands. Every target works on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench lint clean

install: $(STAMP)

# Re-runs only when the dependency declarations change.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

demo: install
	$(PY) -m bertjax.pretrain --config=experiments/pretrain.py:tiny --dry_run
	$(PY) -m bertjax.pretrain --config=experiments/pretrain.py:base --dry_run \
		--config.model.scan_layers=True

bench: install
	$(PY) -m bertjax.benchmark

lint: install
	$(PY) -m ruff check bertjax data_pipeline experiments tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
