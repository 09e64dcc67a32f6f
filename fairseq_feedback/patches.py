"""fairseq's bugs and gaps that this plugin works around, each with the fairseq issue it answers.

They are applied when one of fairseq's command-line tools loads the plugin
(--user-dir); a program of one's own that imports it is left as it was
(this project's tools and tests, which run fairseq's code themselves, call
apply()).

- batch_by_size drops the last batch when it holds fewer sentences than
  --required-batch-size-multiple (8 by default): fairseq-generate leaves
  test sentences out of its score without a word, and training skips them
  (fairseq issues 5036, 5351). Batches stay as fairseq makes them; the
  sentences of the dropped batch come back as a last batch of their own.
- checkpoints are copied in place, so an interrupted save can leave a
  truncated checkpoint_last.pt that the next run cannot resume from
  (fairseq issue 2684): copies go through a temporary name, and a truncated
  checkpoint_last.pt is passed over for the newest complete checkpoint
  (checkpoints.py).
- torch >= 2.6 loads with weights_only=True and fairseq passes nothing, so
  its checkpoints do not load (fairseq issues 5603, 5610): exactly the
  classes fairseq stores are allowed (safe_checkpoints.py).
- fairseq-train creates --save-dir, and fairseq-generate --results-path,
  before anything is read (fairseq issue 1986): the command line is checked
  before the tool's main runs (command_line.py), a checkpoint file before
  torch reads it, and a split before numpy maps it (an empty one: fairseq
  issue 3903).
- every mistake ends in a traceback, even a missing file (fairseq issues
  974, 2831): the mistakes a user can fix print one line (errors.py).
"""

import atexit
import functools
import os
import sys
from argparse import Namespace

import numpy as np
from fairseq import checkpoint_utils
from fairseq.data import data_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils

from .checkpoints import AtomicCopyPathManager, check_complete, resume_from_a_complete_checkpoint
from .command_line import check_generate, check_not_empty, check_tool
from .errors import one_line
from .modules.cuda_graphs import log_statistics_of_every_cache
from .safe_checkpoints import allow_fairseq_checkpoints


def in_a_fairseq_tool() -> bool:
    """Whether this process is one of fairseq's command-line tools, started as
    `python -m fairseq_cli.train` (and the like) or as a console script
    (fairseq-train, also under torchrun). A --user-dir plugin is imported by
    the tool's main, once the tool is __main__."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return spec.name.startswith("fairseq_cli.")
    return os.path.basename(sys.argv[0] if sys.argv else "").startswith("fairseq-")


def apply_in_fairseq_tools() -> None:
    if in_a_fairseq_tool():
        apply()
        # the CUDA graphs' last statistics line: fairseq-train's last validation is followed by no call
        atexit.register(log_statistics_of_every_cache)


def apply() -> None:
    """Every fix; a fix already applied is left as it is."""
    allow_fairseq_checkpoints()
    _patch(data_utils, "batch_by_size", _keep_every_sentence)
    # save_checkpoint copies with the PathManager of its module: only checkpoints change
    checkpoint_utils.PathManager = AtomicCopyPathManager
    # fairseq-train resumes through load_checkpoint; no hook precedes it
    _patch(checkpoint_utils, "load_checkpoint", resume_from_a_complete_checkpoint)
    # each looked up in its module when called, by fairseq's tools and by fairseq itself
    _patch(distributed_utils, "call_main", lambda call_main: _checked_first(call_main, check_tool))
    _patch(checkpoint_utils, "load_checkpoint_to_cpu", lambda load: _checked_first(load, check_complete))
    _patch(data_utils, "load_indexed_dataset", lambda load: _checked_first(load, check_not_empty))
    # fairseq-generate calls its main itself, where it is __main__ (python -m) or imported (the console script)
    for module in (sys.modules.get("__main__"), sys.modules.get("fairseq_cli.generate")):
        if getattr(getattr(module, "__spec__", None), "name", None) == "fairseq_cli.generate":
            _patch(module, "main", _generate_checked_first)
    if not getattr(sys.excepthook, "prints_one_line", False):
        sys.excepthook = _one_line_for_fixable_mistakes(sys.excepthook)


def _patch(module, name: str, fix) -> None:
    """module.name = fix(module.name), unless already fixed."""
    function = getattr(module, name)
    if not getattr(function, "fixed", False):
        fixed = fix(function)
        fixed.fixed = True
        setattr(module, name, fixed)


def _keep_every_sentence(batch_by_size):
    @functools.wraps(batch_by_size)
    def batches_of_all(indices, *args, **kwargs):
        batches = batch_by_size(indices, *args, **kwargs)
        kept = sum(len(batch) for batch in batches)
        if kept < len(indices):  # batches are consecutive runs of `indices`: the tail is what was dropped
            batches = list(batches) + [np.asarray(indices[kept:], dtype=np.int64)]
        return batches

    return batches_of_all


def _checked_first(function, check):
    """`function`, calling check(its first argument) before it runs."""

    @functools.wraps(function)
    def checked(first, *args, **kwargs):
        check(first)
        return function(first, *args, **kwargs)

    return checked


def _generate_checked_first(main):
    """fairseq-generate's main, given its configuration once converted (it
    converts a Namespace itself) and checked."""

    @functools.wraps(main)
    def checked(cfg):
        if isinstance(cfg, Namespace):
            cfg = convert_namespace_to_omegaconf(cfg)
        check_generate(cfg)
        return main(cfg)

    return checked


def _one_line_for_fixable_mistakes(previous):
    def hook(exc_type, exc, tb):
        line = one_line(exc)
        if line is None:
            previous(exc_type, exc, tb)
        else:
            print(f"error: {line}", file=sys.stderr)

    hook.prints_one_line = True
    return hook
