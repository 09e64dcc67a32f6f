"""Why the loop cannot run as the fused block: the one door.

The fused block (fused_block.py) and the fused search step cover the
options that training and decoding use; for the others the decoder runs
the reference loop (reference.py) step by step through autograd: the same
numbers, more operators. FeedbackDecoder.unfused_reason asks here, for the
loop it builds (feedback_loop.py: its blocks and a search's steps, eager or
graphed).
"""

from typing import Optional, Sequence

import torch
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import nn

from ..modules.key_value_buffer import KeyValueBuffer
from .fused_layer import ACTIVATIONS


def unfused_reason(layers: Sequence, device_type: str, buffer: Optional[KeyValueBuffer] = None,
                   unfused_options: Sequence[str] = ()) -> Optional[str]:
    """Why these layers run through autograd rather than fused (None: fused).

    Args:
        layers: the decoder's layers, None where LayerDrop left one out.
        device_type: where they run ("cpu", "cuda").
        buffer: the memory's key/value slots, when the loop resumes a decoding cache.
        unfused_options: this plugin's options that are set and that the fused
            block does not run (their fields' metadata: models/feedback_config.py),
            as flags. fairseq's options are found here, from the layers.
    """
    if torch.is_grad_enabled() and buffer is not None and buffer.resumed:
        return "gradients through a decoding cache"
    if torch.is_autocast_enabled(device_type):
        return "autocast (--amp)"
    if unfused_options:
        return unfused_options[0]
    for layer in layers:
        if layer is None:
            continue
        if layer.activation_fn not in ACTIVATIONS:
            return "an activation other than relu and gelu"
        if any(has_forward_pre_hooks(m) or has_forward_hooks(m) for m in layer.modules()):
            return "hooks on a layer's modules (--quant-noise-pq)"
        if any(isinstance(m, FairseqDropout) and m.apply_during_inference for m in layer.modules()):
            return "--retain-dropout"
    return None


# torch keeps a module's hooks in private dicts (torch 2.x, to 2.13 here); fairseq's
# quant_noise (fairseq-fixed 0.12.3.1 / fairseq main early 2024) registers a forward pre-hook
def has_forward_pre_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks)


def has_forward_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks)
