from .feedback_decoder import FeedbackDecoder
from .feedback_lm import FeedbackLanguageModel
from .feedback_transformer import FeedbackTransformerModel
from .transformer_xl_decoder import TransformerXLDecoder

__all__ = ["FeedbackDecoder", "FeedbackLanguageModel", "FeedbackTransformerModel", "TransformerXLDecoder"]
