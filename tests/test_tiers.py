"""`make test` runs the tests that stay in pytest's processes; a test that starts Python anew pays
5-8 s of CPU for its imports, and is marked slow (`make test-slow`). tests/conftest.py holds every
test to that: one not marked slow that starts Python fails, however it starts it, so the fast tier
stays fast by rule. And the fast tier tests every part of the project: it imports each module, and
runs each console script in its own process (tests/everyday_reach.py reads it from the tests)."""

import multiprocessing
import os
import re
import shlex
import stat
import subprocess
import sys
import time

import pytest
from conftest import WATCH
from everyday_reach import Reach, console_scripts
from helpers import ENV

PYTHON = shlex.quote(sys.executable)


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def console_script(folder):
    """A script whose first line runs this Python, as pip writes a console script."""
    return executable(folder / "console-script", f"#!{sys.executable}\npass\n")


def shell_script(folder, command):
    return executable(folder / "script.sh", f"#!/bin/sh\n{command}\n")


# each way a test could start a new Python, and what the rule's refusal names of it: its command line
STARTS = {
    "this Python": (lambda tmp: subprocess.run([sys.executable, "-c", "pass"]), "-c pass"),
    "a console script": (lambda tmp: subprocess.run([console_script(tmp)]), "console-script"),
    "env python": (lambda tmp: subprocess.run(["env", f"PATH={os.path.dirname(sys.executable)}", "python", "-c",
                                               "pass"]), "python -c pass"),
    "Popen's executable=": (lambda tmp: subprocess.run(["not-python", "-c", "pass"], executable=sys.executable),
                            "not-python -c pass"),
    "an env= of its own": (lambda tmp: subprocess.run([sys.executable, "-c", "pass"], env=ENV), "-c pass"),
    "a shell": (lambda tmp: subprocess.run(f"{PYTHON} -c pass", shell=True), "-c pass"),
    "a shell script": (lambda tmp: subprocess.run([shell_script(tmp, f"{PYTHON} -c pass")]), "-c pass"),
    "os.system": (lambda tmp: os.system(f"{PYTHON} -c pass"), "-c pass"),
    "os.popen": (lambda tmp: os.popen(f"{PYTHON} -c pass").read(), "-c pass"),
    "multiprocessing's spawn": (lambda tmp: spawned(os.getpid), "spawn_main"),
    "inside a broad except": (lambda tmp: started_and_hidden([sys.executable, "-c", "raise SystemExit(3)"]),
                              "-c raise SystemExit(3)"),
}


def spawned(target):
    process = multiprocessing.get_context("spawn").Process(target=target)
    process.start()
    process.join()
    # the spawn start also started multiprocessing's resource tracker, a Python that may tell the watch
    # only after this test's call has ended, failing its teardown: the call waits for it
    from multiprocessing import resource_tracker
    told = os.path.join(os.environ[WATCH], str(resource_tracker._resource_tracker._pid))
    deadline = time.monotonic() + 10
    while not os.path.exists(told) and time.monotonic() < deadline:  # not there: it ran before this test
        time.sleep(0.01)


def started_and_hidden(command):
    try:
        subprocess.run(command, check=True)
    except Exception:  # an error raised where the Python starts would be lost here: the rule raises none there
        pass


@pytest.mark.parametrize("way", STARTS)
def test_a_test_not_marked_slow_cannot_start_python(tmp_path, new_pythons, way):
    """new_pythons, the check that ends each phase of a test not marked slow (its setup, its call, its
    teardown), refuses the Python the test started, naming its command line."""
    start, named = STARTS[way]
    start(tmp_path)
    with pytest.raises(AssertionError, match=r"^this test started a new Python \(.*" + re.escape(named)
                       + r".*\): mark it @pytest.mark.slow, or run the code in this process"):
        new_pythons()


def test_it_may_start_other_programs_and_fork(new_pythons):
    """A forked process (multiprocessing's start on Linux, a Pool's, a DataLoader's workers) pays no imports."""
    assert subprocess.run(["true"]).returncode == 0 and os.system("true") == 0
    process = multiprocessing.get_context("fork").Process(target=os.getpid)
    process.start()
    process.join()
    new_pythons()


@pytest.mark.slow
def test_a_test_marked_slow_may_start_python():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


PROBE = '''
import os
import subprocess
import sys

import pytest


@pytest.fixture
def starts_python_as_it_ends():
    yield
    os.system(f"{sys.executable} -c pass")


def test_started_in_its_call():
    try:
        subprocess.run([sys.executable, "-c", "raise SystemExit(3)"], check=True)
    except Exception:
        pass


def test_started_in_a_fixtures_teardown(starts_python_as_it_ends):
    pass


@pytest.mark.slow
def test_marked_slow():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


@pytest.mark.slow
def test_a_test_that_starts_python_fails_in_the_phase_that_started_it(tmp_path):
    """The rule as pytest applies it, to tests of a file of their own in a pytest of its own: a Python
    started in a test's call fails the test, whatever it caught; one started in a fixture's teardown,
    the teardown; a test marked slow passes."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-vv", "-rfEp",
                           "test_probe.py"], cwd=tmp_path, env=dict(ENV, PYTHONPATH=os.path.dirname(__file__)),
                          capture_output=True, text=True)
    summary = [line for line in proc.stdout.splitlines() if line.startswith(("PASSED", "FAILED", "ERROR"))]
    assert sorted(summary) == [
        "ERROR test_probe.py::test_started_in_a_fixtures_teardown - AssertionError: this test started a new Python "
        f"({sys.executable} -c pass): mark it @pytest.mark.slow, or run the code in this process (docs/testing.md)",
        "FAILED test_probe.py::test_started_in_its_call - AssertionError: this test started a new Python "
        f"({sys.executable} -c raise SystemExit(3)): mark it @pytest.mark.slow, or run the code in this process "
        "(docs/testing.md)",
        "PASSED test_probe.py::test_marked_slow",
        "PASSED test_probe.py::test_started_in_a_fixtures_teardown"], proc.stdout[-3000:]  # its call passed


# --- the everyday tier reaches every part of the project ----------------------------------------------


@pytest.fixture(scope="module")
def reach():
    return Reach()


def test_the_everyday_tier_imports_every_module_of_the_project(reach):
    """All but the __main__ modules, `python -m`'s way into a tool: importing one runs the tool, whose
    main the console scripts' rule holds."""
    assert sorted(module for module in reach.project
                  if module not in reach.modules and not module.endswith(".__main__")) == []


def test_the_everyday_tier_runs_every_console_script_in_its_own_process(reach):
    """The function setup.py's entry point names, called by a test (its main, or run_module's)."""
    assert [script for script, entry in console_scripts().items() if entry not in reach.functions] == []


USES = """
import pytest
from helpers import run_module

from fairseq_feedback_cli import sgm

{pytestmark}


{mark}
def test_it():
    {body}
"""


USED = "sgm.segments; run_module('fairseq_feedback_cli.score', '--help')"


@pytest.mark.parametrize("pytestmark, mark, body, reached", [
    ("", "", USED, True), ("", "@pytest.mark.slow", USED, False), ("pytestmark = pytest.mark.slow", "", USED, False),
    ("", "", "pass", False)], ids=["used", "marked slow", "in a module marked slow", "imported, not used"])
def test_what_only_a_slow_test_uses_or_nothing_uses_is_not_reached(tmp_path, pytestmark, mark, body, reached):
    (tmp_path / "test_uses.py").write_text(USES.format(pytestmark=pytestmark, mark=mark, body=body))
    reach = Reach(tmp_path)
    assert ("fairseq_feedback_cli.sgm" in reach.modules) == reached
    assert (("fairseq_feedback_cli.score", "main") in reach.functions) == reached
