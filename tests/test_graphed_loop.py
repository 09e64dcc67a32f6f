"""What CUDA-graph replay shares with the eager loop, checked on the CPU: the
loop run at bucketed shapes (padded steps, rows and source positions, all
masked) through the graphs' bookkeeping (static inputs, gradients handed to
autograd) gives the eager loop's losses and gradients, and decoding over the
static memory (a masked ring, reordered in place, moved between buckets)
gives the eager beam search and sampling. Capture itself needs a GPU: tests
marked `gpu` run there."""

import logging

import pytest
import torch
from fairseq import search as search_module
from helpers import (DEPTHS, assert_same_hypotheses, assert_same_loss_and_gradients, batch, loss_and_gradients,
                     make_dictionary, search, tiny_lm, tiny_translation_model)

from fairseq_feedback.errors import FeedbackUsageError
from fairseq_feedback.loop.graphed_decoding import CACHED_DECODING_BUFFERS
from fairseq_feedback.loop.graphed_loop import GraphedFeedbackLoop
from fairseq_feedback.cuda_graphs import bucket

OPTIONS = {
    "shared kv": [],
    "per-layer kv, pre-norm": ["--per-layer-kv", "--decoder-normalize-before"],
    "relative positions, adaptive span": ["--relative-positions", "--adaptive-span", "--adaptive-span-ramp", "2"],
    "persistent vectors": ["--persistent-vectors", "2"],
}


def test_buckets_pad_little_and_are_few():
    sizes = range(1, 2049)
    assert all(n <= bucket(n) < n + max(8, n / 8) for n in sizes)
    assert len({bucket(n) for n in sizes}) == 16 + 8 * 4  # multiples of 8 to 128, then 8 per doubling



@pytest.mark.parametrize("mask", [True, False], ids=["with a padding mask", "no padding mask"])
def test_padded_source_positions_are_masked_and_padded_rows_see_zeros(mask):
    kv = torch.randn(2, 2, 3, 4, 5, 6)  # [layers, 2, rows, heads, src_len, head_dim]
    bias = torch.zeros(3, 1, 1, 5).index_fill_(3, torch.tensor([0]), float("-inf")) if mask else None
    padded_kv, padded_bias = GraphedFeedbackLoop._pad_encoder(kv, bias, 8, 16)
    assert padded_kv.shape == (2, 2, 8, 4, 16, 6) and padded_bias.shape == (8, 1, 1, 16)
    assert torch.equal(padded_kv[:, :, :3, :, :5], kv)
    assert not padded_kv[:, :, 3:].any() and not padded_kv[..., 5:, :].any()
    assert torch.isinf(padded_bias[:3, ..., 5:]).all() and not padded_bias[3:].any()
    assert torch.equal(padded_bias[:3, ..., :5], torch.zeros(3, 1, 1, 5) if bias is None else bias)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", OPTIONS.values(), ids=OPTIONS.keys())
def test_translation_at_bucketed_shapes_trains_as_the_eager_loop(flags, depth):
    """3 rows, 5 source and 7 target tokens run padded to 8 x 8 x 8; the
    second and third batches, of other contents (and one of another shape),
    replay what the first captured, and the third accumulates its gradients
    onto the second's as --update-freq does."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", *flags, layers=depth)
    model.train()
    batches = [batch(d) for _ in range(2)] + [batch(d, rows=5, src_len=9, tgt_len=3)]
    targets = [torch.randint(d.nspecial, len(d), prev.shape) for _, _, prev in batches]

    def run(accumulate):
        results = []
        model.zero_grad()
        for (src, src_lengths, prev), target in zip(batches, targets):
            if not accumulate:
                model.zero_grad()
            results.append(loss_and_gradients(model, lambda: model(src, src_lengths, prev)[0], target))
        return results

    eager = run(accumulate=False) + run(accumulate=True)[-1:]
    model.decoder.use_cuda_graphs("emulate")
    graphed = run(accumulate=False) + run(accumulate=True)[-1:]
    for got, expected in zip(graphed, eager):
        assert_same_loss_and_gradients(got, expected)
    assert model.graph_statistics().captured == 2  # 8x8x8, and 8 rows x 8 x 16 source positions


def test_training_under_layerdrop_runs_eagerly_with_one_warning(caplog):
    """Each block leaves out other layers: 2^layers patterns, a graph each.
    Training blocks run eagerly instead (dropped layers get no gradient);
    evaluation, which keeps every layer, still goes through the graphs."""
    model, d = tiny_translation_model("--decoder-layerdrop", "0.5", "--decoder-layers", "6", "--dropout", "0")
    src, src_lengths, prev = batch(d)
    target = torch.randint(d.nspecial, len(d), prev.shape)
    results = []
    for mode in ("off", "emulate"):
        model.decoder.use_cuda_graphs(mode)
        model.train()
        model.zero_grad()
        torch.manual_seed(1)  # the same layers left out both times
        with caplog.at_level(logging.WARNING):
            results.append(loss_and_gradients(model, lambda: model(src, src_lengths, prev)[0], target))
            results.append(loss_and_gradients(model, lambda: model(src, src_lengths, prev)[0], target))
    assert_same_loss_and_gradients(results[0], results[2])
    trained = {name.split(".")[2] for name in results[0][1] if name.endswith("self_attn.q_proj.weight")}
    assert 0 < len(trained) < 6
    assert [r.message for r in caplog.records].count(
        "feedback loop: LayerDrop leaves out other layers at every block; "
        "training blocks run eagerly, without CUDA graphs") == 1
    assert model.graph_statistics().calls == 0
    model.eval()
    with torch.no_grad():
        model(src, src_lengths, prev)
    assert model.graph_statistics().calls == 1


@pytest.mark.parametrize("flags", [[], ["--per-layer-kv"], ["--adaptive-span", "--adaptive-span-ramp", "2"],
                                   ["--memory-composition", "recurrent", "--per-layer-kv"]],
                         ids=["shared kv", "per-layer kv", "adaptive span", "recurrent memory"])
def test_a_stream_at_bucketed_shapes_trains_as_the_eager_loop(flags):
    """Three blocks of 3 streams, the memory carried: each block's loss and
    gradients, and what evaluation gives without gradients."""
    d = make_dictionary()
    model, _ = tiny_lm("--memory-span", "10", *flags, dictionary=d)
    tokens, target = torch.randint(d.nspecial, len(d), (2, 3, 21))

    def run():
        model.train()
        results = []
        for k, (block, block_target) in enumerate(zip(tokens.split(7, 1), target.split(7, 1))):
            model.zero_grad()
            results.append(loss_and_gradients(model, lambda: model(block, stream="train", block_index=k)[0], block_target))
        model.eval()
        with torch.no_grad():
            results.append(torch.cat([model(b, stream="valid", block_index=k)[0] for k, b in enumerate(tokens.split(7, 1))]))
        return results

    *eager, eager_eval = run()
    model.decoder.use_cuda_graphs("emulate")
    *graphed, graphed_eval = run()
    for got, expected in zip(graphed, eager):
        assert_same_loss_and_gradients(got, expected)
    torch.testing.assert_close(graphed_eval, eager_eval, atol=1e-5, rtol=0)


DECODING = {
    "shared kv": [],
    "per-layer kv, pre-norm": ["--per-layer-kv", "--decoder-normalize-before"],
    "relative positions, adaptive span, recurrent memory": ["--relative-positions", "--adaptive-span",
                                                            "--adaptive-span-ramp", "2", "--memory-composition",
                                                            "recurrent"],
    "persistent vectors, top-layer memory": ["--persistent-vectors", "2", "--memory-composition", "top"],
}
SPANS = {"span shorter than the output (the ring wraps)": 3, "span longer (the memory grows)": 40}


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("span", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("flags", DECODING.values(), ids=DECODING.keys())
def test_beam_search_over_the_static_memory_equals_the_eager_search(flags, span, depth):
    """9 sentences, beam 5, up to 24 tokens: the rows are a bucket of 16
    sentences for the whole search, finished sentences' rows staying as
    padding; the memory, of twice the padded source (16 slots), grows past
    them, or wraps around a ring of span + 1."""
    model, d = tiny_translation_model("--memory-span", str(span), *flags, layers=depth)
    for layer in model.decoder.layers:
        if layer.self_attn.span_mask is not None:
            layer.self_attn.span_mask.span_fraction.data.uniform_(0.3, 0.8)
    model.eval()
    src, src_lengths, _ = batch(d, rows=9, src_len=6)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}
    args = dict(beam_size=5, max_len_b=24)
    eos = model.decoder.output_projection.weight.data[d.eos()]
    for _ in range(30):  # a stronger EOS until some sentences finish before the others
        rows = []
        eager = search(model, d, args, sample, reorders=rows)
        if len(set(rows)) > 1:
            break
        eos *= 1.15
    else:
        pytest.fail("sentences always ended together")
    model.decoder.use_cuda_graphs("emulate")
    graphed = search(model, d, args, sample)
    assert_same_hypotheses(graphed, eager)
    memories = model.decoder.graphed.decoding.memories
    assert {capacity for _, capacity, _ in memories} == ({16, 32} if span > 16 else {span + 1})
    assert {rows for rows, _, _ in memories} == {80}
    # a second search reuses the static memories (and so, on a GPU, the graphs)
    captured = model.graph_statistics().captured
    assert_same_hypotheses(search(model, d, args, sample), eager)
    assert model.graph_statistics().captured == captured


def test_searches_of_many_shapes_keep_every_graph_still_cached_valid():
    """More search shapes than decoding buffers are kept: a buffer goes only
    once no cached graph was captured over it (a graph replays its buffers'
    addresses), so the first shape's graph serves its next search as it is.
    The largest shape first: one larger than the graphs' static buffers
    would drop the graphs before it (graph_cache.py)."""
    model, d = tiny_translation_model("--memory-span", "8", layers=1)
    model.eval()
    model.decoder.use_cuda_graphs("emulate")
    args = dict(beam_size=2, max_len_b=4)
    shapes = [(sentences, src_len) for sentences in (17, 9, 1) for src_len in (40, 20, 12, 5)]
    samples = {}
    for sentences, src_len in shapes:
        src, src_lengths, _ = batch(d, rows=sentences, src_len=src_len)
        samples[sentences, src_len] = {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}
        search(model, d, args, samples[sentences, src_len])
    statistics = model.graph_statistics()
    assert len(model.decoder.graphed.decoding.encoders) > CACHED_DECODING_BUFFERS
    assert statistics.captured == statistics.cached
    graphed = search(model, d, args, samples[shapes[0]])
    assert model.graph_statistics().captured == statistics.captured and model.graph_statistics().failed is None
    model.decoder.use_cuda_graphs("off")
    assert_same_hypotheses(graphed, search(model, d, args, samples[shapes[0]]))


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", [[], ["--per-layer-kv"], ["--adaptive-span", "--adaptive-span-ramp", "2"]],
                         ids=["shared kv", "per-layer kv", "adaptive span"])
def test_sampling_a_language_model_over_the_static_memory_equals_eager_sampling(flags, depth):
    d = make_dictionary()
    model, _ = tiny_lm("--memory-span", "12", *flags, dictionary=d, layers=depth)
    model.eval()
    prompt = torch.randint(d.nspecial, len(d), (3, 4))
    sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.full((3,), 4)}, "prefix_tokens": prompt}
    args = dict(beam_size=1, search_strategy=search_module.Sampling(d), max_len_b=30, min_len=30)
    eager = search(model, d, args, sample, seed=1)
    model.decoder.use_cuda_graphs("emulate")
    assert_same_hypotheses(search(model, d, args, sample, seed=1), eager)


def test_interleaved_searches_stop_with_one_line():
    model, d = tiny_translation_model()
    model.eval()
    model.decoder.use_cuda_graphs("emulate")
    src, src_lengths, prev = batch(d)
    encoder_out = model.encoder(src, src_lengths)
    first, second = {}, {}
    with torch.no_grad():
        model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state=first)
        model.decoder(prev[:, :1], encoder_out=encoder_out, incremental_state=second)
        with pytest.raises(FeedbackUsageError, match="two searches interleaved"):
            model.decoder(prev[:, :2], encoder_out=encoder_out, incremental_state=first)
