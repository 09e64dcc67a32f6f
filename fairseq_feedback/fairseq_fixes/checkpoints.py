"""Checkpoints that never look complete when they are not ("complete": torch.save's zip archive has
its central directory, written last).

fairseq copied a save's checkpoint to checkpoint_last.pt in place: a kill or a full disk during the copy
left it truncated, and the next run failed beside complete copies. Here every write and copy goes to a
temporary name renamed into place, a write the system refuses is named in one line, and a run resumes
from the furthest complete checkpoint by what they record (checkpoint_to_resume), never from scratch.
A file that is no checkpoint is named in one line (checkpoint_files.py; patches.py wraps fairseq's
load_checkpoint_to_cpu in loaded_in_one_line). recorded_configuration reads a checkpoint's options
without its tensors, for trained_options.py.
"""

import collections
import contextlib
import copy
import dataclasses
import functools
import logging
import os
import re
import shutil
import types
from argparse import Namespace
from typing import Optional

import torch
from fairseq.file_io import PathManager
from omegaconf import open_dict

from .. import checkpoint_files
from ..errors import PATH_FIXES, FeedbackUsageError, refused_write

logger = logging.getLogger(__name__)


class AtomicCopyPathManager(PathManager):
    """fairseq's PathManager, whose copies appear whole or not at all."""

    @staticmethod
    def copy(src_path: str, dst_path: str, overwrite: bool = False):
        if not PathManager.supports_rename(dst_path):  # remote storage: no rename to make it atomic
            return PathManager.copy(src_path, dst_path, overwrite)
        with written_whole(dst_path) as partial:
            shutil.copyfile(src_path, partial)
        return dst_path


def saved_whole(torch_persistent_save):
    """fairseq's torch_persistent_save, on a failed write, tried twice more into the same open file and
    left FILE.tmp behind: here it is written once, through written_whole."""

    @functools.wraps(torch_persistent_save)
    def save(obj, filename, async_write: bool = False):
        if async_write or not PathManager.supports_rename(filename):
            return torch_persistent_save(obj, filename, async_write)
        with written_whole(filename) as partial, open(partial, "wb") as f:
            torch.save(obj, f)

    return save


@contextlib.contextmanager
def written_whole(path: str):
    """A temporary name beside `path`, renamed to it when the block has written it; otherwise removed,
    and a write the system refused (torch.save hides it behind its own error) ends in one line."""
    partial = path + ".tmp"
    try:
        yield partial
        os.replace(partial, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(partial)
        refused = refused_write(e)
        if refused is None:
            raise
        raise FeedbackUsageError(f"could not write {path}: {refused.strerror}: {PATH_FIXES[refused.errno]}; the "
                                 "same command then resumes from the newest complete checkpoint") from e


def loaded_in_one_line(load_checkpoint_to_cpu):
    """fairseq's load_checkpoint_to_cpu, naming in one line a file it cannot load as a checkpoint."""

    @functools.wraps(load_checkpoint_to_cpu)
    def load(path, *args, **kwargs):
        if os.path.exists(path):  # a folder too: named
            checkpoint_files.read(path)
        try:
            return load_checkpoint_to_cpu(path, *args, **kwargs)
        except Exception as e:
            checkpoint_files.check_loaded(path, e)
            raise

    return load


def recorded_configuration(path: str):
    """The options a checkpoint was trained with, as .model and .task (each a dict, or fairseq's argparse
    Namespace), and the names of all it records (.names), without its tensors; None if it records none."""
    return configuration(checkpoint_files.read(path))


def configuration(state: dict):
    """The options a loaded checkpoint records, as recorded_configuration's."""
    cfg = state.get("cfg") or {}
    args = state.get("args")  # checkpoints of fairseq before its dataclass configuration
    model, task = cfg.get("model", args), cfg.get("task", args)
    if model is None or task is None:
        return None
    names = frozenset(cfg).union(*map(_option_names, [args] if args is not None else cfg.values()))
    return types.SimpleNamespace(model=model, task=task, names=names)


def _option_names(section) -> set:
    """The names in a section of a configuration: a dict, or an argparse Namespace (none in a value)."""
    if isinstance(section, Namespace):
        return set(vars(section))
    return set(section) if hasattr(section, "keys") else set()


# the names fairseq-train gives the checkpoints of --save-dir: an averaged checkpoint (another name) is never trained on
CHECKPOINT_NAMES = r"checkpoint(_last|_best|\d+|_\d+_\d+|\.best_.+)"


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far training had gone at a save, as the checkpoint records it."""
    updates: int
    epoch: int
    iterations_in_epoch: int
    # the updates of the save that each run before it resumed from, then its own (fairseq's optimizer history:
    # a resumed run appends its saves to the history it loaded)
    lineage: tuple

    def continues(self, earlier: "Progress") -> bool:
        """Whether this save came at or after `earlier` in its run, or in a run resumed from it or from a later
        save of its run: not in a run abandoned for an earlier checkpoint, whatever updates it records."""
        i = len(earlier.lineage) - 1  # the run of `earlier`, after the saves it resumed from
        return (len(self.lineage) > i and self.lineage[:i] == earlier.lineage[:i]
                and self.lineage[i] >= earlier.lineage[i])


def progress(path: str) -> Progress:
    state = checkpoint_files.read(path)
    lineage = tuple(entry.get("num_updates", 0) for entry in state.get("optimizer_history") or [{}])
    iterator = (state.get("extra_state") or {}).get("train_iterator") or {}
    return Progress(lineage[-1], iterator.get("epoch", 0), iterator.get("iterations_in_epoch", 0), lineage)


Resumed = collections.namedtuple("Resumed", "path why")


def checkpoint_to_resume(save_dir: str, suffix: str = "") -> Optional[Resumed]:
    """The checkpoint a run into `save_dir` resumes from (.path), and why where it is not
    checkpoint_last.pt (.why); None when the folder holds none of fairseq's checkpoints. Chosen by what
    the complete checkpoints record, never by their files' times (a copy, a backup or a sync sets them):
    checkpoint_last.pt, unless a later save of the same run records more updates; where it is missing or
    truncated, the one of the most updates (then epoch, and position in it). A folder of checkpoints none
    complete is refused."""
    if not os.path.isdir(save_dir):
        return None
    names = re.compile(CHECKPOINT_NAMES + re.escape(suffix) + r"\.pt")
    paths = sorted(os.path.join(save_dir, name) for name in os.listdir(save_dir) if names.fullmatch(name))
    for path in paths:
        if not checkpoint_files.is_cut_short(path):
            checkpoint_files.check_file(path)  # no checkpoint at all, in a checkpoint's name: named
    complete = {path: progress(path) for path in paths if checkpoint_files.is_complete(path)}
    if not complete:
        if paths:
            found = ", ".join(os.path.basename(path) for path in paths)
            raise FeedbackUsageError(f"{save_dir} holds checkpoints of an earlier run ({found[:200]}), none of them "
                                     "complete (their saves were cut short), to resume from: to start over, delete "
                                     "them or pass another --save-dir")
        return None
    last = os.path.join(save_dir, f"checkpoint_last{suffix}.pt")
    if last in complete:
        complete = {path: saved for path, saved in complete.items() if saved.continues(complete[last])}

    def furthest(path):
        saved = complete[path]
        return saved.updates, saved.epoch, saved.iterations_in_epoch, path == last

    path = max(complete, key=furthest)
    if path == last:
        return Resumed(path, None)
    updates = complete[path].updates
    why = (f"records {complete[last].updates} updates, and {os.path.basename(path)}, a later save of the same run, "
           f"{updates} (a save was cut short)" if last in complete
           else "is truncated (a save was cut short)" if os.path.exists(last)
           else "is missing (a save was cut short, or it was deleted)")
    return Resumed(path, f"{last} {why}: resuming from {path} ({updates} updates), the furthest complete checkpoint "
                         "of this run; to start over, pass another --save-dir")


def resume_from_a_complete_checkpoint(load_checkpoint):
    """fairseq's load_checkpoint (fairseq-train's resume), from checkpoint_to_resume's choice, warning why
    where it is not checkpoint_last.pt."""

    def load(cfg, trainer, **kwargs):
        suffix = trainer.checkpoint_suffix
        resumed = checkpoint_to_resume(cfg.save_dir, suffix) if cfg.restore_file == "checkpoint_last.pt" else None
        if resumed is not None and resumed.why is not None:
            logger.warning(resumed.why)
            cfg = copy.deepcopy(cfg)
            with open_dict(cfg):
                # fairseq appends the suffix itself; with checkpoint_last.pt present,
                # it would have ignored --finetune-from-model as well
                cfg.restore_file = resumed.path[: -len(f"{suffix}.pt")] + ".pt"
                cfg.finetune_from_model = None
        return load_checkpoint(cfg, trainer, **kwargs)

    return load
