"""What every command of this project shares: a mistake the user can fix ends in one line.

`fail(message)` stops a command with `error: MESSAGE` on stderr and exit status 1, no
traceback; the parser's own errors (a missing or mistyped option) end the same way, without
argparse's usage dump; `check_at_least` names a count given below the values it can take;
`quiet` leaves a tool's result as the one thing it prints; `command` makes a kill end a command
as Ctrl-C does (`sigterm_as_ctrl_c_in_this_process`; fairseq's tools get the plugin's
`sigterm_as_ctrl_c_in_every_process`), and a write that the system refuses midway end in one line.
"""

import argparse
import contextlib
import functools
import os
import signal
from typing import Callable, Iterator, NoReturn


def fail(message: str) -> NoReturn:
    raise SystemExit(f"error: {message}")


def command(main: Callable, interrupted: str = "nothing it was writing was left; rerun the same command") -> Callable:
    """Every command's main: a write the system refuses midway (a full disk,
    a file-size limit, a read-only disk) ends it in one line naming the file
    and the fix, as a mistake does, wherever the write was, and so do Ctrl-C,
    a kill and a mistake named by the code it calls (FeedbackUsageError);
    what the command was writing went on the way out (outputs.py: complete
    or not at all)."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            with sigterm_as_ctrl_c_in_this_process():
                return main(*args, **kwargs)
        except KeyboardInterrupt:
            fail(f"interrupted; {interrupted}")
        except Exception as e:
            # on failure alone: it imports torch
            from fairseq_feedback.errors import PATH_FIXES, FeedbackUsageError, refused_write

            if isinstance(e, FeedbackUsageError):  # a mistake the code it calls names (a file that is no checkpoint)
                fail(str(e))
            refused = refused_write(e)
            if refused is None:
                raise
            fail(f"could not write {refused.filename or 'an output'}: {refused.strerror}: {PATH_FIXES[refused.errno]}")

    return run


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


def check_at_least(args: argparse.Namespace, **lowest: int) -> None:
    """Each option named (as its attribute) is absent, unset or at least its lowest value."""
    for name, low in lowest.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            fail(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def quiet() -> None:
    """Only warnings and errors from fairseq's loggers and Python's warnings: the result is one line."""
    import logging
    import warnings

    logging.getLogger().setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")


@contextlib.contextmanager
def sigterm_as_ctrl_c_in_this_process() -> Iterator[None]:
    """Within the block, SIGTERM (kill, a job scheduler's stop) raises
    KeyboardInterrupt in the command's own process, as Ctrl-C does, and a
    worker forked from it dies as killed: the processes the command started are
    stopped (subprocess.run kills its child on any exception, a Pool its
    workers), its partial outputs removed, and it ends with its one line; by
    default Python would die at once and leave them running. Every command
    of this project runs within it (`command`). (fairseq's tools with the
    plugin hand SIGTERM to Python's own Ctrl-C handler in every process, as
    they fork no workers but torch's, which end quietly on KeyboardInterrupt:
    fairseq_feedback/fairseq_fixes/runs.py's sigterm_as_ctrl_c_in_every_process.)"""
    owner = os.getpid()

    def interrupt(signum, frame):
        if os.getpid() != owner:  # a worker forked from the command (a Pool's, which terminate() ends so)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
