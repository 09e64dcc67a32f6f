"""The feedback loop (section 3.3): the model's per-token recurrence, run two
ways, eagerly or replayed as CUDA graphs.

    FeedbackDecoder.decode (models/feedback_decoder.py), once per call: builds the call's
        |  FeedbackLoop, then runs it eagerly or hands its functions to the graphed runners
        |
        +-- fallback.py        unfused_reason: why an option needs the reference loop (the one
        |                      door, for blocks and a search's steps, eager or graphed)
        |
        +-- feedback_loop.py   FeedbackLoop: the memory, the layers of this pass, the span; holds
        |     |                the modules it runs, never the decoder
        |     |  .block        a block over a memory buffer, run by:
        |     +-- reference.py     ReferenceLoop: step by step through autograd, fairseq's modules as
        |     |                    they are (reference_step; memory_views); covers every option
        |     +-- passes.py        PassesLoop (.block_in_passes, --train-passes): training in passes, a
        |     |                    block's positions in groups, each in K passes of every layer over the
        |     |                    whole group (fairseq's modules, through autograd)
        |     +-- fused_block.py   FusedFeedbackLoop: a block as one autograd Function (BlockFunction),
        |           |              its backward by hand, weight gradients once per block; what it
        |           |              reads, its gradients and its records by name (BlockInputs,
        |           |              BlockRecords); fused_step, a search's step without gradients
        |           +-- dropout_bits.py  BlockDropout: the block's dropout masks, drawn at once, held
        |           |                    as bits, unpacked a few steps at a time, forward and backward
        |           +-- memory_windows.py   MemoryWindows: what a step reads of the memory's slots,
        |           |                       keys with relative positions
        |           +-- mixing.py        Mixing: eq. 1, the memory vectors from every layer's states
        |           +-- fused_layer.py   FusedLayer: a MemoryDecoderLayer at each step, its sublayers'
        |                 |              residuals with dropout, pre- or post-norm; WEIGHTED, the one
        |                 |              list of a layer's weighted modules (the block's parameters)
        |                 +-- operators.py   the per-step pieces' way (each backward by hand, its
        |                 |                  equation beside its code) and the small pieces: Linear,
        |                 |                  Norm, the residual with dropout; StepRecords, what a
        |                 |                  piece keeps
        |                 +-- attention.py   Attention between its projections, its rows by head
        |
        |  with --cuda-graphs (the graphs themselves: fairseq_feedback/cuda_graphs):
        +-- graphed_loop.py    GraphedFeedbackLoop.block(FeedbackLoop.block_from, inputs, parameters,
        |     |                key): a block padded to its bucket, one graph per bucket;
        |     |                block_weight_gradients.py, the reference loop's linear layers'
        |     |                weight gradients once per block, in graphs
        |     |
        |     +-- graphed_decoding.py   GraphedDecoding.decode(FeedbackLoop.step, ...): a search's step
        |                               per token over static_memory.py, a ring of fixed shape masked
        |                               by distance; the search's state kept by the decoder

Both loops compute the same outputs and gradients (tests/test_fused_loop.py;
each piece against autograd: tests/test_loop_pieces.py).

Calls go one way: the decoder calls into this package, and nothing here
calls the decoder or holds it. A graphed runner knows shapes, buckets and
its cache; what it replays is a FeedbackLoop's function, which holds the
modules it runs, so that a graph, owned by a cache that the decoder owns,
leads back to neither.
"""
