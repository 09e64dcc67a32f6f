"""What a run of fairseq-train or fairseq-generate writes, kept whole however the run ends.

fairseq let two runs into one folder mix their checkpoints or results (exit status 0), wrote generate's
results in place (Ctrl-C replaced a complete result with part of one), found an unwritable folder after
the work, and a kill (SIGTERM) ended a run at once. Here: `held` makes the folder (or finds it), tries
a write, and holds it for the run alone by an flock the system releases however the process ends;
`results_moved_into_place` writes generate's results under a hidden name, renamed when complete;
`sigterm_as_ctrl_c_in_every_process` ends a kill as Ctrl-C (one_line.py's line); `LOG_FILE_HANDLERS`
writes a --log-file once per line, and a file the system stops taking is one warning.
"""

import contextlib
import copy
import fcntl
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Iterator

from omegaconf import open_dict

from ..errors import PATH_FIXES, FeedbackUsageError, refused_write


@contextlib.contextmanager
def held(folder: str, option: str) -> Iterator[None]:
    """`folder`, writable, for this process alone while the block runs."""
    try:
        os.makedirs(folder, exist_ok=True)
        handle, tried = tempfile.mkstemp(dir=folder, prefix=".write-test-")  # permissions alone do not tell
        os.close(handle)
        os.remove(tried)
        handle = os.open(folder, os.O_RDONLY)
    except FileExistsError:
        kind = "a link to nothing" if os.path.islink(folder) and not os.path.exists(folder) else "a file"
        raise FeedbackUsageError(f"{option} {folder} is {kind}, not a folder: pass a folder") from None
    except OSError as e:
        fix = PATH_FIXES.get(e.errno, "pass another folder")
        raise FeedbackUsageError(f"{option} {folder}: {e.strerror}: {fix}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FeedbackUsageError(f"{option} {folder} is in use by another run, which has not ended: wait for it, "
                                     f"or pass another {option}") from None
        yield
    finally:
        os.close(handle)  # and with it the lock


def is_rank_zero(cfg) -> bool:
    """Whether this process is the first of its job, which holds its folders: by the rank torchrun or SLURM
    set, else the command line's (0 for one process, and for the parent that spawns the others)."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    return int(rank if rank is not None else cfg.distributed_training.distributed_rank or 0) == 0


@contextlib.contextmanager
def results_moved_into_place(cfg) -> Iterator[object]:
    """fairseq-generate's configuration with --results-path a hidden folder in it, whose results file
    replaces the real one when the block completes."""
    folder = cfg.common_eval.results_path
    name = f"generate-{cfg.dataset.gen_subset}.txt"
    partial = os.path.join(folder, f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed run left (kill -9 too)
    os.makedirs(partial)
    staged = copy.deepcopy(cfg)
    with open_dict(staged):
        staged.common_eval.results_path = partial
    try:
        yield staged
        if os.path.exists(os.path.join(partial, name)):
            os.replace(os.path.join(partial, name), os.path.join(folder, name))
    except OSError as e:  # fairseq's print() to the results refused (a full disk): no file named, no fix
        if e.filename is not None or refused_write(e) is None:  # a path the system refused is named by it
            raise
        raise FeedbackUsageError(f"--results-path {folder}: could not write its results: {e.strerror}: "
                                 f"{PATH_FIXES[e.errno]}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def sigterm_as_ctrl_c_in_every_process() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (Python's handler of Ctrl-C) in the run and any
    process forked from it (torch's DataLoader workers end quietly on it; fairseq's ranks are spawned).
    A Pool's workers must die as killed instead: fairseq_feedback_cli's command_line.py."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _LogFileHandlers(logging.Filter):
    """On the loggers --log-file writes to, as a record passes: a second handler of a file goes (fairseq
    adds one at every epoch), and a write the system refuses is one warning, the handler then writing no
    more (Python's logging printed "--- Logging error ---" and a traceback per line, exit status 0)."""

    def __init__(self, *loggers):
        super().__init__()
        self.loggers, self.refused = loggers, set()  # the files warned of

    def filter(self, record) -> bool:
        for log in self.loggers:
            files = set()
            for handler in [handler for handler in log.handlers if isinstance(handler, logging.FileHandler)]:
                if handler.baseFilename in files:
                    log.removeHandler(handler)
                    handler.close()
                else:
                    files.add(handler.baseFilename)
                    handler.handleError = functools.partial(self._write_refused, handler)
        return True

    def _write_refused(self, handler, record) -> None:
        refused = refused_write(sys.exc_info()[1])
        if refused is None:  # not the system's refusal (a record that cannot be formatted): Python's traceback
            return logging.Handler.handleError(handler, record)
        handler.setLevel(logging.CRITICAL + 1)  # no more lines to refuse
        if handler.baseFilename not in self.refused:
            self.refused.add(handler.baseFilename)
            logging.getLogger(__name__).warning(f"--log-file {handler.baseFilename}: {refused.strerror}: "
                                                f"{PATH_FIXES[refused.errno]}; the run goes on, its log no longer "
                                                "written there")


# the progress bars' logger takes the name of what it logs ("train", "valid") as it logs it
LOG_FILE_HANDLERS = _LogFileHandlers(logging.getLogger("fairseq_cli.train"),
                                     logging.getLogger("fairseq.logging.progress_bar"))
