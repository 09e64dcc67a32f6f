import os
import shutil
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
    config.addinivalue_line("markers", "slow: starts Python anew (a tool as a user's shell starts it, two ranks, "
                                       "a run to kill, the recipes' shells); `make test-slow` runs these, "
                                       "`make test` the others, CI both")
    subprocess.Popen.__init__ = _new_pythons_only_where_slow(subprocess.Popen.__init__)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: one worker per core, one thread each
        torch.set_num_threads(1)


# --- the slow tests: those that start Python anew, each paying 5-8 s of CPU for its imports ---------

_SLOW = {"now": None}  # whether the test that runs now is marked slow; None between tests (xdist's workers)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """The test's mark holds through its fixtures' setup and teardown too: a module's fixture is set up by
    the first test that asks for it."""
    _SLOW["now"] = item.get_closest_marker("slow") is not None
    yield
    _SLOW["now"] = None


def _new_pythons_only_where_slow(start):
    """subprocess.Popen.__init__, refusing a new Python outside the tests marked slow: `make test` stays
    fast by rule, not by care. A Python that a shell starts is out of its sight (docs/testing.md)."""
    def starts(self, args, *rest, **kwargs):
        program = args if isinstance(args, (str, os.PathLike)) else args[0]
        if _SLOW["now"] is False and not kwargs.get("shell") and _is_python(str(program)):
            raise AssertionError(f"this test starts a new Python ({' '.join(map(str, args))[:200]}): mark it "
                                 "@pytest.mark.slow, or run the code in this process (docs/testing.md)")
        start(self, args, *rest, **kwargs)

    return starts


def _is_python(program: str) -> bool:
    """This interpreter, or a script it runs (a console script's first line names it)."""
    path = os.path.realpath(shutil.which(program) or program)
    if path == os.path.realpath(sys.executable):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def pytest_report_header():
    return f"CPU kernels: {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY)"


# the modules that take longest, started first in either tier (a module runs on one worker): the
# recipes run in the background, their longest one a chain of 80 commands, while the other worker goes on
FIRST = ("test_recipes.py", "test_bad_values.py", "test_translation_cli.py", "test_cpu_tier.py",
         "test_reliability.py", "test_data_prep.py", "test_passes.py")


# the core tests, run under each torch of the supported range (`make test-torch`, docs/install.md): the
# models and their streaming task, the loop (fused against the reference, and in passes), the graphs
# through the stand-in and their cache, and fairseq's tools on them (checkpoints go through torch.load);
# not the recipes, the data preparation or the other tools
CORE = ("test_feedback_decoder.py", "test_feedback_lm.py", "test_memory_options.py", "test_builders.py",
        "test_fused_loop.py", "test_loop_pieces.py", "test_block_weight_gradients.py",
        "test_graphed_loop.py", "test_graphs_on_each_device.py", "test_cuda_graph_safety.py",
        "test_translation_cli.py", "test_lm_cli.py", "test_passes.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in CORE:
            item.add_marker(pytest.mark.core)
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


# --- runs the test modules share: each built once per process (an xdist worker), read and never written ---


@pytest.fixture(scope="session")
def lm_data(tmp_path_factory):
    """A tiny language-modelling corpus (helpers.write_lm_corpus: 60 training lines, about 430 tokens,
    7 blocks of 4 streams x 16 tokens per epoch) and its binarized data: (corpus folder, data directory)."""
    from helpers import preprocess_lm, write_lm_corpus

    root = tmp_path_factory.mktemp("lm")
    write_lm_corpus(root / "corpus", 60)
    preprocess_lm(root / "corpus", root / "data-bin")
    return root / "corpus", root / "data-bin"


@pytest.fixture(scope="session")
def lm_run(lm_data, tmp_path_factory):
    """A tiny feedback LM trained on lm_data with fairseq-train (helpers.LM_MODEL, Adam, blocks of 16
    tokens in 4 streams, 36 updates: 5 epochs of 7 blocks, which learn its counting pattern, and one block
    into the sixth): .corpus, .data, .updates, .checkpoint (checkpoint_last.pt), .log (what fairseq-train
    printed) and .log_file (its --log-file)."""
    from helpers import LM_MODEL, run

    corpus, data = lm_data
    root, updates = tmp_path_factory.mktemp("lm-run"), 36
    log = run("train", data, *LM_MODEL, "--optimizer", "adam", "--lr", "3e-3", "--tokens-per-sample", 16,
              "--batch-size", 4, "--max-update", updates, "--save-dir", root / "checkpoints",
              "--log-file", root / "train.log").stdout
    return types.SimpleNamespace(corpus=corpus, data=data, updates=updates, log=log, log_file=root / "train.log",
                                 checkpoint=root / "checkpoints" / "checkpoint_last.pt")


@pytest.fixture(scope="session")
def translation_data(tmp_path_factory):
    """A tiny parallel corpus (synthetic_translation: 80 training pairs, 8 valid, 8 test, 12 words, up to 8
    tokens: 10 batches of 8 per epoch), binarized with a joined dictionary: the data directory."""
    from fairseq_feedback_cli.data_prep.synthetic_translation import write_corpus
    from helpers import preprocess_translation

    root = tmp_path_factory.mktemp("translation")
    write_corpus(str(root / "corpus"), {"train": 80, "valid": 8, "test": 8}, vocab=12, max_len=8)
    preprocess_translation(root / "corpus", root / "data-bin")
    return root / "data-bin"


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
