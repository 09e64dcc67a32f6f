"""The mistakes a user can fix, and the one line that names the fix.

fairseq's tools let every exception escape with a traceback, even for a
missing file. This plugin raises FeedbackUsageError for the mistakes it
finds (bad options or data; the message says what to change), and
one_line() gives the line to print instead of a traceback: for those, and
for the few fairseq stops on itself with a message that names the fix. Any
other exception keeps its traceback. fairseq's tools print it through the
exception hook of patches.py; this project's tools through their main.
"""

import re


class FeedbackUsageError(ValueError):
    """Bad options or data: the message says what to change."""


def one_line(exc: BaseException):
    """The line naming the fix for a mistake a user can make, or None for any other exception."""
    if isinstance(exc, FeedbackUsageError):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        name = str(exc.filename or "")
        if name.endswith(".txt") and "dict." in name.rsplit("/", 1)[-1]:
            return (f"dictionary {name} not found: point the data directory at the --destdir "
                    "of fairseq-preprocess (which writes the dictionaries)")
        return f"{name} not found: check the path" if name else str(exc)
    if str(exc).startswith("Size of sample"):  # fairseq's filter_by_size: its message names the fix
        # numpy 2 writes its sizes as np.int64(1101)
        return re.sub(r"np\.\w+\(([^()]*)\)", r"\1", str(exc).replace("\n", " "))
    return None
