"""Adaptive span, persistent vectors and memory compositions, against their
definitions (equivalence of training, decoding and streaming with each option
is checked in test_feedback_decoder.py and test_feedback_lm.py)."""

import re

import pytest
import torch
from helpers import make_dictionary, tiny_lm, tiny_translation_model

from fairseq_feedback.errors import FeedbackUsageError
from fairseq_feedback.modules.adaptive_span import AdaptiveSpanMask


def test_soft_mask_and_span_loss_follow_the_formula():
    mask = AdaptiveSpanMask(max_span=8, ramp=2, num_heads=2)
    mask.span_fraction.data = torch.tensor([0.25, 1.0])
    # m(d) = clamp((z S - d) / R + 1, 0, 1), d = 4 .. 0 slots before the newest
    expected = torch.tensor([[0.0, 0.5, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(mask.mask(5)[:, 0], expected)
    torch.testing.assert_close(mask.loss(), torch.tensor(8 * 0.625))  # S * mean(z)
    assert mask.current_span() == 8  # ceil(8 * 1.0) + 2, at most S
    mask.span_fraction.data = torch.tensor([0.25, 0.1])
    assert mask.current_span() == 4  # ceil(8 * 0.25) + 2
    mask.span_fraction.data = torch.tensor([-0.5, 1.5])
    mask.clamp_()
    assert mask.span_fraction.tolist() == [0.0, 1.0]


def test_masking_by_bias_equals_scaling_and_renormalising_the_weights():
    mask = AdaptiveSpanMask(max_span=6, ramp=3, num_heads=2)
    mask.span_fraction.data = torch.tensor([0.2, 0.6])
    scores = torch.randn(4, 2, 1, 6)
    weights = scores.softmax(-1) * mask.mask(6)
    expected = weights / weights.sum(-1, keepdim=True)
    torch.testing.assert_close((scores + mask.bias(6)).softmax(-1), expected)
    mask.bias(6).sum().backward()  # zero-mask slots give -inf but no NaN gradient
    assert torch.isfinite(mask.span_fraction.grad).all()


@pytest.mark.parametrize("baseline", [[], ["--no-feedback"]], ids=["feedback", "baseline"])
def test_adaptive_span_at_its_maximum_equals_plain_attention(baseline):
    d = make_dictionary()
    plain, _ = tiny_lm("--memory-span", "6", *baseline, dictionary=d, seed=3)
    adaptive, _ = tiny_lm("--memory-span", "6", "--adaptive-span", "--adaptive-span-init", "1", *baseline,
                          dictionary=d, seed=3)
    adaptive.load_state_dict(plain.state_dict(), strict=False)
    tokens = torch.randint(d.nspecial, len(d), (2, 15))
    plain.eval(), adaptive.eval()
    torch.testing.assert_close(adaptive(tokens)[0], plain(tokens)[0])


def test_no_persistent_vectors_is_the_plain_model():
    d = make_dictionary()
    plain, _ = tiny_translation_model(seed=5)
    none, _ = tiny_translation_model("--persistent-vectors", "0", seed=5)
    assert plain.state_dict().keys() == none.state_dict().keys()
    src = torch.randint(d.nspecial, len(d), (2, 5))
    prev = torch.randint(d.nspecial, len(d), (2, 6))
    plain.eval(), none.eval()
    torch.testing.assert_close(none(src, torch.full((2,), 5), prev)[0], plain(src, torch.full((2,), 5), prev)[0])


def test_persistent_vectors_start_with_unit_variance():
    model, _ = tiny_lm("--persistent-vectors", "256", "--head-dim", "64")
    keys, values = model.decoder.layers[0].self_attn.persistent()
    assert abs(keys.std().item() - 1) < 0.05 and abs(values.std().item() - 1) < 0.05


@pytest.mark.parametrize("composition, weights", [
    ("average", [0.25, 0.25, 0.25, 0.25]),
    ("top", [0, 0, 0, 1]),
    ("layer:0", [1, 0, 0, 0]),
    ("layer:2", [0, 0, 1, 0]),
])
def test_fixed_compositions_weigh_the_layers_as_named(composition, weights):
    model, _ = tiny_lm("--memory-composition", composition)
    assert model.decoder.memory.layer_weights is None  # nothing to learn, nothing unused
    torch.testing.assert_close(model.decoder.memory.mixing_weights(), torch.tensor([weights], dtype=torch.float))


def test_the_recurrent_memory_gives_each_layer_its_own_past_and_the_layers_below():
    """Figure 5's recurrent memory, section 4.3.2: "all previous layers plus
    the same layer". Layer l (from 0; its output is x^{l+1}) reads m^l =
    eq. 1 over x^0 .. x^{l+1}, with weights of its own, from the uniform
    average; the top layer's is the feedback memory. Each layer reads the
    keys and values of its own memory (a plane pair each)."""
    model, _ = tiny_lm("--memory-composition", "recurrent")
    memory = model.decoder.memory
    expected = torch.tensor([[1 / 2, 1 / 2, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], [1 / 4, 1 / 4, 1 / 4, 1 / 4]])
    torch.testing.assert_close(memory.mixing_weights(), expected)
    torch.nn.init.normal_(memory.layer_weights)  # learned: softmax(w^l) over x^0 .. x^{l+1}, nothing from above
    weights = memory.mixing_weights()
    for l in range(3):
        torch.testing.assert_close(weights[l, : l + 2], memory.layer_weights[l, : l + 2].softmax(0))
        assert not weights[l, l + 2:].any()
    assert (memory.memories, memory.planes) == (3, 6) and [memory.plane(l) for l in range(3)] == [0, 2, 4]


@pytest.mark.parametrize("flags, message", [
    (["--memory-composition", "layer:9"], "--memory-composition 'layer:9'"),
    (["--memory-composition", "bottom"], "use weighted, average, top, recurrent, or layer:K"),
    (["--adaptive-span", "--adaptive-span-init", "2"], "--adaptive-span-init must be in [0, 1], got 2"),
    (["--persistent-vectors", "-1"], "--persistent-vectors must be at least 0"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1"),
    (["--decoder-ffn-embed-dim", "0"], "--decoder-ffn-embed-dim must be at least 1, got 0"),
    (["--adaptive-span-loss", "0.1"], "--adaptive-span-loss is the loss of learned spans: add --adaptive-span"),
    (["--decoder-attention-heads", "3"], "--decoder-embed-dim 16 is not divisible by --decoder-attention-heads 3: "
                                         "change one, or set --head-dim"),
])
def test_bad_option_values_are_named(flags, message):
    with pytest.raises(FeedbackUsageError, match=re.escape(message)):
        tiny_lm(*flags)


class _FakeOptimizer:
    def backward(self, loss):
        loss.backward()

    def step(self):
        pass


def test_the_task_adds_the_span_loss_logs_it_and_clamps_spans_after_updates():
    d = make_dictionary()
    model, task = tiny_lm("--adaptive-span", "--adaptive-span-loss", "0.01", "--memory-span", "8", dictionary=d)
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion

    criterion = CrossEntropyCriterion(task, sentence_avg=False)
    tokens = torch.randint(d.nspecial, len(d), (2, 6))
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((2,), 6)}, "target": tokens,
              "ntokens": 12, "nsentences": 2}
    plain_loss, sample_size, _ = criterion(model, sample)
    loss, _, log = task.train_step(sample, model, criterion, _FakeOptimizer(), update_num=0)
    span_loss = 0.01 * sum(8 * layer.self_attn.span_mask.span_fraction.mean() for layer in model.decoder.layers)
    torch.testing.assert_close(loss, plain_loss + span_loss * sample_size)
    assert log["span_loss"] == pytest.approx(span_loss.item()) and log["span"] == model.decoder.current_span()
    # the span loss pushes z below 0; the update's clamp keeps it in [0, 1]
    for layer in model.decoder.layers:
        layer.self_attn.span_mask.span_fraction.data.fill_(-0.3)
    task.optimizer_step(_FakeOptimizer(), model, update_num=1)
    assert all((layer.self_attn.span_mask.span_fraction == 0).all() for layer in model.decoder.layers)


def test_the_long_span_architectures_learn_their_spans():
    from fairseq import options

    for arch, span, loss in [("feedback_lm_wiki103_large", 2048, 1e-5), ("feedback_lm_enwik8", 8192, 5e-7)]:
        args = options.parse_args_and_arch(options.get_training_parser(),
                                           ["x", "--task", "feedback_language_modeling", "--arch", arch])
        assert (args.adaptive_span, args.memory_span, args.adaptive_span_loss) == (True, span, loss)


def test_the_large_wikitext_model_without_adaptive_span_attends_over_table9s_fixed_span():
    """Table 9's large WikiText-103 span is "512, 2048*": --adaptive-span False gives the 512 (Table 6's ablation)."""
    from fairseq import options

    for extra, expected in [([], (True, 2048, 1e-5)), (["--adaptive-span"], (True, 2048, 1e-5)),
                            (["--adaptive-span", "False"], (False, 512, 0.0)),
                            (["--adaptive-span", "False", "--memory-span", "1024"], (False, 1024, 0.0))]:
        args = options.parse_args_and_arch(options.get_training_parser(), ["x", "--task", "feedback_language_modeling",
                                                                            "--arch", "feedback_lm_wiki103_large",
                                                                            *extra])
        assert (args.adaptive_span, args.memory_span, args.adaptive_span_loss) == expected, extra


def test_trimmed_memory_keeps_only_what_the_widest_head_reaches():
    d = make_dictionary()
    model, _ = tiny_lm("--adaptive-span", "--adaptive-span-ramp", "2", "--memory-span", "64", dictionary=d)
    for layer in model.decoder.layers:
        layer.self_attn.span_mask.span_fraction.data.fill_(4 / 64)
    assert model.decoder.current_span() == 6  # 4 slots + the ramp of 2
    windows = []
    for layer in model.decoder.layers:
        layer.self_attn.register_forward_hook(lambda module, args, out: windows.append(args[1].keys.size(2)))
    model.eval()
    with torch.no_grad():
        model(torch.randint(d.nspecial, len(d), (2, 20)), stream="s", block_index=0)
        model(torch.randint(d.nspecial, len(d), (2, 20)), stream="s", block_index=1)
    assert max(windows) == 6 and windows[-1] == 6
