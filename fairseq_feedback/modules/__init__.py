from .adaptive_span import AdaptiveSpanMask
from .feedback_attention import FeedbackAttention, attend
from .feedback_memory import FeedbackMemory
from .key_value_buffer import CachedKeyValues, KeyValueBuffer
from .memory_decoder_layer import MemoryDecoderLayer
from .memory_view import MemoryView, SlotDistances
from .transformer_xl_attention import TransformerXLAttention

__all__ = ["AdaptiveSpanMask", "CachedKeyValues", "FeedbackAttention", "FeedbackMemory", "KeyValueBuffer",
           "MemoryDecoderLayer", "MemoryView", "SlotDistances", "TransformerXLAttention", "attend"]
