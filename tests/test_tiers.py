"""`make test` runs the tests that stay in pytest's processes; a test that starts Python anew pays
5-8 s of CPU for its imports, and is marked slow (`make test-slow`). tests/conftest.py holds every
test to that: one not marked slow that starts Python fails, so the fast tier stays fast by rule."""

import os
import shutil
import subprocess
import sys

import pytest


def test_a_test_not_marked_slow_cannot_start_python():
    with pytest.raises(AssertionError, match="starts a new Python .*: mark it @pytest.mark.slow"):
        subprocess.run([sys.executable, "-c", "pass"])


def test_nor_a_console_script_that_runs_python():
    script = shutil.which("fairseq-train", path=os.path.dirname(sys.executable))
    assert script, "fairseq-train is not installed beside this Python"
    with pytest.raises(AssertionError, match="starts a new Python"):
        subprocess.run([script, "--help"], capture_output=True)


def test_it_may_start_other_programs():
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.slow
def test_a_test_marked_slow_may_start_python():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
