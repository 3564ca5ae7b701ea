# yafsdp: two commands from a fresh clone.
#   make demo   install, then plan / inspect / convert / restore / verify / profile /
#               check bundled sample models
#   make test   install, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first and on its own: on machines whose pip finds a local CPU
# wheel (find-links) this takes it instead of a multi-GB CUDA build. Elsewhere pick
# your build, e.g.  make install TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
DEMO := demo-out

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e '.[dev,hf,peft]'
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/yafsdp plan --model sample_models.models:gpt --gpu-memory 6MiB --reserve 0 --seq-len 64 --world-size 1,2,4,8
	$(BIN)/yafsdp inspect sample_models/llama.safetensors --world-size 8
	rm -rf $(DEMO)
	mkdir $(DEMO)
	$(BIN)/yafsdp convert sample_models/llama.safetensors --world-size 8 --sharded -o $(DEMO)/llama-flat
	$(BIN)/yafsdp reshard $(DEMO)/llama-flat --world-size 4 -o $(DEMO)/llama.flat.safetensors
	$(BIN)/yafsdp restore $(DEMO)/llama.flat.safetensors -o $(DEMO)/llama.restored.safetensors
	$(BIN)/yafsdp verify sample_models/llama.safetensors --model sample_models.models:llama --world-size 2
	$(BIN)/yafsdp profile sample_models/gpt.safetensors --model sample_models.models:gpt --world-size 4
	$(BIN)/yafsdp check --model sample_models.models:llama --baseline $(DEMO)/llama.mem.json --update -n 8 --seq-len 64
	$(BIN)/yafsdp check --baseline $(DEMO)/llama.mem.json

# One worker per core; --dist loadfile keeps a file's tests on one worker, so a
# file's session fixtures (the docs workspace, the forkserver of ranks) are built once.
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadfile

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .ruff_cache .hypothesis
