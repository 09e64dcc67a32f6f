"""Training in passes (loop/passes.py): with as many passes as a group has positions, exact
feedback, outputs and gradients; with fewer, each group's first passes-many positions exact and
the others not; evaluation and decoding always exact."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import (DEPTHS, LM_MODEL, batch, last_number, make_dictionary, random_split, tiny_lm,
                     tiny_translation_model, with_trained_spans)
from helpers import run as run_tool, run_module

from fairseq_feedback.errors import FeedbackUsageError
from fairseq_feedback.loop.passes import Passes
from fairseq_feedback.models import FeedbackLanguageModel
from fairseq_feedback.tasks.streams import SplitStream

# every option of the memory and of what a layer reads; relative positions are feedback_lm's default
MODELS = {
    "feedback": [],
    "absolute positions": ["--relative-positions", "False", "--no-token-positional-embeddings", "False"],
    "post-norm": ["--decoder-normalize-before", "False"],
    "per-layer kv": ["--per-layer-kv"],
    "average": ["--memory-composition", "average"],
    "top": ["--memory-composition", "top"],
    "layer:1": ["--memory-composition", "layer:1"],
    "recurrent memory": ["--memory-composition", "recurrent"],
    "recurrent, per-layer kv": ["--memory-composition", "recurrent", "--per-layer-kv"],
    "adaptive span": ["--adaptive-span", "--adaptive-span-ramp", "2"],
    "persistent vectors, all-attention": ["--persistent-vectors", "4", "--no-feed-forward"],
    "LayerDrop": ["--decoder-layerdrop", "0.5"],
}
# (span, group): spans shorter and longer than the group; a block of 11 is no multiple of either group
SPANS = {"span 3 < group 5": (3, 5), "span 12 > group 4": (12, 4)}
BLOCK = 11


def lm(*flags, layers=3, span=12, seed=0):
    d = make_dictionary()
    model, task = tiny_lm("--memory-span", str(span), *flags, dictionary=d, layers=layers, seed=seed)
    return with_trained_spans(model).double().train(), task, d


def tokens(d, rows=2, length=BLOCK, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(d.nspecial, len(d), (rows, length), generator=g)


def run(model, inputs, passes=None, **kwargs):
    """The model's outputs on `inputs` and the parameters' gradients of a loss of them, in training,
    exactly (passes None) or in `passes`."""
    model.decoder.train_in_passes(passes)
    model.zero_grad()
    torch.manual_seed(0)  # LayerDrop's draw
    logits, _ = model(inputs, **kwargs)
    F.log_softmax(logits, -1).mul(torch.linspace(-1, 1, logits.size(-1), dtype=logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, expected):
    (got_outputs, got_grads), (outputs, grads) = got, expected
    torch.testing.assert_close(got_outputs, outputs, atol=1e-10, rtol=1e-10)
    for name in {*got_grads, *grads}:  # none where nothing reads a parameter (LayerDrop left every layer out)
        got_grad, grad = got_grads.get(name), grads.get(name)
        torch.testing.assert_close(torch.zeros_like(grad) if got_grad is None else got_grad,
                                   torch.zeros_like(got_grad) if grad is None else grad, atol=1e-10, rtol=1e-10,
                                   msg=name)


@pytest.mark.parametrize("span, group", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", MODELS.values(), ids=MODELS.keys())
def test_as_many_passes_as_a_group_has_positions_is_exact_feedback(flags, depth, span, group):
    """Outputs and gradients through every pass, in float64."""
    model, _, d = lm(*flags, layers=depth, span=span)
    inputs = tokens(d)
    assert_same(run(model, inputs, Passes(group, group)), run(model, inputs))


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
def test_the_translation_decoder_trains_in_passes_too(depth):
    """... over the encoder's keys and values, its sentences padded: exact with as many passes as
    positions, outputs and gradients."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=depth)
    model.double().train()
    src, src_lengths, prev = batch(d, tgt_len=BLOCK)
    assert_same(run(model, src, Passes(5, 5), src_lengths=src_lengths, prev_output_tokens=prev),
                run(model, src, src_lengths=src_lengths, prev_output_tokens=prev))


@pytest.mark.parametrize("initial", ["embeddings", "none"])
@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
def test_after_k_passes_the_first_k_positions_of_each_group_are_exact(depth, initial):
    """... the others are not: exact from the memory before the group (the passes' own), which
    the exact loop is started from, as a stream's next block starts from its carried memory."""
    group, k = 4, 2
    model, _, d = lm(layers=depth, span=12)
    decoder, inputs = model.decoder, tokens(d)
    x = decoder.embed(inputs, None)
    loop = decoder.loop(decoder._sampled_layers(), decoder.span, None)
    start = x.new_zeros(1, 1, len(inputs), decoder.embed_dim)  # m_{-1}
    with torch.no_grad():
        buffer, window = loop.start(start, BLOCK)
        outputs, memories = loop.block_in_passes(x, buffer, window, None, None, Passes(k, group, initial=initial))
        for s in range(0, BLOCK, group):
            buffer, window = loop.start(torch.cat([start, memories[:s]]), group)
            exact, _ = loop.block(x[s : s + group], buffer, window, None, None)
            got = outputs[s : s + group]
            torch.testing.assert_close(got[:k], exact[:k], atol=1e-10, rtol=1e-10)
            for j in range(k, len(got)):
                assert not torch.allclose(got[j], exact[j], atol=1e-6), f"position {s + j} is exact after {k} passes"


def test_a_stream_trained_in_passes_carries_its_memory_across_blocks_as_exact_training_does():
    """Blocks of a stream in training, from a random epoch offset: losses and gradients equal."""
    model, task, d = lm(span=6)
    split = SplitStream("train", random_split(d, lines=23))
    task.args.tokens_per_sample, task.args.random_epoch_offset = 9, True

    def epoch(passes):
        model.decoder.train_in_passes(passes)
        model.zero_grad()
        itr = task.get_batch_iterator(split, max_sentences=2)
        losses = []
        for sample in itr.next_epoch_itr(shuffle=True):
            logits, extra = model(**sample["net_input"])
            lprobs = model.get_normalized_probs((logits, extra), log_probs=True)
            loss = F.nll_loss(lprobs.flatten(0, 1), sample["target"].flatten(), ignore_index=d.pad(), reduction="sum")
            loss.backward()
            losses.append(loss.detach())
        assert itr.layout["offset"] > 0, "the epoch starts from an offset"
        return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert_same(epoch(Passes(3, 3)), epoch(None))


def test_fewer_passes_than_positions_train_another_function():
    """Passes do not fall back to the exact loop: one pass over groups of 4 gives other outputs."""
    model, _, d = lm()
    inputs = tokens(d)
    (approximate, _), (exact, _) = run(model, inputs, Passes(1, 4)), run(model, inputs)
    torch.testing.assert_close(approximate[:, 0], exact[:, 0])  # the first position reads no guess
    assert not torch.allclose(approximate, exact, atol=1e-3)


def test_gradients_through_the_last_pass_alone_compute_the_same_outputs_and_other_gradients():
    model, _, d = lm()
    inputs = tokens(d)
    every = run(model, inputs, Passes(4, 4))
    last_outputs, last_grads = run(model, inputs, Passes(4, 4, gradients="last"))
    torch.testing.assert_close(last_outputs, every[0], atol=1e-10, rtol=1e-10)
    assert not torch.allclose(last_grads["decoder.memory.kv_proj.weight"], every[1]["decoder.memory.kv_proj.weight"])


def test_the_passes_of_a_group_draw_the_same_dropout_masks():
    """With dropout, a pass more than a group's positions changes nothing: each position
    computes one dropout sample, whatever the passes."""
    model, _, d = lm("--dropout", "0.3", "--attention-dropout", "0.3", "--activation-dropout", "0.3")
    inputs = tokens(d)
    outputs = []
    for passes in (4, 5):
        torch.manual_seed(0)
        outputs.append(run(model, inputs, Passes(passes, 4))[0])
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-10, rtol=1e-10)
    torch.manual_seed(0)
    exact = run(model, inputs)[0]
    assert not torch.allclose(outputs[0], exact, atol=1e-3), "dropout draws something"


def test_evaluation_runs_exactly_whatever_the_passes():
    model, _, d = lm("--train-passes", "1", "--pass-group", "4")
    assert model.decoder.passes == Passes(1, 4)
    inputs = tokens(d)
    model.eval()
    with torch.no_grad():
        evaluated = model(inputs)[0]
        model.decoder.train_in_passes(None)
        exact = model(inputs)[0]
    torch.testing.assert_close(evaluated, exact, atol=0, rtol=0)


@pytest.mark.parametrize("flags, message", [
    (["--train-passes", "5", "--pass-group", "4"], "--train-passes 5 is more than --pass-group 4: 4 passes already "
                                                     "compute a group exactly; use at most 4"),
    (["--train-passes", "2", "--no-feedback"], "--train-passes trains the feedback loop in passes; --no-feedback's "
                                               "Transformer computes its blocks at once already: drop one of them"),
    (["--train-passes", "2", "--pass-group", "16", "--pass-initial-memory", "none"],
     "--pass-initial-memory none: the first pass of a group would leave its positions beyond --memory-span 12 from "
     "the group's start (--pass-group 16) nothing to read; use --pass-initial-memory embeddings"),
    (["--train-passes", "2", "--pass-initial-memory", "none", "--adaptive-span"],
     "--pass-initial-memory none: the first pass of a group would leave its positions beyond a head's learned span "
     "(--adaptive-span) nothing to read; use --pass-initial-memory embeddings"),
    (["--train-passes", "-1"], "--train-passes must be at least 0, got -1"),
    (["--train-passes", "1", "--pass-group", "0"], "--pass-group must be at least 1, got 0"),
])
def test_passes_that_cannot_run_are_refused_in_one_line(flags, message):
    with pytest.raises(FeedbackUsageError) as error:
        lm(*flags)
    assert str(error.value) == message


def test_fairseq_train_in_passes_trains_and_validates_exactly(lm_data, tmp_path):
    """Two passes over groups of two are exact: the first training loss of exact training, from the
    same seed; one pass over groups of eight is not. Both validate exactly: fairseq-eval-lm's loss
    on the checkpoint, over the same blocks and streams, is the validation's; and the hub samples
    from it as from any checkpoint."""
    _, data = lm_data
    train = [*LM_MODEL, "--optimizer", "adam", "--lr", "3e-3", "--tokens-per-sample", 16, "--batch-size", 4,
             "--max-update", 3, "--log-interval", 1, "--seed", 3]
    logs = {}
    for name, passes in (("exact", []), ("2 of 2", ["--train-passes", 2, "--pass-group", 2]),
                         ("1 of 8", ["--train-passes", 1, "--pass-group", 8])):
        logs[name] = run_tool("train", data, *train, *passes, "--save-dir", tmp_path / name).stdout
    first = {name: last_number(r"epoch 001:\s+1 / \d+ loss=([\d.]+)", log) for name, log in logs.items()}
    assert first["2 of 2"] == first["exact"] != first["1 of 8"]
    assert logs["1 of 8"].count("training runs in 1 pass over groups of 8 positions") == 1
    assert "training runs in" not in logs["exact"]
    evaluated = run_tool("eval_lm", data, "--task", "feedback_language_modeling", "--path",
                         tmp_path / "1 of 8" / "checkpoint_last.pt", "--tokens-per-sample", 16, "--batch-size", 4,
                         "--gen-subset", "valid", "--cpu").stdout
    assert last_number(r"valid on 'valid' subset \| loss ([\d.]+)", logs["1 of 8"]) == round(
        last_number(r"Loss \(base 2\): ([\d.]+)", evaluated), 3)
    # the model saved is the same model: it samples through fairseq's incremental cache like any other
    lm = FeedbackLanguageModel.from_pretrained(str(tmp_path / "1 of 8"), "checkpoint_last.pt", str(data))
    assert lm.models[0].decoder.passes == Passes(1, 8)
    assert lm.sample("w4 w5", beam=1, sampling=True, max_len_b=5).startswith("w4 w5")


def test_the_gap_of_one_model_between_passes_and_exact(lm_run):
    """passes_gap: the exact number is fairseq-eval-lm's; as many passes as positions give it
    too; one pass over groups of eight another."""
    args = ["--data", lm_run.data, "--path", lm_run.checkpoint, "--tokens-per-sample", 16, "--batch-size", 4]
    gap = json.loads(run_module("fairseq_feedback_cli.passes_gap", *args, "--passes", "4x4,8x1", "--json").stdout)
    evaluated = run_tool("eval_lm", lm_run.data, "--task", "feedback_language_modeling", "--path", lm_run.checkpoint,
                         "--tokens-per-sample", 16, "--batch-size", 4, "--gen-subset", "valid", "--cpu").stdout
    assert round(gap["exact"], 4) == last_number(r"Loss \(base 2\): ([\d.]+)", evaluated)
    assert gap["passes"]["4x4"] == pytest.approx(gap["exact"], abs=1e-5)
    assert abs(gap["passes"]["8x1"] - gap["exact"]) > 1e-3
    refused = run_module("fairseq_feedback_cli.passes_gap", *args, "--passes", "4x5", check=False)
    assert refused.stderr.strip().endswith(
        "--passes 4x5: each setting is GxK, G positions a group and K passes, 1 <= K <= G, as in 16x4")
