"""The Errors section of docs/reliability.md, against what the tools really print."""

import argparse
import os
import re
import subprocess
import sys

import torch

from helpers import REPO


def errors_section():
    text = open(os.path.join(REPO, "docs", "reliability.md")).read()
    return re.search(r"^## Errors\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S).group(1)


def test_the_weights_only_refusal_without_the_plugin_is_explained(tmp_path):
    """fairseq's loader without --user-dir: torch refuses the checkpoint with the message the page quotes."""
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
