"""Let fairseq's checkpoints load under torch >= 2.6 without running code.

torch.load now defaults to weights_only=True, which refuses every class not on
an allowlist, and fairseq's loader passes no `weights_only`. Rather than turn
the check off (weights_only=False lets a checkpoint run arbitrary code), we
allowlist exactly the plain-data classes fairseq writes into checkpoints:
- argparse.Namespace: the options of models registered through argparse;
- numpy arrays, dtypes and scalars: metrics such as best BLEU in the
  checkpoint's training state;
- omegaconf containers and fairseq's tensor placeholder: what distributed
  training and resuming store.
Everything else is still refused (fairseq issues 5603, 5610), and named in
one line (refusal, which checkpoint_files.py raises), never with torch's advice to load with
weights_only=False, which would let the file run its code. fairseq's
tools allow them for the whole run (fairseq_fixes/patches.py: a --user-dir plugin is
imported before any checkpoint is read), this project's tools as they start;
the models' from_pretrained (the hub, in a program of one's own) for the
load alone.
"""

import argparse
import collections
import contextlib
import pickle
import re
import typing
from typing import Optional

import numpy as np
import torch


try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct, scalar
except ImportError:
    from numpy.core.multiarray import _reconstruct, scalar


def fairseq_checkpoint_globals():
    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    numpy_types = [np.ndarray, np.dtype, _reconstruct, scalar]
    numpy_types += [type(np.dtype(t)) for t in (np.int64, np.float64, np.float32)]
    return [
        argparse.Namespace,
        *numpy_types,
        DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, typing.Any,
        _TensorPlaceholder,
        collections.defaultdict, dict, list, int,
    ]


def allow_fairseq_checkpoints() -> None:
    torch.serialization.add_safe_globals(fairseq_checkpoint_globals())


@contextlib.contextmanager
def fairseq_checkpoints_allowed():
    """They are allowed in this block, and the allowlist is then as it was
    (torch's own safe_globals context would take them out even where they
    were allowed before)."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(fairseq_checkpoint_globals())
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def refusal(path, error: BaseException) -> Optional[str]:
    """The line naming a checkpoint that weights-only loading refused for a
    class outside the allowlist (a pickle that would run code, or make
    objects fairseq never stores); None for any other error."""
    refused = re.search(r"GLOBAL (\S+)", str(error)) if isinstance(error, pickle.UnpicklingError) else None
    if refused is None:
        return None
    return (f"{path} holds objects a fairseq checkpoint does not ({refused.group(1)}), so it was not loaded: "
            "loading it could run code it carries; use a checkpoint that fairseq-train wrote")
