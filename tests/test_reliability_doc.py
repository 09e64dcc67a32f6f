"""docs/reliability.md: its Errors section against what the tools really print, and its table of
mistakes against the tests it names."""

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch
from bad_values_cases import CASES
from helpers import REPO

PAGE = os.path.join(REPO, "docs", "reliability.md")


def section(title):
    text = open(PAGE).read()
    return re.search(rf"^## {title}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S).group(1)


def errors_section():
    return section("Errors")


@pytest.mark.slow
def test_the_weights_only_refusal_without_the_plugin_is_explained(tmp_path):
    """fairseq's loader without --user-dir: torch refuses the checkpoint with the message the README quotes."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"args": argparse.Namespace(arch="feedback_transformer"), "model": {}}, path)
    proc = subprocess.run([sys.executable, "-c", "import sys; from fairseq import checkpoint_utils; "
                           "checkpoint_utils.load_checkpoint_to_cpu(sys.argv[1])", str(path)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode != 0
    section, printed = " ".join(errors_section().split()), " ".join(proc.stderr.split())
    quote = re.search(r"`(\S*UnpicklingError[^`]*)`", section).group(1)
    for piece in quote.split(" ... "):
        assert piece in printed, piece
    assert "Add `--user-dir fairseq_feedback`" in section
    assert "Do not follow torch's suggestion" in section and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in section


def test_the_table_of_mistakes_names_tests_that_exist():
    """Each `file::test` of the table's last column is a test of that file, and each `file[case]` (or a
    `[case]` after it) a case of test_bad_values.py's sweep (bad_values_cases.py); `::test` and `[case]` go on
    with the file before."""
    rows = [line for line in section("What each mistake shows").splitlines() if line.startswith("| ")][2:]
    assert len(rows) > 20
    for row in rows:
        checked_by = row.rstrip(" |").rsplit(" | ", 1)[1]
        current = None
        for name in re.findall(r"`([^`]+)`", checked_by):
            file, test, case = re.fullmatch(r"(test_\w+\.py)?(?:::(\w+))?(?:\[(.+)\])?", name).groups()
            current = file or current
            assert current is not None, row
            if test is not None:
                assert re.search(rf"^def {test}\(", open(os.path.join(REPO, "tests", current)).read(), re.M), name
            if case is not None:
                assert current == "test_bad_values.py" and case in CASES, name
