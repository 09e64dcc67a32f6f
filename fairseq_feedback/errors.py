"""The mistakes a user can fix: raised as FeedbackUsageError, whose message
says what to change. fairseq's tools print it as one line instead of a
traceback (fairseq_fixes/one_line.py); this project's tools through their
main."""


class FeedbackUsageError(ValueError):
    """Bad options or data: the message says what to change."""
