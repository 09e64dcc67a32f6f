"""The feedback loop (section 3.3): the model's per-token recurrence, run two ways.

    FeedbackDecoder.feedback_loop (models/feedback_decoder.py), once per block
        |
        +-- fallback.py      unfused_reason: why an option needs the reference loop (the one door,
        |                    also for a search's step and the CUDA graphs)
        |
        +-- reference.py     ReferenceLoop: step by step through autograd, fairseq's modules as they
        |                    are (reference_step; memory_views); covers every option
        |
        +-- fused_block.py   FusedFeedbackLoop: a block as one autograd Function (BlockFunction), its
              |              backward by hand, weight gradients once per block; fused_step, a
              |              search's step without gradients
              |
              +-- fused_layer.py   FusedLayer: a MemoryDecoderLayer at each step, its sublayers'
                    |              residuals with dropout, pre- or post-norm
                    |
                    +-- operators.py   the per-step pieces and their backwards, each equation
                                       beside its code: Linear, Norm, Attention, the residual
                                       with dropout, MemoryWindows (relative positions),
                                       Mixing (eq. 1); StepRecords, what a piece keeps

Both loops compute the same outputs and gradients (tests/test_fused_loop.py;
each piece against autograd: tests/test_loop_pieces.py). Nothing here holds
the decoder: a loop gets the decoder's FeedbackMemory, its layers and what
they read.
"""
