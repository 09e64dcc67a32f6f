from .feedback_attention import FeedbackAttention, attend_one_step
from .feedback_decoder_layer import FeedbackDecoderLayer
from .feedback_memory import FeedbackMemory
from .key_value_buffer import KeyValueBuffer

__all__ = ["FeedbackAttention", "FeedbackDecoderLayer", "FeedbackMemory", "KeyValueBuffer", "attend_one_step"]
