import os
import shutil
import subprocess
import sys
import tempfile
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
    _watch_new_pythons()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: one worker per core, one thread each
        torch.set_num_threads(1)


# --- the slow tests: those that start Python anew, each paying 5-8 s of CPU for its imports ---------
# `make test` stays fast by rule, not by care: a test not marked slow fails if a Python starts while it
# runs, however it starts (this Python, a console script, `env python`, a shell, os.system,
# multiprocessing's spawn). Each new Python reads sitecustomize.py from the first folder of its
# PYTHONPATH, SITECUSTOMIZE below, which writes its command line into the folder WATCH names; the test's
# setup, call and teardown each end by looking there. Nothing is raised where the Python starts, so
# that no `except Exception` around it can hide it. What it cannot see: docs/testing.md.

WATCH = "FAIRSEQ_FEEDBACK_TESTS_NEW_PYTHONS"
SITECUSTOMIZE = f"""# written by tests/conftest.py: this Python's command line, for the test that started it
import os, sys

folder = os.environ.get({WATCH!r})
if folder:
    path = os.path.join(folder, str(os.getpid()))
    try:  # whole or not at all: renamed once written
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(sys.orig_argv))
        os.replace(path + ".tmp", path)
    except OSError:  # the test ended, its folder gone
        pass
"""
_WATCHED = {}  # made once per process (an xdist worker): "root", the tests' folders in it, and "site"


def _watch_new_pythons():
    _WATCHED["root"] = tempfile.mkdtemp(prefix="new-pythons-")
    _WATCHED["site"] = os.path.join(_WATCHED["root"], "site")
    os.mkdir(_WATCHED["site"])
    with open(os.path.join(_WATCHED["site"], "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    subprocess.Popen.__init__ = _carrying_the_watch(subprocess.Popen.__init__)


def pytest_unconfigure():
    shutil.rmtree(_WATCHED.pop("root", ""), ignore_errors=True)


def _watched(env) -> dict:
    """The two variables that make a Python started with environment `env` tell the watch it started."""
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    return {WATCH: os.environ[WATCH],
            "PYTHONPATH": os.pathsep.join([_WATCHED["site"], *(p for p in paths if p and p != _WATCHED["site"])])}


def _carrying_the_watch(start):
    """subprocess.Popen.__init__, adding the watch's variables to an `env=` given while a test not marked
    slow runs: helpers.ENV, made before any test, has neither."""
    def starts(self, *args, **kwargs):
        if WATCH in os.environ and kwargs.get("env") is not None:
            kwargs["env"] = {**kwargs["env"], **_watched(kwargs["env"])}
        start(self, *args, **kwargs)

    return starts


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """The watch holds through the test's fixtures' setup and teardown too: a module's fixture is set up by
    the first test that asks for it. Each test has a folder of its own: a Python still starting as its
    test ends (a Popen never waited for) is not told to the next."""
    before = {name: os.environ.get(name) for name in (WATCH, "PYTHONPATH")}
    if item.get_closest_marker("slow") is None:
        os.environ[WATCH] = tempfile.mkdtemp(dir=_WATCHED["root"])
        os.environ.update(_watched(os.environ))
    try:
        yield
    finally:
        shutil.rmtree(os.environ.pop(WATCH, ""), ignore_errors=True)
        for name, value in before.items():
            if value is not None:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)


def refuse_new_pythons():
    """Fails the phase of a test not marked slow that started a Python; each Python is told once."""
    folder, started = os.environ.get(WATCH), []
    for name in sorted(os.listdir(folder)) if folder else []:
        if not name.endswith(".tmp"):
            with open(os.path.join(folder, name)) as f:
                started.append(f.read())
            os.remove(os.path.join(folder, name))
    if started:
        raise AssertionError(f"this test started a new Python ({'; '.join(started)[:300]}): mark it "
                             "@pytest.mark.slow, or run the code in this process (docs/testing.md)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    refuse_new_pythons()
    return result


pytest_runtest_setup = pytest_runtest_teardown = pytest_runtest_call


@pytest.fixture
def new_pythons():
    """What each phase of a test not marked slow ends with (refuse_new_pythons), for tests/test_tiers.py,
    whose tests start Python to show that the rule sees it."""
    return refuse_new_pythons


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
