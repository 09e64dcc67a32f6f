"""Feedback Transformer for fairseq: `--user-dir` plugin or `import fairseq_feedback`."""

from .errors import install_excepthook
from .fairseq_fixes import apply_fairseq_fixes
from .safe_checkpoints import allow_fairseq_checkpoints

allow_fairseq_checkpoints()
install_excepthook()
apply_fairseq_fixes()

from . import models, tasks  # noqa: E402,F401  (registers the models and the task)
