from .feedback_decoder import FeedbackDecoder
from .feedback_transformer import FeedbackTransformerModel

__all__ = ["FeedbackDecoder", "FeedbackTransformerModel"]
