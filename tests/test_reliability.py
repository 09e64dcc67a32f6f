"""The one-line errors of the plugin stay inside the command-line tools."""

import os
import subprocess
import sys

import pytest
from cli import ENV, PLUGIN, error_lines

# ------------------------------------------------------------ one-line errors


USER_SCRIPT = """
import fairseq_feedback

open("my-own-missing-file.txt")
"""


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_users_program_importing_the_plugin_keeps_its_traceback(tmp_path, how):
    (tmp_path / "mine.py").write_text(USER_SCRIPT)
    command = ["mine.py"] if how == "script" else ["-m", "mine"]
    proc = subprocess.run([sys.executable, *command], cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and 'open("my-own-missing-file.txt")' in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("FileNotFoundError: [Errno 2] No such file or directory")


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_fairseq_tools_still_print_the_plugins_errors_as_one_line(tmp_path, how):
    command = ([os.path.join(os.path.dirname(sys.executable), "fairseq-train")] if how == "console script"
               else [sys.executable, "-m", "fairseq_cli.train"])
    proc = subprocess.run([*command, tmp_path, "--user-dir", PLUGIN, "--arch", "feedback_transformer",
                           "--memory-span", "0"], env=ENV, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc) == ["error: --memory-span must be at least 1, got 0"]
