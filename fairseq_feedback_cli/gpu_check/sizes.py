"""The sizes each step of feedback-gpu-check runs at (--size: full on a GPU, tiny on the CPU) and
the tolerance of the losses with graphs against without. The benchmark's presets, which steps
3a-3c run at, are fairseq_feedback_cli/presets.py's."""

from typing import List

# fairseq's losses (bits per token) with and without graphs may differ by this much: the graphs run
# at padded shapes, whose kernels round differently, and the difference grows over the updates (on an
# H100, 2026-11-27: at most 0.001 in fp32 up to update 100, then about doubling every 8 updates, 0.6
# by update 180, at this size and Adam's 1e-3; part 2's 100 updates stop before it can)
LOSS_TOLERANCE = {"fp32": 0.01, "fp16": 0.05}


def translation_model(embed_dim: int, ffn_dim: int, heads: int) -> List[str]:
    """A feedback_transformer of 2 + 2 layers, without dropout (graphs and eager then draw no masks)."""
    sizes = [str(a) for side in ("encoder", "decoder")
             for a in (f"--{side}-layers", 2, f"--{side}-embed-dim", embed_dim, f"--{side}-ffn-embed-dim", ffn_dim,
                       f"--{side}-attention-heads", heads)]
    return ["--arch", "feedback_transformer", "--share-all-embeddings", "--dropout", "0", *sizes]


# "full": one GPU within 13 minutes (small models for the comparisons, the benchmark's IWSLT sizes for
# the speeds); "tiny": the same sequence on 2 CPU cores within 2 minutes
SIZES = {
    "full": dict(
        translation=dict(corpus=["--train", 4000, "--valid", 200], model=translation_model(128, 512, 4),
                         batch=["--max-tokens", 2048], updates=100),
        benchmark=dict(preset="iwslt", first_batches=12),
        # the batches of steps 3d and 3e: the benchmark's (256 sentences, 32 streams), and up to 4x and 16x
        rows=dict(translation=[256, 1024], lm=[32, 128, 512]),
        # step 3e's feedback_lm also trained in 4 passes over groups of 16 positions, beside exact feedback
        passes=dict(lm=dict(passes=4, group=16)),
        # enough blocks per stream that eval-lm's rate, whose timer includes the capture, is mostly replays
        eval_lm=dict(preset="iwslt", corpus=["--train", 8000, "--valid", 14000]),
        two_ranks=dict(model=translation_model(128, 512, 4), batch=8, updates=10),
    ),
    "tiny": dict(
        translation=dict(corpus=["--train", 400, "--valid", 40], model=translation_model(32, 64, 2),
                         batch=["--max-tokens", 500], updates=20),
        benchmark=dict(preset="tiny", first_batches=4),
        # the language model's: docs/performance.md's command (tests/test_gpu_check.py)
        rows=dict(translation=[2, 8], lm=[8, 32, 128]),
        passes=dict(lm=dict(passes=4, group=16)),  # the tiny blocks of 8: one group, 4 passes
        eval_lm=dict(preset="tiny", corpus=["--train", 300, "--valid", 100]),
        two_ranks=dict(model=translation_model(32, 64, 2), batch=8, updates=4),
    ),
}
