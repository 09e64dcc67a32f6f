"""The feedback loop (section 3.3): the model's per-token recurrence, run two
ways, eagerly or replayed as CUDA graphs.

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

    FeedbackDecoder.decode, with --cuda-graphs (the graphs themselves: fairseq_feedback/cuda_graphs)
        |
        +-- graphed_loop.py          GraphedFeedbackLoop: a block at bucketed shapes, one graph per
        |     |                      bucket; block_weight_gradients.py, the reference loop's linear
        |     |                      layers' weight gradients once per block, in graphs
        |     |
        |     +-- graphed_decoding.py  a search's step per token over static_memory.py, a ring of
        |                              fixed shape masked by distance
        |
        +-- host.py          LoopHost: what the decoder gives these runners, named once

Both loops compute the same outputs and gradients (tests/test_fused_loop.py;
each piece against autograd: tests/test_loop_pieces.py). Nothing here holds
the decoder: a loop gets the decoder's FeedbackMemory, its layers and what
they read; a graphed runner gets the decoder (a LoopHost) with each call, and
a graph's function holds it by a weak reference.
"""
