"""The sizes that feedback-benchmark measures at (--preset), which feedback-gpu-check's
fairseq-eval-lm run shares: the models' widths and depths, the batches, and the calls timed."""

PRESETS = {
    # the targets' settings: translation at base widths with a 6-layer decoder
    # and batches of ~4k tokens; the LM at d 256, 4 layers, block 64, 32 streams
    "base": dict(
        translation=dict(embed_dim=512, ffn_dim=2048, heads=8, layers=6, batch=128, length=32, vocab=10000,
                         beam_batch=128, repeats=3),
        lm=dict(embed_dim=256, ffn_dim=1024, heads=4, layers=4, streams=32, block=64, span=64, vocab=10000,
                sample_batch=32, repeats=7),
    ),
    # Table 8's IWSLT sizes with --max-tokens 8192-like batches; the LM at
    # feedback_lm_wiki103's sizes (without its adaptive input and softmax)
    "iwslt": dict(
        translation=dict(embed_dim=512, ffn_dim=1024, heads=4, layers=6, batch=256, length=32, vocab=10000,
                         beam_batch=128, repeats=5),
        lm=dict(embed_dim=512, ffn_dim=4096, heads=8, layers=4, streams=32, block=256, span=512, vocab=10000,
                sample_batch=32, repeats=5, head_dim=128),
    ),
    # the language model alone: Figure 9's 2-layer feedback model at CPU scale on bytes (the results page),
    # which trains in passes on docs/passes.md, keys and values projected per layer
    "bytes": dict(
        lm=dict(embed_dim=128, ffn_dim=1536, heads=4, head_dim=96, layers=2, streams=16, block=128, span=256,
                vocab=256, sample_batch=2, repeats=3, feedback_options=["--per-layer-kv"]),
    ),
    "tiny": dict(
        translation=dict(embed_dim=32, ffn_dim=64, heads=2, layers=2, batch=8, length=8, vocab=100,
                         beam_batch=2, repeats=2),
        lm=dict(embed_dim=32, ffn_dim=64, heads=2, layers=2, streams=4, block=8, span=8, vocab=100,
                sample_batch=2, repeats=2),
    ),
}
