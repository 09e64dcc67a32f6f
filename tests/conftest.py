import os
import subprocess
import sys
import types

import pytest
import torch

# the checkout's own packages, before any installed copy
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one); on a GPU machine: -m gpu")
    config.addinivalue_line("markers", "half_precision: computes in 16-bit floats on the CPU; "
                                       "tests/test_cpu_kernels.py runs it again under each of the CPU's kernel sets")
    config.addinivalue_line("markers", "core: a test of a module in CORE, which `make test-torch` runs under "
                                       "another torch (-m core)")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: one worker per core, one thread each
        torch.set_num_threads(1)


def pytest_report_header():
    return f"CPU kernels: {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY)"


# the modules that take longest, started first under `make test` (a module runs on one worker): the
# recipes run in the background, their longest one a chain of 80 commands, while the other worker goes on
FIRST = ("test_recipes.py", "test_bad_values.py", "test_translation_cli.py", "test_cpu_tier.py",
         "test_reliability.py", "test_data_prep.py")


# the core tests, run under each torch of the supported range (`make test-torch`, docs/install.md): the
# models and their streaming task, the loop (fused against the reference), the graphs through the stand-in
# and their cache, and fairseq's tools on them (checkpoints go through torch.load); not the recipes, the
# data preparation or the other tools
CORE = ("test_feedback_decoder.py", "test_feedback_lm.py", "test_memory_options.py", "test_builders.py",
        "test_fused_loop.py", "test_loop_pieces.py", "test_block_weight_gradients.py",
        "test_graphed_loop.py", "test_graphs_on_each_device.py", "test_cuda_graph_safety.py",
        "test_translation_cli.py", "test_lm_cli.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in CORE:
            item.add_marker(pytest.mark.core)
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory):
    """(raw task folder, data directory, checkpoint) of helpers.train_toy_model, trained once for the tests
    of the demo and of feedback-evaluate-toy."""
    from helpers import train_toy_model

    return train_toy_model(tmp_path_factory.mktemp("toy"))


@pytest.fixture
def preprocess_in_this_process(monkeypatch):
    """The data scripts' fairseq-preprocess (steps.binarize starts `python -m
    fairseq_cli.preprocess`) run in this process, which imported fairseq
    already: a new process spent most of a script's time importing it. The
    recipes (tests/test_recipes.py) run the scripts, and it, as processes."""
    from fairseq_feedback_cli.data_prep import steps
    from helpers import run

    def run_here(cmd, stdout=None, stderr=None):
        assert cmd[:3] == [sys.executable, "-m", "fairseq_cli.preprocess"], cmd
        proc = run("preprocess", *cmd[3:], check=False)
        if stdout is not None:  # its log file
            stdout.write(proc.stdout + proc.stderr)
        return subprocess.CompletedProcess(cmd, proc.returncode)

    monkeypatch.setattr(steps, "subprocess", types.SimpleNamespace(run=run_here))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
