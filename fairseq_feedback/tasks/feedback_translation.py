"""fairseq's translation task, plus the adaptive-span loss of the feedback decoder.

Only needed for --adaptive-span with --adaptive-span-loss on a
feedback_transformer; everything else works with --task translation.
"""

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..models.feedback_transformer import FeedbackTransformerModel
from .adaptive_span_loss import AdaptiveSpanLossMixin


@register_task("feedback_translation", dataclass=TranslationConfig)
class FeedbackTranslationTask(AdaptiveSpanLossMixin, TranslationTask):
    takes_model = FeedbackTransformerModel
    wrong_model = ("--task feedback_translation adds the span loss of a feedback decoder: use --arch "
                   "feedback_transformer (or feedback_transformer_*), or --task translation")
