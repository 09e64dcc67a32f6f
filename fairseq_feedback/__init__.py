"""Feedback Transformer for fairseq: the `--user-dir` plugin.

Importing it registers its models and tasks, and lets fairseq's data classes
run on numpy 2. Loaded by one of fairseq's command-line tools, it also applies
its other fixes of fairseq (fairseq_fixes/); a program of one's own that
imports it is otherwise left as it was.
"""

from . import models, tasks  # noqa: F401  (registers the models and the tasks)
from .fairseq_fixes import apply_on_import

apply_on_import()
