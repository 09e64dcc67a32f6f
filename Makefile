# `make demo` and `make test` set up .venv (once; reruns reuse it) and run.
# TORCH picks the torch build: the default is the CPU wheel this project is
# tested with; on a GPU machine use e.g. `make test TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup test demo bench cpu-tier clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

# every test, on every core (pytest-xdist), one thread per worker; a test module stays on one
# worker, which trains its fixtures once; tests/conftest.py starts the longest modules first;
# tests/test_cpu_kernels.py runs the half-precision tests again under the CPU's other kernel sets
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder tests

demo: setup
	$(BIN)/python -m fairseq_feedback_cli.demo --out demo

bench: setup
	$(BIN)/feedback-benchmark

# The CPU tier of examples/results/README.md, from data-bin/debian_de_en and
# data-bin/debian_docs (fairseq_feedback_cli.data_prep); resumes where it stopped.
cpu-tier: setup
	PATH="$(abspath $(BIN)):$$PATH" bash examples/results/cpu_tier.sh

clean:
	rm -rf $(VENV) demo
