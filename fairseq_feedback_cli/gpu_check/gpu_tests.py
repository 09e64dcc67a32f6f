"""Step 1: the GPU tests, in one process (python -m pytest -q -m gpu tests), when the check runs
from a checkout; elsewhere it says that the tests are not there."""

import importlib.util
import os
import re
from typing import Dict, Optional

from .check import NOT_RUN, REPO, Check, Command, Outcome, StepFailed, read


def checkout_tests() -> Optional[str]:
    """The tests folder of the checkout this copy runs from; None for an installed copy, which has none."""
    tests = os.path.join(REPO, "tests")
    return tests if os.path.isfile(os.path.join(tests, "conftest.py")) else None


def pytest_counts(log: str) -> Dict[str, int]:
    """pytest's summary line, by outcome: {"passed": 17, "skipped": 3, ...}."""
    summary = [line for line in log.splitlines()
               if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)]
    if not summary:
        return {}
    return {outcome: int(n) for n, outcome in re.findall(r"(\d+) ([a-z]+)", summary[-1])}


def gpu_tests(check: Check) -> Outcome:
    tests = checkout_tests()
    if tests is None:
        return Outcome("the tests are not there: this copy of fairseq-feedback was installed without them "
                       "(run the check from a checkout, installed with pip install -e '.[test]', to include them)",
                       status=NOT_RUN)
    if importlib.util.find_spec("pytest") is None:
        return Outcome("pytest is not installed: pip install -e '.[test]' in the checkout", status=NOT_RUN)
    command = Command("pytest", ["-q", "-m", "gpu", "-rfEs", "-p", "no:cacheprovider", os.path.basename(tests)],
                      "gpu-tests.log", cwd=os.path.dirname(tests))
    code, = check.run(command, check=False)
    log = read(check.path("logs", command.log))
    counts = pytest_counts(log)
    said = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    # "FAILED tests/x.py::test[an id with spaces] - the error": the test's id whole
    failed = [line.split(" ", 1)[1].split(" - ", 1)[0] for line in log.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    outcome = Outcome(said, {"pytest exit status": code, **counts, "failed": failed},
                      [f"On {check.machine['device']}: {said}.", "", *[f"- failed: `{test}`" for test in failed]])
    if code != 0 or not counts.get("passed", 0) + counts.get("skipped", 0):
        raise StepFailed(f"pytest exit {code}: {said or 'no summary'}" + (f"; failed: {', '.join(failed)}" if failed
                                                                          else ""), outcome)
    if check.on_cpu:
        outcome.summary += " (the GPU tests skip without a CUDA device)"
    elif counts.get("skipped"):
        outcome.summary += f" (why each skipped: logs/{command.log})"
    return outcome
