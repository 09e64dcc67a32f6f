"""Checkpoints that never look complete when they are not.

fairseq writes a save's first checkpoint to a temporary name and renames it,
but copies it to the others (checkpoint_best.pt, checkpoint_last.pt) in place:
a Ctrl-C, a kill or a full disk during that copy leaves a truncated
checkpoint_last.pt, on which the next fairseq-train fails although complete
copies lie beside it. Here every write and copy goes to a temporary name in
the same folder and is renamed into place, and one the system refuses (a full
disk) is removed and named in one line; and a run whose checkpoint_last.pt is
missing, truncated (by a copy of an older fairseq, say) or older than a
complete checkpoint beside it says so and resumes from the newest complete
checkpoint, never from scratch. A checkpoint named on the command line
(--path, --restore-file) that is cut short is named in one line instead of
torch's traceback (check_complete), and so is one that weights-only loading
refuses (safe_checkpoints.refused_in_one_line): fairseq reads every checkpoint through
load_checkpoint_to_cpu, which patches.py wraps in loaded_in_one_line. What a
checkpoint was trained with (its options) is read without its tensors
(recorded_configuration), for trained_options.py to compare with a command line.

"Complete" means torch.save's zip archive has its central directory, which
is written last: a file cut short at any point lacks it. Nothing is
unpickled to find out, so checkpoints are still loaded only by fairseq,
with the allowlist of fairseq_feedback/safe_checkpoints.py.
"""

import contextlib
import copy
import functools
import logging
import os
import re
import shutil
import types
import zipfile
from argparse import Namespace

import torch
from fairseq.file_io import PathManager
from omegaconf import open_dict

from ..errors import PATH_FIXES, FeedbackUsageError, refused_write
from ..safe_checkpoints import fairseq_checkpoints_allowed, refused_in_one_line

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
    """fairseq's torch_persistent_save writes FILE.tmp and renames it into
    place, but when a write fails it tries torch.save twice more into the same
    open file, logs the traceback and leaves FILE.tmp behind; here it is
    written once, through written_whole."""

    @functools.wraps(torch_persistent_save)
    def save(obj, filename, async_write: bool = False):
        if async_write or not PathManager.supports_rename(filename):
            return torch_persistent_save(obj, filename, async_write)
        with written_whole(filename) as partial, open(partial, "wb") as f:
            torch.save(obj, f)

    return save


@contextlib.contextmanager
def written_whole(path: str):
    """A temporary name beside `path`, renamed to it when the block has
    written it; otherwise removed, and a write the system refused (a full
    disk, a file-size limit: torch.save hides the reason behind its own
    error) ends in one line: the next run resumes from the newest complete
    checkpoint."""
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


def is_complete(path: str) -> bool:
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def check_complete(path: str) -> None:
    """One line naming a checkpoint file torch.load would fail on with a
    traceback: cut short (or empty), or not a checkpoint at all. A missing
    file is left to the caller, and a file in torch's format from before
    1.6 (a pickle, not a zip) to torch."""
    if not os.path.isfile(path) or is_complete(path):
        return
    with open(path, "rb") as f:
        start = f.read(4)
    if start[:1] == b"\x80":  # pickle's first byte: torch's legacy format
        return
    if b"PK\x03\x04".startswith(start):  # a zip archive's first bytes, or none: cut short
        raise FeedbackUsageError(f"{path} is truncated (its save or copy was cut short) and cannot be loaded: "
                                 "use a complete checkpoint")
    raise FeedbackUsageError(f"{path} is not a checkpoint (not a file torch.save wrote): check the path")


def loaded_in_one_line(load_checkpoint_to_cpu):
    """fairseq's load_checkpoint_to_cpu, naming in one line a checkpoint it
    cannot load: cut short, not a checkpoint, or refused."""

    @functools.wraps(load_checkpoint_to_cpu)
    def load(path, *args, **kwargs):
        check_complete(path)
        with refused_in_one_line(path):
            return load_checkpoint_to_cpu(path, *args, **kwargs)

    return load


def recorded_configuration(path: str):
    """The options a complete checkpoint was trained with, as .model and
    .task (each a dict, or fairseq's argparse Namespace of every option), and
    the names of all it records (.names), read without loading its tensors;
    None for a checkpoint that records none."""
    check_complete(path)
    with refused_in_one_line(path), fairseq_checkpoints_allowed():
        # mmap: the tensors stay on disk; torch's format from before 1.6 cannot be mapped
        state = torch.load(path, map_location="cpu", mmap=is_complete(path), weights_only=True)
    if not isinstance(state, dict) or "model" not in state:  # fairseq's loaders fail on a KeyError
        raise FeedbackUsageError(f"{path} holds no model's parameters, so it is not a checkpoint that fairseq-train "
                                 "wrote: check the path")
    return configuration(state)


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
    """The names in a section of a configuration: a dict, or the Namespace of a model of fairseq's
    argparse kind (none in a value)."""
    if isinstance(section, Namespace):
        return set(vars(section))
    return set(section) if hasattr(section, "keys") else set()


def checkpoint_to_resume(save_dir: str, suffix: str = ""):
    """The checkpoint a run into `save_dir` resumes from: the complete one
    fairseq-train wrote last there, checkpoint_last.pt or another; None when
    it holds none of fairseq's checkpoints. A save cut short (a full disk, a
    kill) can leave checkpoint_last.pt missing, truncated or older than a
    complete copy beside it, and a run that started over would overwrite
    that work; one that holds checkpoints but none complete is refused.

    Newest by modification time rather than by update number: not every name
    carries the update number (checkpoint_best.pt, checkpointN.pt), and after a
    run restarted from an earlier checkpoint, files of the abandoned run can
    carry higher numbers than what the current run last wrote. Only fairseq's
    own names count, so that an averaged checkpoint is never trained on.
    """
    if not os.path.isdir(save_dir):
        return None
    names = re.compile(r"checkpoint(_last|_best|\d+|_\d+_\d+|\.best_.+)" + re.escape(suffix) + r"\.pt")
    paths = [os.path.join(save_dir, name) for name in os.listdir(save_dir) if names.fullmatch(name)]
    for path in sorted(paths, key=lambda p: (os.stat(p).st_mtime_ns, p), reverse=True):
        if is_complete(path):
            return path
    if paths:
        found = ", ".join(sorted(os.path.basename(path) for path in paths))
        raise FeedbackUsageError(f"{save_dir} holds checkpoints of an earlier run ({found[:200]}), none of them "
                                 "complete (their saves were cut short), to resume from: to start over, delete them "
                                 "or pass another --save-dir")
    return None


def resume_from_a_complete_checkpoint(load_checkpoint):
    """Wraps fairseq's checkpoint_utils.load_checkpoint (what fairseq-train
    resumes with): a run into a --save-dir resumes from its newest complete
    checkpoint (checkpoint_to_resume) where checkpoint_last.pt is missing,
    truncated or older, with a warning naming both and how to start over."""

    def load(cfg, trainer, **kwargs):
        suffix = trainer.checkpoint_suffix
        last = os.path.join(cfg.save_dir, f"checkpoint_last{suffix}.pt")
        resumed = checkpoint_to_resume(cfg.save_dir, suffix) if cfg.restore_file == "checkpoint_last.pt" else None
        if resumed is not None and resumed != last:
            why = ("is truncated (a save was cut short)" if os.path.exists(last) and not is_complete(last)
                   else "is older (a save was cut short)" if os.path.exists(last) else "is missing (a save was cut "
                                                                                      "short, or it was deleted)")
            logger.warning(f"{last} {why}: resuming from {resumed}, the newest complete checkpoint of this run; to "
                           "start over, pass another --save-dir")
            cfg = copy.deepcopy(cfg)
            with open_dict(cfg):
                # fairseq appends the suffix itself; with checkpoint_last.pt present,
                # it would have ignored --finetune-from-model as well
                cfg.restore_file = resumed[: -len(f"{suffix}.pt")] + ".pt"
                cfg.finetune_from_model = None
        return load_checkpoint(cfg, trainer, **kwargs)

    return load
