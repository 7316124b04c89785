# Set-up and main jobs. On a fresh machine `make demo` and `make test` create .venv and install
# everything first (CPU torch 2.13.0 from local disk when the venv has no torch yet).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparseffn demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
