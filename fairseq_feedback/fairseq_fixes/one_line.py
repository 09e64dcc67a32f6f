"""The one line that names the fix of a mistake a user can make.

fairseq's tools let every exception escape with a traceback, even for a
missing file. This plugin raises FeedbackUsageError for the mistakes it
finds (bad options or data; the message says what to change), and
one_line() gives the line to print instead of a traceback: for those, and
for the few fairseq stops on itself with a message that names the fix or
that one line can complete (a path that cannot be read or written; a
checkpoint whose parameters do not fit the model). Any other exception
keeps its traceback. fairseq's tools print it through the exception hook of
patches.py; this project's tools through their main.
"""

import errno
import re

from ..errors import FeedbackUsageError

# what to do about a path the system refused, by the reason it gave
PATH_FIXES = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of it is a file, not a folder: check the path",
    errno.EISDIR: "it is a folder: name a file",
    errno.EACCES: "pass a path you may use (or change its permissions)",
    errno.EPERM: "pass a path you may use (or change its permissions)",
    errno.EROFS: "pass a path on a writable disk",
    errno.ENOSPC: "free some space, or pass a path on another disk",
    errno.EDQUOT: "free some space, or pass a path on another disk",
    errno.EFBIG: "it would outgrow the largest file this shell lets a process write (ulimit -f): raise the limit",
}


def one_line(exc: BaseException):
    """The line naming the fix for a mistake a user can make, or None for any other exception."""
    if isinstance(exc, FeedbackUsageError):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or a kill (runs.py)
        return ("interrupted: what the run had finished is kept, and nothing it left looks finished "
                "(fairseq-train resumes from its newest complete checkpoint when run again)")
    if isinstance(exc, OSError) and exc.filename and exc.errno in PATH_FIXES:
        return _path_refused(exc)
    if isinstance(exc, FileNotFoundError):
        return str(exc)
    if str(exc).startswith("Size of sample"):  # fairseq's filter_by_size: its message names the fix
        # numpy 2 writes its sizes as np.int64(1101)
        return re.sub(r"np\.\w+\(([^()]*)\)", r"\1", str(exc).replace("\n", " "))
    unfit = re.match(r"Cannot load model parameters from checkpoint (.*); please ensure", str(exc))
    if unfit and exc.__context__ is not None:  # fairseq's trainer, hiding the reason in the exception it replaced
        lines = [line.strip() for line in str(exc.__context__).splitlines() if line.strip()]
        reason = next((line for line in lines if "mismatch" in line or "key(s)" in line), lines[0] if lines else "")
        return (f"the parameters of {unfit.group(1)} do not fit this model ({reason[:200]}): continue it with the "
                "options and the data (dictionaries) it was trained with")
    return None


def _path_refused(exc: OSError) -> str:
    name = str(exc.filename)
    if isinstance(exc, FileNotFoundError):
        if name.endswith(".txt") and "dict." in name.rsplit("/", 1)[-1]:
            return (f"dictionary {name} not found: point the data directory at the --destdir "
                    "of fairseq-preprocess (which writes the dictionaries)")
        return f"{name} not found: check the path"
    return f"{name}: {exc.strerror}: {PATH_FIXES[exc.errno]}"
