"""Feedback Transformer for fairseq: `--user-dir` plugin or `import fairseq_feedback`."""

from .errors import install_excepthook
from .safe_checkpoints import allow_fairseq_checkpoints

allow_fairseq_checkpoints()
install_excepthook()

from . import models, tasks  # noqa: E402,F401  (registers the models and the task)
