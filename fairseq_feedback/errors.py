"""One-line errors for mistakes a user can fix, in every fairseq CLI.

fairseq's command-line tools let every exception escape with a traceback,
even for a mistyped option or a missing dictionary. Importing the plugin
(--user-dir) installs an exception hook that prints the failures listed here
as one line naming the fix; any other exception keeps its full traceback.
The hook acts only in fairseq's command-line tools and this package's: a
program of one's own that imports the plugin keeps every traceback.
"""

import os
import re
import sys


class FeedbackUsageError(ValueError):
    """Bad options or data: the message says what to change."""


def one_line(exc: BaseException):
    """The line naming the fix for a mistake a user can make, or None for any other exception."""
    if isinstance(exc, FeedbackUsageError):
        return str(exc)
    message = str(exc)
    missing_split = re.fullmatch(r"Dataset not found: (\S+) \((.*)\)", message)  # fairseq's translation task
    if missing_split:
        split, data = missing_split.groups()
        return f"split '{split}' not found in {data}: binarize it there with fairseq-preprocess, or name another split"
    if message.startswith("Model file not found: "):  # fairseq's loader, for --path
        return f"checkpoint {message.split(': ', 1)[1]} not found: check --path"
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


def _running_a_tool() -> bool:
    """Whether this process is one of fairseq's command-line tools or this
    package's, started as `python -m fairseq_cli.train` (and the like) or as a
    console script (fairseq-train, feedback-score)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return spec.name.startswith(("fairseq_cli.", "fairseq_feedback_cli."))
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script.startswith(("fairseq-", "feedback-"))


def install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_fairseq_feedback", False):
        return

    def hook(exc_type, exc, tb):
        # decided here, not at import: `python -m` imports a tool's package
        # before it makes the tool __main__
        line = one_line(exc) if _running_a_tool() else None
        if line is None:
            previous(exc_type, exc, tb)
        else:
            print(f"error: {line}", file=sys.stderr)

    hook._fairseq_feedback = True
    sys.excepthook = hook
