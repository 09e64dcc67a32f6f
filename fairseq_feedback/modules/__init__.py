from .adaptive_span import AdaptiveSpanMask
from .feedback_attention import FeedbackAttention, MemoryView, attend
from .feedback_decoder_layer import FeedbackDecoderLayer
from .feedback_memory import FeedbackMemory
from .key_value_buffer import CachedKeyValues, KeyValueBuffer
from .transformer_xl_attention import TransformerXLAttention

__all__ = ["AdaptiveSpanMask", "CachedKeyValues", "FeedbackAttention", "FeedbackDecoderLayer", "FeedbackMemory",
           "KeyValueBuffer", "MemoryView", "TransformerXLAttention", "attend"]
