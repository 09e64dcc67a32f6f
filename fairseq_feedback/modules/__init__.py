from .adaptive_span import AdaptiveSpanMask
from .feedback_attention import FeedbackAttention, MemoryView, attend
from .feedback_decoder_layer import FeedbackDecoderLayer
from .feedback_memory import FeedbackMemory
from .key_value_buffer import KeyValueBuffer

__all__ = ["AdaptiveSpanMask", "FeedbackAttention", "FeedbackDecoderLayer", "FeedbackMemory", "KeyValueBuffer",
           "MemoryView", "attend"]
