"""The feedback language model and its streaming task: a stream read in
blocks with the memory carried gives the numbers of one pass over it."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import Split, make_dictionary, random_split, tiny_lm, with_trained_spans
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator

from fairseq_feedback.tasks.streams import SplitStream

MODELS = {
    "feedback": [],
    "feedback, per-layer kv": ["--per-layer-kv"],
    "transformer baseline": ["--no-feedback"],
    "adaptive span": ["--adaptive-span", "--adaptive-span-ramp", "2"],
    "baseline, adaptive span": ["--no-feedback", "--adaptive-span", "--adaptive-span-ramp", "2"],
    "persistent vectors, all-attention": ["--persistent-vectors", "4", "--no-feed-forward"],
    "baseline, persistent vectors": ["--no-feedback", "--persistent-vectors", "4"],
    # a fixed composition (top, average, layer:K) runs as eq. 1's with other weights (each against a plain
    # reference in test_feedback_decoder.py); the recurrent one carries a memory per layer
    "recurrent memory": ["--memory-composition", "recurrent"],
}
# a bug that showed only from 11 layers on got through tests at one depth
DEPTHS = {"1 layer": 1, "3 layers": 3, "12 layers": 12}


def streamed_log_probs(model, task, split, block, rows=1):
    """Per-token log-probabilities of the split's targets, stream by stream,
    as the task delivers them block by block."""
    task.args.tokens_per_sample = block
    itr = task.get_batch_iterator(split, max_sentences=rows).next_epoch_itr(shuffle=False)
    scores = [[] for _ in range(rows)]
    targets = [[] for _ in range(rows)]
    with torch.no_grad():
        for sample in itr:
            logits, extra = model(**sample["net_input"])
            lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
            for r in range(rows):
                keep = sample["target"][r].ne(task.dictionary.pad())
                scores[r].append(lprobs[r].gather(1, sample["target"][r].unsqueeze(1)).squeeze(1)[keep])
                targets[r].append(sample["target"][r][keep])
    return [torch.cat(s) for s in scores], [torch.cat(t) for t in targets]


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", MODELS.values(), ids=MODELS.keys())
def test_a_stream_read_in_blocks_equals_one_pass(flags, depth):
    d = make_dictionary()
    model, task = tiny_lm("--memory-span", "12", *flags, dictionary=d, layers=depth)
    with_trained_spans(model).eval()
    split = SplitStream("valid", random_split(d))
    stream = torch.cat(split.tokens.lines)
    inputs = torch.cat([torch.tensor([d.eos()]), stream[:-1]]).unsqueeze(0)
    with torch.no_grad():
        logits, extra = model(inputs)  # one pass, no stream: the whole split at once
    one_pass = model.get_normalized_probs((logits, extra), log_probs=True)[0].gather(1, stream.unsqueeze(1)).squeeze(1)
    for block in (8, 16, 64):
        (scores,), (targets,) = streamed_log_probs(model, task, split, block)
        assert torch.equal(targets, stream), "every token is a target exactly once, in order"
        torch.testing.assert_close(scores, one_pass, atol=1e-5, rtol=0)


def test_every_token_is_scored_once_whatever_the_streams_and_workers():
    d = make_dictionary()
    split = SplitStream("train", random_split(d, lines=23))
    stream = torch.cat(split.tokens.lines).tolist()
    model, task = tiny_lm(dictionary=d)
    for block, rows, workers in [(5, 3, 1), (8, 2, 2), (64, 4, 1), (7, 1, 3)]:
        task.args.tokens_per_sample = block
        runs = []
        for worker in range(workers):
            itr = task.get_batch_iterator(split, max_sentences=rows, num_shards=workers, shard_id=worker)
            batches = list(itr.next_epoch_itr(shuffle=False))
            assert [b["net_input"]["block_index"] for b in batches] == list(range(len(batches)))
            for r in range(rows):
                runs.append([t for b in batches for t in b["target"][r].tolist() if t != d.pad()])
        assert sum(runs, []) == stream
        assert sum(b["ntokens"] for b in batches) <= len(stream)


def test_an_epoch_from_an_offset_reads_each_stream_from_that_token_on():
    """--random-epoch-offset's epochs: every stream less its first `offset` tokens, its first input the token
    before them (the inputs are the stream shifted by one token), labels cut as their inputs."""
    d = make_dictionary()
    tokens = random_split(d, lines=23)
    split = SplitStream("train", tokens)
    labelled = SplitStream("train", tokens, Split([line.flip(0) for line in tokens.lines]))

    def streams(split, block, rows, workers, offset):
        """each stream's (inputs, targets) of the epoch, in order"""
        read = []
        for worker in range(workers):
            dataset = split.blocks(block, d, d, "_", rows, workers, worker, offset)
            for row in range(len(dataset.streams)):
                stream = dataset.streams[row]
                pairs = [dataset.source_and_target(stream, k) for k in range(len(stream[0]))]
                read.append(tuple(torch.cat(part).tolist() for part in zip(*pairs)))
        return read

    for block, rows, workers in [(5, 3, 1), (8, 2, 2), (7, 1, 3)]:
        for offset in (1, 3, block - 1):
            for whole, (inputs, targets) in zip(streams(split, block, rows, workers, 0),
                                                streams(split, block, rows, workers, offset)):
                assert targets == whole[1][offset:] and inputs == whole[1][offset - 1:-1]
            for whole, cut in zip(streams(labelled, block, rows, workers, 0),
                                  streams(labelled, block, rows, workers, offset)):
                assert cut == (whole[0][offset:], whole[1][offset:])


def test_emb_dropout_drops_the_embeddings_and_the_top_layers_output_in_training():
    """The WikiText-103 models' "Embed. dropout" (Table 9), on "the embedding layer output and the last sublayer
    output" (appendix 7.6): at a rate of 1 both are all zeros; evaluation drops nothing."""
    d = make_dictionary()
    model, _ = tiny_lm("--emb-dropout", "1", dictionary=d)
    tokens = torch.randint(d.nspecial, len(d), (2, 6))
    for training in (True, False):
        model.train(training)
        embedded, features = model.decoder.embed(tokens, None), model.decoder(tokens, features_only=True)[0]
        assert bool(embedded.any()) is bool(features.any()) is not training


def test_memory_is_carried_within_a_stream_and_never_across_streams():
    d = make_dictionary()
    model, task = tiny_lm(dictionary=d)
    model.eval()
    tokens = torch.randint(d.nspecial, len(d), (2, 6))
    with torch.no_grad():
        fresh = model(tokens, stream="train", block_index=0)[0]
        model(tokens, stream="train", block_index=1)
        assert "valid" not in model.streams
        valid = model(tokens, stream="valid", block_index=0)[0]
        continued = model(tokens, stream="train", block_index=2)[0]
    torch.testing.assert_close(valid, fresh)  # validation starts fresh, whatever training did
    assert not torch.allclose(continued, fresh)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", MODELS.values(), ids=MODELS.keys())
def test_incremental_sampling_equals_the_training_forward(flags, depth):
    d = make_dictionary()
    model, task = tiny_lm("--memory-span", "6", *flags, dictionary=d, layers=depth)
    with_trained_spans(model).eval()
    generator = SequenceGenerator([model], d, beam_size=1, search_strategy=search.Sampling(d), max_len_b=15,
                                  min_len=15)
    prompt = torch.randint(d.nspecial, len(d), (3, 4))
    sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.full((3,), 4)}}
    torch.manual_seed(1)
    for i, (hypo,) in enumerate(generator.generate([model], sample, prefix_tokens=prompt)):
        tokens = hypo["tokens"]
        inputs = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]]).unsqueeze(0)
        with torch.no_grad():
            logits, extra = model(inputs)
        lprobs = model.get_normalized_probs((logits, extra), log_probs=True)[0]
        expected = lprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(hypo["positional_scores"], expected, atol=1e-5, rtol=0)


def reference_transformer_xl(model, blocks):
    """A plain pre-norm transformer with relative positions and Transformer-XL
    caching, written out: each layer attends to the last `span` inputs of its
    own, itself included, with the previous block's inputs cached (detached)."""
    dec = model.decoder
    span, cache, out = dec.span, None, []
    for tokens in blocks:
        x = dec.embed(tokens, None)  # [T, B, C]
        steps, rows, _ = x.shape
        new_cache = []
        for l, layer in enumerate(dec.layers):
            attn = layer.self_attn
            heads, head_dim = attn.num_heads, attn.head_dim
            context = x if cache is None else torch.cat([cache[l], x])
            new_cache.append(context[-span:].detach())  # Transformer-XL: no gradient into the cache
            offset = len(context) - steps
            k, v = attn.kv_proj(layer.self_attn_layer_norm(context)).view(len(context), rows, 2, heads, head_dim).unbind(2)
            q = attn.q_proj(layer.self_attn_layer_norm(x)).view(steps, rows, heads, head_dim)
            distance = (torch.arange(steps)[:, None] + offset) - torch.arange(len(context))[None, :]  # [T, N]
            visible = (distance >= 0) & (distance < span)
            positions = dec.key_positions[(span - 1 - distance).clamp(0, span - 1)]  # [T, N, head_dim]
            scores = torch.einsum("tbhd,nbhd->bhtn", q, k) + torch.einsum("tbhd,tnd->bhtn", q, positions)
            scores = (scores / math.sqrt(head_dim)).masked_fill(~visible, float("-inf"))
            z = torch.einsum("bhtn,nbhd->tbhd", scores.softmax(-1), v).reshape(steps, rows, heads * head_dim)
            x = x + attn.out_proj(z)
            x = x + layer.fc2(F.relu(layer.fc1(layer.final_layer_norm(x))))
        cache = new_cache
        out.append(dec.output_layer(dec.layer_norm(x).transpose(0, 1)))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
def test_the_baseline_is_a_transformer_xl(depth):
    d = make_dictionary()
    model, _ = tiny_lm("--no-feedback", "--memory-span", "5", dictionary=d, layers=depth)
    model.train()  # dropout 0: the training path, deterministic
    tokens, target = torch.randint(d.nspecial, len(d), (2, 2, 24))
    blocks = tokens.split(8, dim=1)

    def gradients(logits):
        model.zero_grad()
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got = torch.cat([model(b, stream="s", block_index=k)[0] for k, b in enumerate(blocks)], dim=1)
    expected = reference_transformer_xl(model, blocks)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got, expected = gradients(got), gradients(expected)
    assert got.keys() == expected.keys() and "decoder.key_positions" in got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_more_streams_than_lines_leaves_the_extra_streams_empty():
    d = make_dictionary()
    model, task = tiny_lm(dictionary=d)
    split = SplitStream("valid", random_split(d, lines=3))
    task.args.tokens_per_sample = 4
    batches = list(task.get_batch_iterator(split, max_sentences=5).next_epoch_itr(shuffle=False))
    scored = torch.cat([b["target"][b["target"].ne(d.pad())] for b in batches])
    assert len(scored) == sum(split.tokens.sizes)


def test_labels_replace_next_token_targets_and_ignored_labels_carry_no_loss():
    d, out = make_dictionary(), make_dictionary()
    ignore = out.add_symbol("_")
    model, task = tiny_lm("--labels", "labels", dictionary=d, labels=out)
    tokens = random_split(d, lines=4)
    labels = Split([torch.where(line == d.eos(), line, torch.where(line % 2 == 0, line, torch.tensor(ignore)))
                    for line in tokens.lines])
    task.args.tokens_per_sample = 5
    (batch,) = list(task.get_batch_iterator(SplitStream("train", tokens, labels), max_sentences=1)
                    .next_epoch_itr(shuffle=False))[:1]
    stream, wanted = torch.cat(tokens.lines)[:5], torch.cat(labels.lines)[:5]
    assert torch.equal(batch["net_input"]["src_tokens"][0], stream)  # inputs are not shifted
    expected = torch.where((wanted == ignore) | (wanted == out.eos()), torch.tensor(out.pad()), wanted)
    assert torch.equal(batch["target"][0], expected)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", [[], ["--adaptive-span", "--adaptive-span-ramp", "2"], ["--persistent-vectors", "3"]],
                         ids=["plain", "adaptive span", "persistent vectors"])
def test_the_baseline_trains_the_same_in_one_pass_as_step_by_step(flags, depth):
    """The baseline computes a block at once in training; decoding runs it
    step by step, from its cache: the same gradients either way."""
    d = make_dictionary()
    model, _ = tiny_lm("--no-feedback", "--memory-span", "5", *flags, dictionary=d, layers=depth)
    model.train()
    tokens, target = torch.randint(d.nspecial, len(d), (2, 3, 12))

    def one_pass():
        return model.decoder(tokens)[0]

    def step_by_step():
        state = {}
        return torch.cat([model.decoder(tokens[:, : t + 1], incremental_state=state)[0] for t in range(12)], dim=1)

    grads = []
    for forward in (one_pass, step_by_step):
        model.zero_grad()
        logits = forward()
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    block, steps = grads
    assert block.keys() == steps.keys()
    for name in block:
        torch.testing.assert_close(block[name], steps[name], atol=1e-6, rtol=1e-5)
