"""fairseq's bugs and gaps that this plugin works around, each with the fairseq issue it answers.

Applied when a fairseq tool loads the plugin (--user-dir); a program of one's own that imports it
(this project's tools and tests call apply()) gets only the first, which fairseq's data classes need
in any program:

- numpy 2 removed np.compat.long, which TokenBlockDataset (--sample-break-mode eos, fairseq-interactive
  on a language model) and LanguagePairDataset (--num-batch-buckets) call, and np.percentile's
  `interpolation` (the buckets, numpy 2.4) (fairseq issue 5639): those modules see numpy with both.
- --log-file adds a handler to the progress bars' log at every epoch, so each line reached the file once
  per epoch so far (fairseq commit da0432a3): a second handler of a file goes, and a file the system
  stops taking (a full disk) is one warning, not a traceback per line (runs.py).
- batch_by_size drops a last batch of fewer sentences than --required-batch-size-multiple (8): generate
  left them out of its score, training skipped them (fairseq issues 5036, 5351): they come back as a
  last batch of their own.
- checkpoints are copied in place, so an interrupted save could leave a truncated checkpoint_last.pt
  that no run resumes from (fairseq issue 2684): copies go through a temporary name, and a run resumes
  from the furthest complete checkpoint, by what they record (checkpoints.py).
- torch >= 2.6 loads with weights_only=True, and fairseq's checkpoints did not load (fairseq issues
  5603, 5610): exactly the classes fairseq stores are allowed (safe_checkpoints.py).
- fairseq-train creates --save-dir, and fairseq-generate --results-path, before anything is read
  (fairseq issue 1986): the command line is checked before the tool's main (command_line.py), a
  checkpoint file before torch reads it, a split before numpy maps it (empty: fairseq issue 3903; cut
  short); a folder the failed run created goes if it holds nothing (with fairseq's crash.pt).
- every mistake ended in a traceback, even a missing file (fairseq issues 974, 2831): fairseq's
  exceptions and the plugin's named mistakes print one line (one_line.py, origin.py), in a spawned
  rank too; a checkpoint that weights-only loading refuses is named without torch's advice to turn the
  check off (checkpoints.py); a failed generate's results file goes.
- fairseq-generate sharded its split by its ranks alone: on one device every --shard-id translated the
  whole split (no fairseq issue names it; fairseq-eval-lm shards by either): it shards by them.
- a prefetching thread (BackgroundConsumer) still making a batch at exit was stopped inside torch: "terminate
  called without an active exception", exit status 134, after a finished fairseq-train with CUDA graphs on
  an H100 (no fairseq issue names it): at exit each is stopped after its batch.
- hydra's deprecation warnings about how fairseq calls it (twenty lines before anything the tool
  prints) are silenced.
"""

import atexit
import contextlib
import copy
import functools
import os
import queue
import sys
import threading
import time
import types
import warnings
from argparse import Namespace

import numpy as np
from fairseq import checkpoint_utils
from fairseq.data import data_utils, iterators, language_pair_dataset, token_block_dataset
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from omegaconf import open_dict

from ..safe_checkpoints import allow_fairseq_checkpoints
from .binarized_files import check_binarized
from .checkpoints import AtomicCopyPathManager, loaded_in_one_line, resume_from_a_complete_checkpoint, saved_whole
from .command_line import check_generate, check_tool
from .one_line import fairseq_tool, one_line
from .runs import LOG_FILE_HANDLERS, held, is_rank_zero, results_moved_into_place, sigterm_as_ctrl_c_in_every_process


def tool_name(main) -> str:
    """The module in fairseq_cli of the tool whose `main` this is (train, eval_lm, ...)."""
    module = main.__module__
    if module == "__main__":
        module = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", "")
    return module.rsplit(".", 1)[-1]


def apply_on_import() -> None:
    """What importing the plugin does: the numpy 2 fix in any program, every fix in fairseq's tools."""
    give_fairseq_numpy_1_names()
    if fairseq_tool():  # a --user-dir plugin is imported by the tool's main, once the tool is __main__
        apply()


def apply() -> None:
    """Every fix; a fix already applied is left as it is."""
    give_fairseq_numpy_1_names()
    silence_hydra_deprecations()
    allow_fairseq_checkpoints()
    for log in LOG_FILE_HANDLERS.loggers:  # those --log-file writes to; once, however often applied
        log.addFilter(LOG_FILE_HANDLERS)
    _patch(data_utils, "batch_by_size", _keep_every_sentence)
    # save_checkpoint copies with the PathManager of its module: only checkpoints change
    checkpoint_utils.PathManager = AtomicCopyPathManager
    _patch(checkpoint_utils, "torch_persistent_save", saved_whole)
    # fairseq-train resumes through load_checkpoint; no hook precedes it
    _patch(checkpoint_utils, "load_checkpoint", resume_from_a_complete_checkpoint)
    # each looked up in its module when called, by fairseq's tools and by fairseq itself
    _patch(distributed_utils, "call_main", _tool_checked_first)
    _patch(checkpoint_utils, "load_checkpoint_to_cpu", loaded_in_one_line)
    _patch(data_utils, "load_indexed_dataset", lambda load: _checked_first(load, check_binarized))
    # fairseq-generate calls its main itself, where it is __main__ (python -m) or imported (the console script)
    for module in (sys.modules.get("__main__"), sys.modules.get("fairseq_cli.generate")):
        if getattr(getattr(module, "__spec__", None), "name", None) == "fairseq_cli.generate":
            _patch(module, "main", _generate_checked_first)
    if not getattr(sys.excepthook, "prints_one_line", False):
        sys.excepthook = _one_line_for_fixable_mistakes(sys.excepthook)
    atexit.unregister(stop_prefetching)  # once, however often applied
    atexit.register(stop_prefetching)


class _NumpyAsFairseqCallsIt(types.ModuleType):
    """numpy, with what fairseq calls and numpy 2 removed."""

    compat = types.SimpleNamespace(long=int)

    def __init__(self):
        super().__init__(np.__name__, np.__doc__)

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def percentile(a, q, *args, interpolation=None, **kwargs):
        if interpolation is not None:
            kwargs["method"] = interpolation
        return np.percentile(a, q, *args, **kwargs)


def give_fairseq_numpy_1_names() -> None:
    """numpy 2: the modules of fairseq that call what it removed see numpy with it."""
    if int(np.__version__.split(".")[0]) < 2:
        return
    for module in (token_block_dataset, language_pair_dataset, data_utils):
        if module.np is np:
            module.np = _NumpyAsFairseqCallsIt()


# the starts of the messages of hydra's deprecation warnings that fairseq's configuration raises
HYDRA_DEPRECATIONS = (
    r"hydra\.experimental\.\w+\(\) is no longer experimental",
    r"The version_base parameter is not specified",
    r"In '\w+': Usage of deprecated keyword in package header",
    r"'\w+' is validated against ConfigStore schema",
    r"The strict flag in the compose API is deprecated",
)


def silence_hydra_deprecations() -> None:
    """Also for this project's tools, which build fairseq's configurations themselves."""
    for message in HYDRA_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=r"\s*" + message, category=UserWarning)


def stop_prefetching(timeout: float = 60.0) -> None:
    """At exit, before CPython stops daemon threads wherever they are: each of fairseq's prefetching
    threads stopped after its batch, and joined (within `timeout` seconds in all)."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if isinstance(thread, iterators.BackgroundConsumer):
            thread._max_len = 0  # its loop ends after its next put
            while thread.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    thread._queue.get_nowait()  # room for that put, and for the end marker that follows it
                thread.join(0.01)


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


def _tool_checked_first(call_main):
    """distributed_utils.call_main(cfg, main), through which fairseq's tools run their main: the command
    line checked first; fairseq-train's --save-dir held (runs.py), and removed if the run created it and
    failed, with the crash.pt fairseq saves on a failed update, unless it holds checkpoints."""

    @functools.wraps(call_main)
    def checked(cfg, main, **kwargs):
        tool = tool_name(main)
        check_tool(cfg, tool)
        save_dir = cfg.checkpoint.save_dir
        holds = tool in ("train", "hydra_train") and not cfg.checkpoint.no_save and is_rank_zero(cfg)
        with sigterm_as_ctrl_c_in_every_process(), \
                _nothing_half_written(save_dir, leftovers=[os.path.join(save_dir, "crash.pt")]), \
                held(save_dir, "--save-dir") if holds else contextlib.nullcontext():
            return call_main(cfg, main, **kwargs)

    return checked


def _generate_checked_first(main):
    """fairseq-generate's main, given its configuration converted and checked; its --results-path held,
    its results moved into place when complete (runs.py), the folder removed if the run made it and failed."""

    @functools.wraps(main)
    def checked(cfg):
        if isinstance(cfg, Namespace):
            cfg = convert_namespace_to_omegaconf(cfg)
        check_generate(cfg)
        cfg = sharded_as_asked(cfg)
        folder = cfg.common_eval.results_path
        if folder is None:
            with sigterm_as_ctrl_c_in_every_process():
                return main(cfg)
        with sigterm_as_ctrl_c_in_every_process(), _nothing_half_written(folder), held(folder, "--results-path"), \
                results_moved_into_place(cfg) as staged:
            return main(staged)

    return checked


def sharded_as_asked(cfg):
    """fairseq-generate's configuration, its ranks (which its main reads, and starts none of) set to
    --num-shards and --shard-id: it shards by its ranks alone."""
    dataset, distributed = cfg.dataset, cfg.distributed_training
    if dataset.num_shards == 1 or distributed.distributed_world_size > 1:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.distributed_training.distributed_world_size = dataset.num_shards
        cfg.distributed_training.distributed_rank = dataset.shard_id
    return cfg


@contextlib.contextmanager
def _nothing_half_written(folder, leftovers=()):
    """A folder that the block creates is removed if the block fails, with the `leftovers` written
    there, if that leaves it empty."""
    created = folder is not None and not os.path.exists(folder)
    try:
        yield
    except BaseException:
        if created and os.path.isdir(folder):
            for path in leftovers:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            with contextlib.suppress(OSError):  # not empty: what it holds was worth keeping
                os.rmdir(folder)
        raise


def _one_line_for_fixable_mistakes(previous):
    def hook(exc_type, exc, tb):
        line = one_line(exc)
        if line is None:
            previous(exc_type, exc, tb)
        else:
            print(f"error: {line}", file=sys.stderr)

    hook.prints_one_line = True
    return hook
