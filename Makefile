# `make demo` and `make test` set up .venv (once; reruns reuse it) and run.
# TORCH picks the torch build: the default is the CPU wheel this project is
# tested with; on a GPU machine use e.g. `make test TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN = $(VENV)/bin

.PHONY: setup test test-slow test-torch demo bench cpu-tier clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

# on every core (pytest-xdist), one thread per worker; a test module stays on one worker, which
# trains its fixtures once; tests/conftest.py starts the longest modules first. `make test`: every
# test that runs in pytest's processes; `make test-slow`: those that start Python anew (marked slow:
# the recipes and the CPU tier end to end, tools started as a shell starts them, two ranks, runs
# killed midway, the half-precision tests under the CPU's other kernel sets). CI runs both.
PYTEST = OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder
test: setup
	$(PYTEST) -m "not slow" tests

test-slow: setup
	$(PYTEST) -m slow tests

# The core tests (tests/conftest.py: CORE) under the torch TORCH names (e.g. TORCH=torch==2.6.0), in
# an environment of its own, built afresh (.venv-torch-2.6.0; .venv stays as it is): that torch first,
# then this package as README.md and docs/install.md install it beside a torch (the block under
# "<!-- run by Makefile -->", the same on both pages), which must leave torch as it was.
INSTALL_BLOCK = awk '/<!-- run by Makefile -->/ {found = 1; next} found && /^```/ {if (inside) exit; inside = 1; next} inside'
test-torch: VENV = .venv-$(subst ==,-,$(TORCH))
test-torch: TORCH_VERSION = $(BIN)/python -c "import importlib.metadata as m; print(m.version('torch'))"
test-torch:
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(TORCH_VERSION) > $(VENV)/torch-before
	$(INSTALL_BLOCK) README.md > $(VENV)/install-beside-torch.sh
	@$(INSTALL_BLOCK) docs/install.md | cmp -s - $(VENV)/install-beside-torch.sh || { \
	    echo "make test-torch: README.md and docs/install.md install beside a torch differently"; exit 1; }
	@test -s $(VENV)/install-beside-torch.sh || { echo "make test-torch: no block to run in README.md"; exit 1; }
	PATH="$(abspath $(BIN)):$$PATH" bash -eu $(VENV)/install-beside-torch.sh
	@$(TORCH_VERSION) | cmp -s - $(VENV)/torch-before && echo "torch $$(cat $(VENV)/torch-before) kept" || { \
	    echo "make test-torch: installing this package replaced torch $$(cat $(VENV)/torch-before)" \
	         "with $$($(TORCH_VERSION))"; exit 1; }
	$(PYTEST) -m core tests

demo: setup
	$(BIN)/python -m fairseq_feedback_cli.demo --out demo

bench: setup
	$(BIN)/feedback-benchmark

# The CPU tier of examples/results/README.md, from data-bin/debian_de_en, data-bin/debian_docs and
# data-bin/debian_docs_bytes (fairseq_feedback_cli.data_prep); resumes where it stopped.
cpu-tier: setup
	PATH="$(abspath $(BIN)):$$PATH" bash examples/results/cpu_tier.sh

clean:
	rm -rf $(VENV) demo
