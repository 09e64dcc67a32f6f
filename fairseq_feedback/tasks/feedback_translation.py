"""fairseq's translation task, plus the adaptive-span loss of the feedback decoder.

Only needed for --adaptive-span with --adaptive-span-loss on a
feedback_transformer; everything else works with --task translation.
"""

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .adaptive_span_loss import AdaptiveSpanLossMixin


@register_task("feedback_translation", dataclass=TranslationConfig)
class FeedbackTranslationTask(AdaptiveSpanLossMixin, TranslationTask):
    pass
