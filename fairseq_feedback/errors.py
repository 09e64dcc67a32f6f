"""One-line errors for mistakes a user can fix, in every fairseq CLI.

fairseq's command-line tools let every exception escape with a traceback,
even for a mistyped option or a missing dictionary. Importing the plugin
(--user-dir) installs an exception hook that prints the failures listed here
as one line naming the fix; any other exception keeps its full traceback.
"""

import re
import sys


class FeedbackUsageError(ValueError):
    """Bad options or data: the message says what to change."""


def _one_line(exc: BaseException):
    if isinstance(exc, FeedbackUsageError):
        return str(exc)
    message = str(exc)
    if isinstance(exc, FileNotFoundError):
        if re.search(r"dict\.[^/]*txt$", str(exc.filename or "")):
            return (f"dictionary {exc.filename} not found: point the data directory at the --destdir "
                    "of fairseq-preprocess (which writes the dictionaries)")
        return f"{exc.filename or message} not found: check the path"
    if message.startswith("Size of sample"):  # fairseq's filter_by_size, for generate/interactive/validation
        return message.replace("\n", " ")
    if message.startswith("Must specify batch size"):
        return "set a batch size with --max-tokens or --batch-size"
    if message.startswith("Could not infer language pair"):
        return "no binarized data found: check the data directory, or pass --source-lang and --target-lang"
    return None


def install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_fairseq_feedback", False):
        return

    def hook(exc_type, exc, tb):
        line = _one_line(exc)
        if line is None:
            previous(exc_type, exc, tb)
        else:
            print(f"error: {line}", file=sys.stderr)

    hook._fairseq_feedback = True
    sys.excepthook = hook
