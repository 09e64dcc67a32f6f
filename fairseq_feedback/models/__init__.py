from .feedback_decoder import FeedbackDecoder
from .feedback_lm import FeedbackLanguageModel
from .feedback_transformer import FeedbackTransformerModel

__all__ = ["FeedbackDecoder", "FeedbackLanguageModel", "FeedbackTransformerModel"]
