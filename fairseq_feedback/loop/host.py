"""What the feedback decoder gives the loop's graphed runners, named once.

The runners (graphed_loop.py, graphed_decoding.py) run the decoder's loop at
bounded shapes as CUDA graphs. They hold no decoder: it is handed to each
call, and a graph's function holds it by a weak reference, so that nothing
of a graph leads back to the cache that owns it. They call only this.
"""

from typing import Dict, List, Optional, Protocol, Sequence, Tuple

from torch import Tensor, nn

from ..modules.key_value_buffer import KeyValueBuffer
from ..modules.memory_decoder_layer import MemoryDecoderLayer

Layers = Sequence[Optional[MemoryDecoderLayer]]  # None where LayerDrop left a layer out
IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class LoopHost(Protocol):
    span: int  # --memory-span: the most slots a step reads

    def run_eagerly(self, x: Tensor, previous: Tensor, span: int, layers: Layers, encoder_kv: Optional[Tensor],
                    encoder_bias: Optional[Tensor],
                    incremental_state: Optional[IncrementalState]) -> Tuple[Tensor, Tensor]:
        """The loop without graphs: the top layer's outputs and the memory vectors."""

    def start_memory(self, initial: Tensor, steps: int, span: int) -> Tuple[KeyValueBuffer, Tuple[Tensor, ...]]:
        """A buffer for a block of `steps` after the memory vectors `initial`, and step 0's window."""

    def feedback_loop(self, x: Tensor, buffer: KeyValueBuffer, window: Tuple[Tensor, ...], span: int,
                      layers: Layers, encoder_kv: Optional[Tensor],
                      encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """A block of steps: the top layer's outputs and the memory vectors."""

    def decoding_step(self, x: Tensor, window: Tuple[Tensor, ...], distance: Tensor, span: int, layers: Layers,
                      encoder_kv: Optional[Tensor], encoder_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """One step over a ring of slots: the top layer's output, and m_t's keys and values."""

    def empty_memory(self, rows: int, like: Tensor) -> Tensor:
        """The keys and values of m_{-1}, the zero memory vector."""

    def unfused_reason(self, layers: Layers, device_type: str,
                       buffer: Optional[KeyValueBuffer] = None) -> Optional[str]:
        """Why the loop runs through autograd, not fused (None: fused)."""

    def loop_modules(self, layers: Layers) -> List[nn.Module]:
        """The modules the loop runs."""

    def loop_parameters(self) -> List[nn.Parameter]:
        """Every parameter the loop reads."""

    def hypotheses_per_sentence(self, incremental_state: IncrementalState) -> int:
        """Rows that share one sentence's encoder keys/values (beam search's hypotheses), or 1."""

    def get_incremental_state(self, incremental_state: IncrementalState, key: str):
        """fairseq's incremental state of this module."""

    def set_incremental_state(self, incremental_state: IncrementalState, key: str, value) -> IncrementalState:
        """fairseq's incremental state of this module, set."""
