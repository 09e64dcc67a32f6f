"""Feedback Transformer for fairseq: `--user-dir` plugin or `import fairseq_feedback`."""

from .safe_checkpoints import allow_fairseq_checkpoints

allow_fairseq_checkpoints()

from . import models  # noqa: E402  (registers the models)
