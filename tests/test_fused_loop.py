"""The feedback loop as one fused block (loop/fused_block.py) computes what
the reference loop through autograd (loop/reference.py) computes, step by
step: the same outputs and gradients, with dropout the same masks, and the
same memory carried from block to block; options it does not cover run
through autograd, said once. (Each of the block's pieces alone:
test_loop_pieces.py.)"""

import contextlib
import logging

import pytest
import torch
from fairseq.modules.fairseq_dropout import FairseqDropout
from helpers import (DEPTHS, assert_same_loss_and_gradients, batch, loop_runs, loss_and_gradients, make_dictionary,
                     on_loop_runs, tiny_lm, tiny_translation_model)

from fairseq_feedback.loop.dropout_bits import CHUNK
from fairseq_feedback.loop.fused_block import FusedFeedbackLoop, block_weighted, fused_step
from fairseq_feedback.loop.fused_layer import NO_DROPOUT
from fairseq_feedback.loop.reference import ReferenceLoop, reference_step

OPTIONS = {
    "post-norm": [],
    "pre-norm": ["--decoder-normalize-before"],
    "per-layer kv": ["--per-layer-kv"],
    "relative positions, adaptive span": ["--relative-positions", "--adaptive-span", "--adaptive-span-ramp", "2"],
    "pre-norm, per-layer kv, relative positions": ["--decoder-normalize-before", "--per-layer-kv",
                                                   "--relative-positions"],
    "average memory, no feed-forward": ["--memory-composition", "average", "--no-feed-forward"],
    "layer-1 memory, gelu": ["--memory-composition", "layer:1", "--activation-fn", "gelu"],
    "recurrent memory, relative positions": ["--memory-composition", "recurrent", "--relative-positions"],
    "recurrent memory, per-layer kv, pre-norm": ["--memory-composition", "recurrent", "--per-layer-kv",
                                                 "--decoder-normalize-before"],
}
SPANS = {"span shorter than target": 3, "span longer than target": 16}


@contextlib.contextmanager
def through_autograd(model):
    """Within it, the decoder runs the reference loop, step by step through autograd."""
    model.decoder.use_fused_block(False)
    try:
        yield
    finally:
        model.decoder.use_fused_block(True)


def fused_blocks(monkeypatch):
    """The fused blocks that run from now on."""
    blocks = []
    on_loop_runs(monkeypatch, lambda runner: blocks.append(runner) if isinstance(runner, FusedFeedbackLoop) else None)
    return blocks


def trained(model):
    """Mixing weights away from uniform and adaptive spans that differ per head, so that every term matters."""
    if model.decoder.memory.layer_weights is not None:
        torch.nn.init.normal_(model.decoder.memory.layer_weights)
    for layer in model.decoder.layers:
        if layer.self_attn.span_mask is not None:
            fraction = layer.self_attn.span_mask.span_fraction
            fraction.data = torch.linspace(0.05, 0.3, len(fraction))
    return model


def both_ways(model, forward, target, seed=0):
    """(loss, gradients) of the fused block, then of the loop through autograd, from the same seed."""
    torch.manual_seed(seed)
    model.zero_grad()
    fused = loss_and_gradients(model, forward, target)
    with through_autograd(model):
        torch.manual_seed(seed)
        model.zero_grad()
        reference = loss_and_gradients(model, forward, target)
    return fused, reference


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("span", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("flags", OPTIONS.values(), ids=OPTIONS.keys())
def test_the_fused_block_trains_as_the_loop_through_autograd(flags, span, depth):
    model, d = tiny_translation_model("--memory-span", str(span), "--dropout", "0", *flags, layers=depth)
    trained(model).train()
    src, src_lengths, prev = batch(d)
    target = torch.randint(d.nspecial, len(d), prev.shape)
    fused, reference = both_ways(model, lambda: model(src, src_lengths, prev)[0], target)
    assert_same_loss_and_gradients(fused, reference)


@pytest.mark.parametrize("span", [4, 40], ids=["attention weights kept", "attention weights computed again"])
@pytest.mark.parametrize("flags", [[], ["--adaptive-span", "--adaptive-span-ramp", "2"], ["--per-layer-kv"],
                                   ["--memory-composition", "recurrent", "--per-layer-kv"]],
                         ids=["relative positions", "adaptive span", "per-layer kv", "recurrent memory"])
def test_a_stream_trains_block_after_block_as_through_autograd(flags, span, monkeypatch):
    """Five blocks of a stream, the memory carried (projected again by each
    block), each block's loss and gradients. Once a step reads many slots
    (here heads x slots > embed + ffn), its attention weights would take
    more room than its feed-forward block: the backward computes them
    again instead of keeping them."""
    model, task = tiny_lm("--memory-span", str(span), *flags)
    trained(model).train()
    for layer in model.decoder.layers:  # the widest head's span, read by the memory, near --memory-span
        if layer.self_attn.span_mask is not None:
            layer.self_attn.span_mask.span_fraction.data = torch.tensor([0.3, 0.9])
    d = task.source_dictionary
    tokens, target = torch.randint(d.nspecial, len(d), (2, 3, 5 * 7))
    ran = fused_blocks(monkeypatch)

    def blocks():
        results = []
        for k, (block, block_target) in enumerate(zip(tokens.split(7, 1), target.split(7, 1))):
            model.zero_grad()
            results.append(loss_and_gradients(model, lambda: model(block, stream="train", block_index=k)[0],
                                              block_target))
        return results

    fused = blocks()
    with through_autograd(model):
        reference = blocks()
    for got, expected in zip(fused, reference):
        assert_same_loss_and_gradients(got, expected)
    kept = {block.keep_probs for block in ran}
    assert len(ran) == 5 and True in kept and (False in kept) == (span == 40)


class ReplayedDropout(FairseqDropout):
    """A layer's dropout, multiplying by the masks the fused block drew for
    it (scaled, as many elements as its input, viewed as it; the memory
    attention's cut to the slots the step reads, the last), in the order
    the loop through autograd asks for them."""

    def __init__(self, masks):
        super().__init__(p=0.5)  # a rate that drops: the masks are the dropout
        self.masks = iter(masks)

    def forward(self, x, inplace=False):
        mask = next(self.masks)
        return x * mask[..., mask.size(-1) - x.size(-1):].reshape(x.shape)


def replay(block, layers, monkeypatch):
    """Each layer's dropout modules replaying what `block` (a FusedFeedbackLoop) drew for it."""
    drawn = block.records.dropout.unpacked()  # [steps, layers, ...]
    for i, layer in enumerate(layers):
        for module, masks in [(layer, [m for at_t in drawn.residual[:, i] for m in at_t]),  # sublayers in order
                              (layer.self_attn, drawn.attention[:, i])]:
            monkeypatch.setattr(module, "dropout_module", ReplayedDropout(masks))
        monkeypatch.setattr(layer, "activation_dropout_module", ReplayedDropout(drawn.activation[:, i]))
        if layer.encoder_attn is not None:
            monkeypatch.setattr(layer.encoder_attn, "dropout_module", ReplayedDropout(drawn.encoder_attention[:, i]))


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", [[], ["--decoder-normalize-before", "--relative-positions"]],
                         ids=["post-norm", "pre-norm"])
def test_with_dropout_the_fused_block_trains_as_the_loop_through_autograd_with_its_masks(
        flags, depth, monkeypatch):
    """The block draws every mask at once (the residual branches', the
    feed-forward hidden layer's, the attention weights' over the memory
    and over the encoder); the loop through autograd, given those masks,
    computes the same loss and gradients."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0.3", "--activation-dropout", "0.2",
                                      "--attention-dropout", "0.1", *flags, layers=depth)
    trained(model).train()
    src, src_lengths, prev = batch(d)
    target = torch.randint(d.nspecial, len(d), prev.shape)
    blocks = fused_blocks(monkeypatch)
    torch.manual_seed(0)
    model.zero_grad()
    fused = loss_and_gradients(model, lambda: model(src, src_lengths, prev)[0], target)
    (block,) = blocks
    drawn = block.records.dropout.unpacked()
    assert None not in drawn and len(drawn.residual) > CHUNK  # chunks unpacked again in the backward
    replay(block, model.decoder.layers, monkeypatch)
    with through_autograd(model):
        torch.manual_seed(0)  # the encoder's and the embeddings' dropout as before
        model.zero_grad()
        reference = loss_and_gradients(model, lambda: model(src, src_lengths, prev)[0], target)
    assert_same_loss_and_gradients(fused, reference)
    # the masks are dropout's: about 1 - p kept, scaled by 1 / (1 - p)
    for masks, p in zip(drawn, (0.3, 0.2, 0.1, 0.1)):
        assert torch.equal(masks.unique(), torch.tensor([0, 1 / (1 - p)]))
        assert abs(float((masks > 0).float().mean()) - (1 - p)) < 0.1


def test_every_step_and_layer_of_a_block_draws_dropout_masks_of_its_own(monkeypatch):
    """The loop through autograd draws a fresh mask at each step of each
    layer. A block's one draw must hold as many: one mask repeated over the
    steps or the layers would replay the same through autograd (the test
    above) and drop at the same rate, yet drop the same units at every step
    or layer. Each kind that is on: the masks the layers read at (t, i) are
    the draw's [t, i], and no two steps of a layer, nor two layers at a
    step, share one (a rate of 0.5 over at least 30 elements: a chance
    repeat is below 1e-9)."""
    model, d = tiny_translation_model("--memory-span", "16", "--dropout", "0.5", "--activation-dropout", "0.5",
                                      "--attention-dropout", "0.5")
    model.train()
    src, src_lengths, prev = batch(d)
    blocks = fused_blocks(monkeypatch)
    model(src, src_lengths, prev)
    (block,) = blocks
    steps, layers = prev.size(1), len(block.layers)
    assert layers == 3 and steps > CHUNK
    for kind, drawn in block.records.dropout.unpacked()._asdict().items():
        assert drawn is not None and drawn.shape[:2] == (steps, layers), kind
        for t in range(steps):
            for i in range(layers):
                read = getattr(block.records.dropout.at(t)[i], kind)  # the memory attention's: the slots step t reads
                assert torch.equal(read, drawn[t, i][..., drawn.size(-1) - read.size(-1):]), (kind, t, i)
        for layer in range(layers):
            assert len(drawn[:, layer].flatten(1).unique(dim=0)) == steps, f"{kind} repeats across steps"
        for step in range(steps):
            assert len(drawn[step].flatten(1).unique(dim=0)) == layers, f"{kind} repeats across layers"


def held_bytes(holder) -> int:
    """The bytes of the storages that `holder` holds: its tensors, in it,
    in its attributes, and in their lists and tuples, each storage once."""
    storages = {}

    def walk(x, attributes=False):
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
        elif attributes:
            for value in vars(x).values():
                walk(value)

    walk(holder, attributes=True)
    return sum(storages.values())


def test_a_block_holds_at_most_an_eighth_of_its_dropout_masks_in_the_dtype(monkeypatch):
    """In the dtype, a block's masks take as much as its weights' inputs
    (the memory attention's: [steps, layers, rows x heads, 1, span], 201 MB
    a stream at enwik8's span in fp16). The block holds them as bits and
    one chunk of steps unpacked: at 128 steps, an eighth or less."""
    model, d = tiny_translation_model("--memory-span", "16", "--dropout", "0.5", "--activation-dropout", "0.5",
                                      "--attention-dropout", "0.5")
    model.train()
    src, src_lengths, prev = batch(d, tgt_len=128)
    blocks = fused_blocks(monkeypatch)
    model(src, src_lengths, prev)
    (block,) = blocks
    in_the_dtype = sum(masks.numel() * masks.element_size() for masks in block.records.dropout.unpacked())
    assert held_bytes(block.records.dropout) <= in_the_dtype / 8


def test_under_layerdrop_the_fused_block_trains_the_layers_kept():
    model, d = tiny_translation_model("--decoder-layerdrop", "0.5", "--decoder-layers", "6", "--dropout", "0",
                                      "--decoder-normalize-before")
    trained(model).train()
    src, src_lengths, prev = batch(d)
    target = torch.randint(d.nspecial, len(d), prev.shape)
    kept = set()
    for seed in range(3):  # LayerDrop's pattern from the seed: the same both ways
        fused, reference = both_ways(model, lambda: model(src, src_lengths, prev)[0], target, seed)
        assert_same_loss_and_gradients(fused, reference)
        kept.add(sum(name.startswith("decoder.") and name.endswith("fc1.weight") for name in fused[1]))
    assert min(kept) < 6


def test_an_option_the_block_does_not_cover_runs_through_autograd_said_once(caplog, monkeypatch):
    model, d = tiny_translation_model("--persistent-vectors", "2")
    src, src_lengths, prev = batch(d)
    ran = loop_runs(monkeypatch)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            model(src, src_lengths, prev)[0].sum().backward()
    assert [type(runner) for runner in ran] == [ReferenceLoop] * 2  # step by step
    said = [r.message for r in caplog.records if "--persistent-vectors" in r.message]
    assert said == ["feedback loop: --persistent-vectors runs step by step through autograd, not as one fused block "
                    "(the same numbers, more operators)"]


def test_a_second_backward_over_one_block_is_refused_with_the_reason():
    model, d = tiny_translation_model("--dropout", "0")
    src, src_lengths, prev = batch(d)
    loss = model(src, src_lengths, prev)[0].sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice over one block"):
        loss.backward()


@pytest.mark.parametrize("flags", [["--decoder-normalize-before"], ["--no-feed-forward"]],
                         ids=["pre-norm (the memory's norm too)", "no feed-forward"])
def test_the_blocks_parameters_and_their_gradients_follow_one_list_of_its_weighted_modules(flags, monkeypatch):
    """fused_layer.WEIGHTED names a layer's weighted modules once, for the
    layer and for its pieces alike: the parameters the block takes pair up
    with the pieces that make their gradients; a backward that made a
    gradient too few or too many would fail with the field it missed."""
    model, d = tiny_translation_model("--dropout", "0", *flags, layers=2)
    src, src_lengths, prev = batch(d)
    blocks = fused_blocks(monkeypatch)
    model(src, src_lengths, prev)[0].sum().backward()
    (block,) = blocks
    pieces = block_weighted(block.kv_proj, block.memory_layer_norm, block.layers)
    paired = [p for piece in pieces for p in (piece.weight, piece.bias)]
    assert len(paired) == len(block.inputs.parameters) and all(a is b for a, b in zip(paired, block.inputs.parameters))
    # every weight of the layers and the memory (but the encoder's keys' and values', projected once per sentence)
    unpaired = {name for name, p in [*model.decoder.layers.named_parameters(), *model.decoder.memory.named_parameters()]
                if not any(p is q for q in paired)}
    assert unpaired == {"layer_weights", *(f"{i}.encoder_attn.{proj}.{kind}" for i in range(2)
                                           for proj in ("k_proj", "v_proj") for kind in ("weight", "bias"))}
    one_short = block.inputs._replace(parameters=block.inputs.parameters[:-1])
    with pytest.raises(RuntimeError, match=f"made {len(paired) - 1} gradients for its {len(paired)} parameters"):
        block.inputs.flat_gradients(one_short)


def changed_without_autograd(change):
    def hook(block):
        with torch.no_grad():
            change(block)
    return hook


# what a block's backward reads again, changed in place once its forward has run (on_loop_runs)
CHANGED_IN_PLACE = {
    "its memory vectors (an output)": lambda block: block.records.memories.mul_(2),
    "its states, which its layers' inputs are views of": lambda block: block.records.states[1].add_(1),
    "a layer's weight": lambda block: block.inputs.parameters[-2].add_(1),
    "the encoder's keys and values": lambda block: block.inputs.encoder_kv.mul_(2),
}


@pytest.mark.parametrize("change", CHANGED_IN_PLACE.values(), ids=CHANGED_IN_PLACE.keys())
def test_a_backward_over_what_was_changed_in_place_since_the_forward_is_refused(change, monkeypatch):
    """The block's backward reads the records its forward wrote (views of
    its outputs) and some of its inputs again: changed in place in between,
    they would give a wrong gradient with no error. Autograd refuses instead
    (the states, whose view the block hands out, as soon as that view is read)."""
    model, d = tiny_translation_model("--dropout", "0")
    src, src_lengths, prev = batch(d)
    on_loop_runs(monkeypatch, changed_without_autograd(change))
    with pytest.raises(RuntimeError, match="modified (by an )?inplace"):
        model(src, src_lengths, prev)[0].sum().backward()


def test_decoding_without_gradients_records_nothing_for_a_backward(monkeypatch):
    """Evaluation and search run the block's forward alone."""
    d = make_dictionary()
    model, _ = tiny_lm(dictionary=d)
    model.eval()
    blocks = fused_blocks(monkeypatch)
    with torch.no_grad():
        model(torch.randint(d.nspecial, len(d), (2, 5)))
    (block,) = blocks
    assert not block.recording
    assert not block.kv_proj.inputs.kept and not block.layers[1].self_attn.queries


def test_evaluation_draws_no_dropout_and_dropout_retained_in_inference_runs_through_autograd(caplog, monkeypatch):
    """Evaluated, the block draws no mask. fairseq's --retain-dropout keeps
    chosen dropout modules on in inference (--retain-dropout-modules; here
    the memory attention's alone): the loop through autograd applies them."""
    model, d = tiny_translation_model("--dropout", "0.3", "--attention-dropout", "0.2", "--activation-dropout", "0.1")
    model.eval()
    src, src_lengths, prev = batch(d)
    ran = loop_runs(monkeypatch)
    with torch.no_grad():
        model(src, src_lengths, prev)
    (block,) = ran
    assert isinstance(block, FusedFeedbackLoop) and block.records.dropout.unpacked() == NO_DROPOUT
    for name, module in model.named_modules():  # as fairseq-generate's model.prepare_for_inference_ does
        if isinstance(module, FairseqDropout):
            module.make_generation_fast_(name, retain_dropout=True, retain_dropout_modules=["FeedbackAttention"])
    with torch.no_grad(), caplog.at_level(logging.INFO):
        twice = [model(src, src_lengths, prev)[0] for _ in range(2)]
    assert [type(runner) for runner in ran[1:]] == [ReferenceLoop] * 2 and not torch.equal(*twice)
    assert any("--retain-dropout runs step by step" in r.message for r in caplog.records)


@pytest.mark.parametrize("flags", [[], ["--persistent-vectors", "2"]], ids=["fused", "not covered"])
def test_a_graphed_search_step_runs_the_fused_layers_where_they_cover_the_options(flags, monkeypatch):
    """Graphed decoding's step (FeedbackLoop.step; an eager
    search runs the fused block) runs fused_step, and reference_step
    where the fused layers do not cover an option."""
    model, d = tiny_translation_model(*flags)
    model.eval()
    model.decoder.use_cuda_graphs("emulate")
    src, src_lengths, prev = batch(d)
    ran = loop_runs(monkeypatch)
    state = {}
    encoder_out = model.encoder(src, src_lengths=src_lengths)
    with torch.no_grad():
        for t in range(prev.size(1)):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
    used, unused = (reference_step, fused_step) if flags else (fused_step, reference_step)
    assert ran.count(used) >= prev.size(1) and unused not in ran
    assert model.graph_statistics().failed is None
