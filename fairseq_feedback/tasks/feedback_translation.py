"""fairseq's translation task, plus the adaptive-span loss of the feedback decoder.

Only needed for --adaptive-span with --adaptive-span-loss on a
feedback_transformer; everything else works with --task translation.
"""

from fairseq.models import MODEL_REGISTRY
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..errors import FeedbackUsageError
from .adaptive_span_loss import AdaptiveSpanLossMixin


@register_task("feedback_translation", dataclass=TranslationConfig)
class FeedbackTranslationTask(AdaptiveSpanLossMixin, TranslationTask):
    @classmethod
    def check_model(cls, model):
        """`model`, a class: the span loss is a feedback decoder's."""
        if not issubclass(model, MODEL_REGISTRY["feedback_transformer"]):
            raise FeedbackUsageError("--task feedback_translation adds the span loss of a feedback decoder: use "
                                     "--arch feedback_transformer (or feedback_transformer_*), or --task translation")
