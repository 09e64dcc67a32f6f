import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from fairseq_feedback import patches  # noqa: E402
from fairseq_feedback_cli import builders  # noqa: E402
from fairseq_feedback_cli.builders import size_flags  # noqa: E402

PLUGIN = os.path.join(REPO, "fairseq_feedback")
patches.apply()  # the tests run fairseq's code as its tools do, with the plugin's fixes
TINY = dict(embed_dim=16, ffn_dim=32, heads=2)


def make_dictionary(size=24):
    return builders.make_dictionary(size)


def tiny_translation_model(*flags, arch="feedback_transformer", dictionary=None, seed=0, layers=3):
    """A small model (a 2-layer encoder, a `layers`-layer decoder) built through
    fairseq's option parsing, as the CLIs build it."""
    dictionary = dictionary or make_dictionary()
    sizes = size_flags("encoder", layers=2, **TINY) + size_flags("decoder", layers=layers, **TINY)
    return builders.translation_model(arch, [*sizes, *flags], dictionary, seed=seed), dictionary


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one); on a GPU machine: -m gpu")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def tiny_lm(*flags, dictionary=None, labels=None, seed=0, layers=3):
    """A small feedback_lm of `layers` layers and its task, built through fairseq's config system."""
    flags = [*size_flags("decoder", layers=layers, **TINY), "--dropout", "0", *flags]
    return builders.language_model("feedback_lm", "feedback_language_modeling", flags,
                                   dictionary or make_dictionary(), output_dictionary=labels, seed=seed)
