"""The mistakes a user can fix: raised as FeedbackUsageError, whose message
says what to change. fairseq's tools print it as one line instead of a
traceback (fairseq_fixes/one_line.py); this project's tools through their
main."""

import errno
from typing import Optional


class FeedbackUsageError(ValueError):
    """Bad options or data: the message says what to change."""


# What to do when the system refuses a path, by errno: the one line's fix
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


# The system refusing to store what is written, whatever the path: never this project's defect
WRITE_REFUSALS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


def refused_write(exc: BaseException, errnos=WRITE_REFUSALS) -> Optional[OSError]:
    """The system's refusal (an OSError of one of `errnos`) behind `exc`, or
    None: torch.save hides it behind its own error, as the cause or context
    of what it raises."""
    return next((cause for cause in (exc, exc.__cause__, exc.__context__)
                 if isinstance(cause, OSError) and cause.errno in errnos), None)
